"""[ppo] RL math vs. numpy oracles and hand-checked numbers.

GAE, whitening, clipped value loss, REINFORCE++(-baseline), GSPO, DAPO
dynamic sampling and overlong shaping.
"""

import functools
import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.rl import aggregation
from rlhf_jax.rl import critic
from rlhf_jax.rl import dapo
from rlhf_jax.rl import registry


# ----------------------------------------------------------------- oracles ---
def np_gae(r, v, m, gamma, lam):
  """Textbook backward loop over each row's valid span."""
  adv = np.zeros(r.shape)
  for b in range(r.shape[0]):
    last = 0.0
    for t in reversed(range(r.shape[1])):
      if not m[b, t]:
        last = 0.0
        continue
      nxt = m[b, t + 1] if t + 1 < r.shape[1] else 0
      v_next = v[b, t + 1] if nxt else 0.0
      delta = r[b, t] + gamma * v_next - v[b, t]
      last = delta + gamma * lam * (last if nxt else 0.0)
      adv[b, t] = last
  return adv, (adv + v) * m


def np_returns(r, m, gamma):
  return np_gae(r, np.zeros_like(r), m, gamma, 1.0)[0]


def np_whiten(x, m):
  vals = x[m > 0].astype(np.float64)
  return np.where(m > 0, (x - vals.mean()) / math.sqrt(vals.var() + 1e-8), 0)


def np_value_loss(v, old, ret, clip):
  out = np.zeros(v.shape)
  for i in np.ndindex(v.shape):
    v_clip = old[i] + min(max(v[i] - old[i], -clip), clip)
    out[i] = 0.5 * max((v[i] - ret[i]) ** 2, (v_clip - ret[i]) ** 2)
  return out


def np_last_token(scores, m):
  out = np.zeros(m.shape)
  for b in range(m.shape[0]):
    valid = np.flatnonzero(m[b])
    if len(valid):
      out[b, valid[-1]] = scores[b]
  return out


def np_gspo_objective(logp, old, adv_B, m, lo, hi):
  """Sequence-level GSPO loss: mean over rows of max(-A s, -A clip(s))."""
  rows = []
  for b in range(logp.shape[0]):
    if not m[b].sum():
      continue
    s = math.exp(((logp[b] - old[b]) * m[b]).sum() / m[b].sum())
    a = float(adv_B[b])
    rows.append(max(-a * s, -a * min(max(s, 1 - lo), 1 + hi)))
  return np.mean(rows)


def spans(rng, b, t):
  """Masks of contiguous spans (prompt prefix masked), one empty row."""
  m = np.zeros((b, t), np.float32)
  for i in range(b - 1):
    start = rng.integers(0, t // 2)
    m[i, start:rng.integers(start + 1, t + 1)] = 1
  return m


class _Base(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(jax.numpy_rank_promotion("raise"))
    self.rng = np.random.default_rng(0)


# ---------------------------------------------------------------- critic ---
class CriticTest(_Base):

  @parameterized.parameters((1.0, 0.95), (0.9, 0.0), (0.99, 1.0))
  def test_gae_vs_oracle(self, gamma, lam):
    r = self.rng.normal(size=(5, 9)).astype(np.float32)
    v = self.rng.normal(size=(5, 9)).astype(np.float32)
    m = spans(self.rng, 5, 9)
    adv, ret = jax.jit(functools.partial(critic.gae, gamma=gamma, lam=lam))(
        r, v, m)
    want_adv, want_ret = np_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)

  def test_gae_hand_checked(self):
    # gamma = 1, lam = 0.5, r = [0, 1], V = [0.5, 0.2], one padding slot:
    # delta_1 = 1 - 0.2 = 0.8 (terminal), A_1 = 0.8;
    # delta_0 = 0 + 0.2 - 0.5 = -0.3, A_0 = -0.3 + 0.5 * 0.8 = 0.1.
    adv, ret = critic.gae(np.array([[0.0, 1, 7]]), np.array([[0.5, 0.2, 9]]),
                          np.array([[1, 1, 0]]), gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv, [[0.1, 0.8, 0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, [[0.6, 1.0, 0]], rtol=1e-6)

  def test_discounted_returns(self):
    r = self.rng.normal(size=(4, 7)).astype(np.float32)
    m = spans(self.rng, 4, 7)
    got = jax.jit(functools.partial(critic.discounted_returns, gamma=0.9))(r, m)
    np.testing.assert_allclose(got, np_returns(r, m, 0.9), rtol=1e-5,
                               atol=1e-6)
    # Hand-checked: 1 + 0.5 * 2 = 2.
    np.testing.assert_allclose(
        critic.discounted_returns(np.array([[1.0, 2, 5]]),
                                  np.array([[1, 1, 0]]), gamma=0.5),
        [[2.0, 2.0, 0.0]])

  def test_whiten(self):
    x = self.rng.normal(2.0, 3.0, size=(4, 6)).astype(np.float32)
    m = spans(self.rng, 4, 6)
    got = jax.jit(critic.masked_whiten)(x, m)
    np.testing.assert_allclose(got, np_whiten(x, m), rtol=1e-4, atol=1e-5)
    # Hand-checked: [1, 3] -> mean 2, std 1 -> [-1, 1]; masked 100 -> 0.
    np.testing.assert_allclose(
        critic.masked_whiten(np.array([1.0, 3, 100]), np.array([1, 1, 0])),
        [-1, 1, 0], rtol=1e-6)
    kept = critic.masked_whiten(np.array([1.0, 3]), np.ones(2),
                                shift_mean=False)
    np.testing.assert_allclose(kept, [1, 3], rtol=1e-6)

  def test_value_loss_vs_oracle_and_hand(self):
    v = self.rng.normal(size=(3, 5)).astype(np.float32)
    old = (v + self.rng.normal(scale=0.4, size=v.shape)).astype(np.float32)
    ret = self.rng.normal(size=v.shape).astype(np.float32)
    m = spans(self.rng, 3, 5)
    loss, metrics = jax.jit(functools.partial(critic.value_loss,
                                              clip_range=0.2))(v, old, ret, m)
    np.testing.assert_allclose(loss, np_value_loss(v, old, ret, 0.2) * m,
                               rtol=1e-5, atol=1e-6)
    # Oracle: the share of response tokens whose clipped branch is strictly
    # the larger (the element-wise max picks it).
    v64, old64, ret64 = (x.astype(np.float64) for x in (v, old, ret))
    v_clip = old64 + np.clip(v64 - old64, -0.2, 0.2)
    clipped = (v_clip - ret64) ** 2 > (v64 - ret64) ** 2
    want_frac = (clipped * m).sum() / m.sum()
    self.assertGreater(want_frac, 0.0)  # Both branches occur here.
    self.assertLess(want_frac, 1.0)
    self.assertAlmostEqual(float(metrics["vf_clip_frac"]), want_frac,
                           places=6)
    # Hand-checked: v=1, old=0, R=2, clip 0.2: v_clip = 0.2;
    # max((1-2)^2, (0.2-2)^2) / 2 = 3.24 / 2 = 1.62, clipped branch active.
    loss, metrics = critic.value_loss(np.array([[1.0]]), np.array([[0.0]]),
                                      np.array([[2.0]]), np.ones((1, 1)),
                                      clip_range=0.2)
    np.testing.assert_allclose(loss, [[1.62]], rtol=1e-6)
    self.assertEqual(float(metrics["vf_clip_frac"]), 1.0)
    # Gradient is 0 there: moving v towards R does not undo the clip.
    g = jax.grad(lambda x: critic.value_loss(
        x, jnp.zeros((1, 1)), jnp.full((1, 1), 2.0), jnp.ones((1, 1)))[0].sum()
                 )(jnp.ones((1, 1)))
    np.testing.assert_allclose(g, [[0.0]])
    plain, _ = critic.value_loss(np.array([[1.0]]), np.array([[0.0]]),
                                 np.array([[2.0]]), np.ones((1, 1)),
                                 clip_range=None)
    np.testing.assert_allclose(plain, [[0.5]])

  def test_last_token_rewards(self):
    m = spans(self.rng, 4, 6)
    s = np.arange(4, dtype=np.float32) + 1
    np.testing.assert_allclose(critic.last_token_rewards(s, m),
                               np_last_token(s, m))

  def test_ppo_targets_on_packed_rows_equal_one_sequence_per_row(self):
    """Sequences packed back to back in rows (`seq` ids, -1 between and
    after them, as `rl/packing.py` writes them) get the oracle's targets of
    each sequence alone: GAE restarts at every sequence, the score sits at
    each one's last token, the KL sums per sequence, the whitening is over
    all valid tokens."""
    B, T = 6, 7
    m = spans(self.rng, B, T)
    m[1, 2] = 0  # A hole (an environment's tokens): an episode end too.
    scores = self.rng.normal(size=B).astype(np.float32)
    logp = -self.rng.uniform(size=(B, T)).astype(np.float32)
    ref = -self.rng.uniform(size=(B, T)).astype(np.float32)
    v = self.rng.normal(size=(B, T)).astype(np.float32)
    # Each sequence's span (first to last valid token, its hole inside),
    # into rows of 12: [seq 0 | seq 1 | gap], [seq 2 | seq 3 | seq 4], ...
    W, L = 3, 12
    seq = np.full((W, L), -1, np.int32)
    at = {}  # b -> (row, column) of its span's first token.
    w, col = 0, 0
    for b in range(B):
      valid = np.flatnonzero(m[b])
      if not len(valid):
        continue
      n = valid[-1] - valid[0] + 1
      if col + n > L:
        w, col = w + 1, 0
      at[b] = (w, col)
      seq[w, col:col + n] = b
      col += n + (b == 1)  # A padding cell after sequence 1.
    packed = {k: np.zeros((W, L), np.float32) for k in ("m", "lp", "rf", "v")}
    for b, (w, col) in at.items():
      lo, hi = np.flatnonzero(m[b])[[0, -1]]
      for name, x in (("m", m), ("lp", logp), ("rf", ref), ("v", v)):
        packed[name][w, col:col + hi - lo + 1] = x[b, lo:hi + 1]
    seq_sums = lambda x: jax.ops.segment_sum(  # pylint: disable=g-long-lambda
        jnp.ravel(x), jnp.where(jnp.ravel(seq) >= 0, jnp.ravel(seq), B),
        num_segments=B, mode="drop")
    out = jax.jit(functools.partial(
        critic.ppo_targets, kl_coef=0.1, kl_estimator="k1", gamma=0.9,
        lam=0.8, whiten=True, seq_BxT=seq, sequence_sums=seq_sums))(
            scores, packed["lp"], packed["rf"], packed["v"], packed["m"])
    r = -0.1 * (logp - ref) * m
    for b in at:
      for t in np.flatnonzero(m[b]):  # Last token of each valid span.
        if t + 1 == T or not m[b, t + 1]:
          r[b, t] += scores[b]
    want_adv, want_ret = np_gae(r, v, m, 0.9, 0.8)
    sel = m > 0
    want_adv = np.where(sel, (want_adv - want_adv[sel].mean()) / np.sqrt(
        want_adv[sel].var() + 1e-8), 0.0)
    for b, (w, col) in at.items():
      lo, hi = np.flatnonzero(m[b])[[0, -1]]
      got = slice(col, col + hi - lo + 1)
      for key, want in (("advantages", want_adv), ("returns", want_ret),
                        ("token_rewards", r)):
        np.testing.assert_allclose(out[key][w, got], want[b, lo:hi + 1],
                                   rtol=1e-4, atol=1e-5, err_msg=f"{key} {b}")
    np.testing.assert_allclose(out["kl"], ((logp - ref) * m).sum(1),
                               rtol=1e-5, atol=1e-6)
    self.assertEqual(float(np.abs(np.asarray(out["advantages"])[
        packed["m"] == 0]).max()), 0.0)


# ---------------------------------------------------------- REINFORCE++ ---
  @parameterized.parameters((0.0,), (0.1,))
  def test_ppo_targets_vs_oracle(self, beta):
    """Score at the last token, -beta * k1 per token, then GAE + whitening."""
    B, T = 4, 8
    m = spans(self.rng, B, T)
    scores = self.rng.normal(size=B).astype(np.float32)
    logp = -self.rng.uniform(size=(B, T)).astype(np.float32)
    ref = -self.rng.uniform(size=(B, T)).astype(np.float32)
    v = self.rng.normal(size=(B, T)).astype(np.float32)
    out = jax.jit(functools.partial(
        critic.ppo_targets, kl_coef=beta, kl_estimator="k1", gamma=0.9,
        lam=0.8, whiten=True))(scores, logp, ref, v, m)
    r = -beta * (logp - ref) * m
    for b in range(B):
      valid = np.nonzero(m[b])[0]
      if len(valid):
        r[b, valid[-1]] += scores[b]
    want_adv, want_ret = np_gae(r, v, m, 0.9, 0.8)
    sel = m > 0
    want_adv = np.where(sel, (want_adv - want_adv[sel].mean()) / np.sqrt(
        want_adv[sel].var() + 1e-8), 0.0)
    np.testing.assert_allclose(out["token_rewards"], r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["returns"], want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["advantages"], want_adv, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(out["kl"], ((logp - ref) * m).sum(1),
                               rtol=1e-5, atol=1e-6)


class ReinforcePPTest(_Base):

  def test_sequence_form(self):
    r = np.array([1.0, 0, 0, 1, 1, 1], np.float32)
    got = registry.get("advantage", "reinforce_pp")(r, 3)
    np.testing.assert_allclose(got, np_whiten(r, np.ones(6)), rtol=1e-5)
    # Hand-checked: mean 2/3, std sqrt(2)/3 -> (1 - 2/3) / (sqrt(2)/3).
    self.assertAlmostEqual(float(got[0]), 1 / math.sqrt(2), places=5)
    base = registry.get("advantage", "reinforce_pp_baseline")(r, 3)
    # r - group mean = [2/3, -1/3, -1/3, 0, 0, 0]: batch mean 0, variance
    # (4/9 + 1/9 + 1/9) / 6 = 1/9, so whitened = [2, -1, -1, 0, 0, 0].
    np.testing.assert_allclose(base, [2, -1, -1, 0, 0, 0], rtol=1e-5,
                               atol=1e-6)
    # Grouped input keeps its shape.
    self.assertEqual(registry.get("advantage", "reinforce_pp_baseline")(
        r.reshape(2, 3)).shape, (2, 3))

  @parameterized.parameters("reinforce_pp", "reinforce_pp_baseline")
  def test_token_form_vs_oracle(self, name):
    b, t, g = 6, 7, 3
    r = self.rng.normal(size=(b,)).astype(np.float32)
    m = spans(self.rng, b + 1, t)[:b]  # No empty row here.
    kl = self.rng.normal(scale=0.1, size=(b, t)).astype(np.float32)
    fn = functools.partial(registry.get("advantage", name), group_size=g,
                           gamma=0.95)
    got = jax.jit(fn)(r, mask_BxT=m, token_rewards_BxT=-kl)
    seq = r if name == "reinforce_pp" else (
        r.reshape(-1, g) - r.reshape(-1, g).mean(1, keepdims=True)).reshape(-1)
    tok = np_last_token(seq, m) - kl * m
    want = np_whiten(np_returns(tok, m, 0.95), m)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ GSPO ---
class GSPOTest(_Base):

  def test_value_and_gradient_vs_sequence_oracle(self):
    b, t, lo, hi = 5, 6, 0.05, 0.08
    old = np.log(self.rng.uniform(0.1, 1, size=(b, t))).astype(np.float32)
    logp = (old + self.rng.normal(scale=0.1, size=(b, t))).astype(np.float32)
    adv = self.rng.normal(size=(b,)).astype(np.float32)
    m = spans(self.rng, b, t)
    fn = registry.get("policy_loss", "gspo")

    def objective(lp):
      loss, _ = fn(lp, old, adv, m, clip_low=lo, clip_high=hi)
      return aggregation.aggregate_loss(loss, m, "seq-mean-token-mean")

    value, grad = jax.jit(jax.value_and_grad(objective))(logp)
    want = np_gspo_objective(logp, old, adv, m, lo, hi)
    self.assertAlmostEqual(float(value), want, places=5)
    # Central differences of the float64 oracle.
    num = np.zeros((b, t))
    lp64 = logp.astype(np.float64)
    for i in np.ndindex(b, t):
      d = np.zeros((b, t))
      d[i] = 1e-6
      num[i] = (np_gspo_objective(lp64 + d, old, adv, m, lo, hi)
                - np_gspo_objective(lp64 - d, old, adv, m, lo, hi)) / 2e-6
    np.testing.assert_allclose(grad, num, rtol=1e-3, atol=1e-5)

  def test_packed_rows_give_each_sequence_its_own_ratio(self):
    """The sequences of the oracle test laid in packed rows (two or three
    a row, prompt cells and a gap between them, the batch's sample indices
    in `seq`) take the per-sequence objective and its gradient, with
    "seq-mean-token-mean" aggregating per packed sequence."""
    b, t, lo, hi = 7, 6, 0.05, 0.08
    old = np.log(self.rng.uniform(0.1, 1, size=(b, t))).astype(np.float32)
    logp = (old + self.rng.normal(scale=0.1, size=(b, t))).astype(np.float32)
    adv = self.rng.normal(size=(b,)).astype(np.float32)
    m = spans(self.rng, b, t)  # Row b - 1 empty: a sequence of no tokens.
    rows, width = ((0, 1, 2), (3, 4), (5, 6)), 3 * (t + 2)
    seq = np.full((3, width), -1, np.int32)
    cells = {}  # Sequence -> (packed row, first column).
    for r, members in enumerate(rows):
      at = 0
      for i in members:
        at += 2  # Two prompt cells of no sequence.
        cells[i] = (r, at)
        # As `packing.pack` writes them: a sequence's cells start at its
        # first trained token (its masked prefix is prompt) and run on
        # over masked ones.
        first = np.flatnonzero(m[i])
        if len(first):
          seq[r, at + first[0]:at + t] = 500 + 11 * i
        at += t
    def to_packed(x, fill=0.0):
      out = np.full((3, width), fill, np.float32)
      for i, (r, at) in cells.items():
        out[r, at:at + t] = x[i]
      return out
    seq_len = to_packed(np.broadcast_to(m.sum(1, keepdims=True), (b, t)))
    packed = {"seq": seq, "seq_len": seq_len,
              "row_seqs": np.array([3, 2, 2], np.float32)}
    fn = registry.get("policy_loss", "gspo")
    adv_packed = to_packed(np.broadcast_to(adv[:, None], (b, t)))

    def objective(lp):
      loss, metrics = fn(lp, to_packed(old), adv_packed, to_packed(m),
                         clip_low=lo, clip_high=hi, seq_BxT=seq)
      num, weight = aggregation.aggregate_terms(
          loss, to_packed(m), "seq-mean-token-mean", packed=packed)
      return num / weight, metrics

    (value, metrics), grad = jax.jit(jax.value_and_grad(
        objective, has_aux=True))(to_packed(logp))
    want = np_gspo_objective(logp, old, adv, m, lo, hi)
    self.assertAlmostEqual(float(value), want, places=5)
    valid = m.sum(1) > 0  # Some sequences clipped, some not (both ways).
    s = np.exp(((logp - old) * m).sum(1)[valid] / m.sum(1)[valid])
    self.assertTrue(0 < np.mean((s < 1 - lo) | (s > 1 + hi)) < 1)
    np.testing.assert_allclose(
        metrics["seq_log_ratio"],
        (np.log(s) * m.sum(1)[valid]).sum() / m.sum(), rtol=1e-5)
    num = np.zeros((b, t))
    lp64 = logp.astype(np.float64)
    for i in np.ndindex(b, t):
      d = np.zeros((b, t))
      d[i] = 1e-6
      num[i] = (np_gspo_objective(lp64 + d, old, adv, m, lo, hi)
                - np_gspo_objective(lp64 - d, old, adv, m, lo, hi)) / 2e-6
    np.testing.assert_allclose(grad, to_packed(num), rtol=1e-3, atol=1e-5)

  def test_hand_checked(self):
    # Token log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.2214; A = 1,
    # clip_high 0.1 -> loss = max(-1.2214, -1.1) = -1.1 on both tokens.
    logp = np.array([[0.1, 0.3, 5.0]], np.float32)
    loss, metrics = registry.get("policy_loss", "gspo")(
        logp, np.zeros_like(logp), np.array([1.0]), np.array([[1, 1, 0]]),
        clip_low=0.1, clip_high=0.1)
    np.testing.assert_allclose(loss, [[-1.1, -1.1, 0.0]], rtol=1e-6)
    self.assertEqual(float(metrics["clip_frac"]), 1.0)
    self.assertAlmostEqual(float(metrics["seq_log_ratio"]), 0.2, places=6)
    # Unclipped: A = -1, s = exp(0.2) in range -> loss = 1.2214 per token.
    loss, _ = registry.get("policy_loss", "gspo")(
        logp, np.zeros_like(logp), np.array([-1.0]), np.array([[1, 1, 0]]),
        clip_low=0.5, clip_high=0.5)
    np.testing.assert_allclose(loss[0, :2], [math.exp(0.2)] * 2, rtol=1e-6)


# ------------------------------------------------------------------ DAPO ---
class DynamicSamplingTest(_Base):

  def test_never_selects_zero_variance_and_static_shape(self):
    for trial in range(50):
      c = int(self.rng.integers(1, 12))
      r = self.rng.integers(0, 2, size=(c, 4)).astype(np.float32)
      idx, valid = dapo.select_groups(r, 5)
      self.assertEqual(idx.shape, (5,))
      self.assertEqual(valid.shape, (5,))
      self.assertTrue(np.all((idx >= 0) & (idx < c)), trial)
      self.assertTrue(np.all(r[idx[valid]].std(axis=1) > 0), trial)
      self.assertLen(set(idx[valid].tolist()), int(valid.sum()))
      informative = np.flatnonzero(r.std(axis=1) > 0)
      self.assertEqual(int(valid.sum()), min(5, len(informative)))
      np.testing.assert_array_equal(idx[valid], informative[:5])
      if valid.any():  # Padding slots also point at informative groups.
        self.assertTrue(np.all(r[idx].std(axis=1) > 0), trial)

  def test_refill_loop(self):
    # Round 1 has one informative group; round 2 completes the batch.
    round1 = np.array([[1.0, 1], [0, 1], [0, 0]])
    round2 = np.array([[2.0, 2], [3, 4], [5, 6]])
    idx, valid = dapo.select_groups(round1, 2)
    np.testing.assert_array_equal(idx, [1, 1])
    np.testing.assert_array_equal(valid, [True, False])
    idx, valid = dapo.select_groups(np.concatenate([round1, round2]), 2)
    np.testing.assert_array_equal(idx, [1, 4])
    self.assertTrue(valid.all())
    rows, valid_b = dapo.group_rows(idx, valid, 2)
    np.testing.assert_array_equal(rows, [2, 3, 8, 9])
    self.assertTrue(valid_b.all())
    idx, valid = dapo.select_groups(np.ones((3, 2)), 2)
    np.testing.assert_array_equal(idx, [0, 0])
    self.assertFalse(valid.any())

  def test_overlong_penalty(self):
    # max_len 20, cache 4 -> expected 16: 16 -> 0, 18 -> -0.5, 21 -> -1.
    got = dapo.overlong_penalty(np.array([3, 16, 18, 20, 21]), max_len=20,
                                cache_len=4)
    np.testing.assert_allclose(got, [0, 0, -0.5, -1, -1], rtol=1e-6)
    want = [0 if n <= 16 else (16 - n) / 4 if n <= 20 else -1
            for n in range(30)]
    np.testing.assert_allclose(
        jax.jit(functools.partial(dapo.overlong_penalty, max_len=20,
                                  cache_len=4))(np.arange(30)), want,
        rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "cache_len"):
      dapo.overlong_penalty(np.array([1]), max_len=4, cache_len=5)


if __name__ == "__main__":
  absltest.main()
