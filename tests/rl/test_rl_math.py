"""RL math vs. numpy oracles and hand-checked numbers; registry errors."""

import functools
import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.rl import advantages
from rlhf_jax.rl import aggregation
from rlhf_jax.rl import logprobs
from rlhf_jax.rl import losses
from rlhf_jax.rl import registry

_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------- oracles ---
def np_grpo(r, g, eps=1e-6):
  out = []
  for grp in np.asarray(r, np.float64).reshape(-1, g):
    out += [(x - grp.mean()) / (np.std(grp, ddof=1) + eps) for x in grp]
  return np.array(out)


def np_drgrpo(r, g):
  return np.concatenate(
      [grp - grp.mean() for grp in np.asarray(r, np.float64).reshape(-1, g)]
  )


def np_rloo(r, g):
  out = []
  for grp in np.asarray(r, np.float64).reshape(-1, g):
    out += [x - np.delete(grp, i).mean() for i, x in enumerate(grp)]
  return np.array(out)


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_token_logprobs(logits, targets):
  lsm = np_log_softmax(logits)
  b, t = targets.shape
  return np.array(
      [[lsm[i, j, targets[i, j]] for j in range(t)] for i in range(b)]
  )


def np_entropy(logits):
  lsm = np_log_softmax(logits)
  return -(np.exp(lsm) * lsm).sum(-1)


def np_ppo(logp, old, adv, clip_low, clip_high, clip_c):
  """Textbook per-element PPO (+ dual-clip) loss, as nested loops."""
  loss = np.zeros(logp.shape)
  for idx in np.ndindex(logp.shape):
    ratio = math.exp(logp[idx] - old[idx])
    a = adv[idx]
    clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
    value = max(-a * ratio, -a * clipped)
    if clip_c is not None and a < 0:
      value = min(value, -a * clip_c)
    loss[idx] = value
  return loss


def np_kl(logp, ref, kind):
  d = np.asarray(logp, np.float64) - np.asarray(ref, np.float64)
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d**2
  r = np.exp(-d)
  return r - np.log(r) - 1


def np_aggregate(loss, mask, mode, max_len):
  loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
  if mode == "token-mean":
    return (loss * mask).sum() / mask.sum()
  if mode == "seq-mean-token-mean":
    rows = [(l * m).sum() / m.sum() for l, m in zip(loss, mask) if m.sum()]
    return np.mean(rows)
  return np.mean([(l * m).sum() / max_len for l, m in zip(loss, mask)])


def random_mask(rng, b, t):
  """Right-padded masks with lengths 1..t, one empty row."""
  lengths = rng.integers(1, t + 1, size=b)
  lengths[-1] = 0
  return (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)


def jit(fn, **static_kwargs):
  """jit(fn) with keyword arguments bound; one compile instead of many ops."""
  return jax.jit(functools.partial(fn, **static_kwargs))


class _Base(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(jax.numpy_rank_promotion("raise"))
    self.rng = np.random.default_rng(0)


# -------------------------------------------------------------- advantages ---
class AdvantagesTest(_Base):

  @parameterized.parameters(
      ("grpo", np_grpo), ("drgrpo", np_drgrpo), ("rloo", np_rloo)
  )
  def test_vs_numpy_oracle_flat_and_grouped(self, name, oracle):
    fn = registry.get("advantage", name)
    r = self.rng.normal(size=(6 * 4,)).astype(np.float32)
    got = jax.jit(fn, static_argnums=1)(r, 4)
    np.testing.assert_allclose(got, oracle(r, 4), rtol=1e-5, atol=1e-6)
    got_NxG = jax.jit(fn)(r.reshape(6, 4))
    self.assertEqual(got_NxG.shape, (6, 4))
    np.testing.assert_allclose(got_NxG.reshape(-1), got, rtol=1e-6)

  def test_grpo_hand_checked(self):
    # mean 0.5; sample std sqrt((4 * 0.25) / 3) = 1/sqrt(3);
    # c = 0.5 / (1/sqrt(3) + 1e-6) = 0.8660239...
    c = 0.5 / (1 / math.sqrt(3) + 1e-6)
    self.assertAlmostEqual(c, 0.86602390, places=7)
    grpo = jit(advantages.grpo_advantages, group_size=4)
    got = grpo(np.array([1.0, 0, 0, 1]))
    np.testing.assert_allclose(got, np.array([1, -1, -1, 1]) * c, rtol=1e-6)

  def test_grpo_constant_group_is_zero(self):
    got = jit(advantages.grpo_advantages, group_size=3)(
        np.array([3.0, 3, 3, 1, 0, 0])
    )
    np.testing.assert_allclose(got[:3], 0.0)
    self.assertTrue(np.all(np.isfinite(got)))

  def test_drgrpo_hand_checked(self):
    got = jit(advantages.drgrpo_advantages, group_size=4)(
        np.array([1.0, 0, 0, 1])
    )
    np.testing.assert_allclose(got, [0.5, -0.5, -0.5, 0.5], rtol=1e-6)

  def test_rloo_hand_checked(self):
    # r_i - mean(others): 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3.
    got = jit(advantages.rloo_advantages, group_size=4)(
        np.array([1.0, 0, 0, 1])
    )
    np.testing.assert_allclose(got, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)

  def test_bad_group_size_raises(self):
    with self.assertRaisesRegex(ValueError, "groups of 4"):
      advantages.grpo_advantages(np.zeros((6,)), 4)
    with self.assertRaisesRegex(ValueError, "group_size"):
      advantages.rloo_advantages(np.zeros((6,)))

  def test_token_advantages(self):
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    got = jax.jit(advantages.token_advantages)(np.array([2.0, -1.0]), mask)
    np.testing.assert_allclose(got, [[2, 2, 0], [-1, 0, 0]])


# ---------------------------------------------------------------- logprobs ---
class LogprobsTest(_Base):

  def test_vs_numpy_oracle(self):
    logits = self.rng.normal(size=(3, 5, 11)).astype(np.float32) * 4
    targets = self.rng.integers(0, 11, size=(3, 5))
    got = jax.jit(logprobs.token_logprobs)(logits, targets)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(
        got, np_token_logprobs(logits, targets), rtol=1e-5, atol=1e-5
    )
    ent = jax.jit(logprobs.token_entropy)(logits)
    np.testing.assert_allclose(ent, np_entropy(logits), rtol=1e-5, atol=1e-5)

  def test_temperature_and_bf16(self):
    logits = jnp.asarray(self.rng.normal(size=(2, 4, 7)), jnp.bfloat16)
    targets = self.rng.integers(0, 7, size=(2, 4))
    got = jit(logprobs.token_logprobs, temperature=0.7)(logits, targets)
    self.assertEqual(got.dtype, jnp.float32)
    want = np_token_logprobs(np.asarray(logits, np.float64) / 0.7, targets)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_hand_checked(self):
    # softmax([0, log 3]) = [1/4, 3/4].
    logits = np.array([[[0.0, math.log(3.0)]]], np.float32)
    got = jax.jit(logprobs.token_logprobs)(logits, np.array([[1]]))
    np.testing.assert_allclose(got, [[math.log(0.75)]], rtol=1e-6)
    # H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351...
    ent = jax.jit(logprobs.token_entropy)(logits)
    np.testing.assert_allclose(ent, [[0.5623351446]], rtol=1e-6)

  def test_entropy_with_masked_vocab_is_finite(self):
    logits = np.array([[[0.0, -np.inf, 0.0]]], np.float32)
    np.testing.assert_allclose(
        jax.jit(logprobs.token_entropy)(logits), [[math.log(2.0)]], rtol=1e-6
    )


# ------------------------------------------------------------------ losses ---
class PolicyLossTest(_Base):

  @parameterized.parameters((0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3))
  def test_vs_numpy_oracle(self, clip_low, clip_high, clip_c):
    b, t = 4, 6
    old = np.log(self.rng.uniform(0.05, 1, size=(b, t))).astype(np.float32)
    logp = (old + self.rng.normal(scale=0.6, size=(b, t))).astype(np.float32)
    adv_B = self.rng.normal(size=(b,)).astype(np.float32)
    mask = random_mask(self.rng, b, t)
    fn = functools.partial(
        registry.get("policy_loss", "ppo"),
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
    )
    loss, metrics = jax.jit(fn)(logp, old, adv_B, mask)
    adv_BxT = np.broadcast_to(adv_B[:, None], (b, t))
    want = np_ppo(logp, old, adv_BxT, clip_low, clip_high, clip_c) * mask
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    ratio = np.exp(logp.astype(np.float64) - old)
    clipped = np.clip(ratio, 1 - clip_low, 1 + clip_high)
    active = (-adv_BxT * clipped > -adv_BxT * ratio) * mask
    self.assertAlmostEqual(
        float(metrics["clip_frac"]), active.sum() / mask.sum(), places=6
    )
    self.assertAlmostEqual(
        float(metrics["approx_kl"]),
        (np_kl(logp, old, "k3") * mask).sum() / mask.sum(),
        places=5,
    )

  def test_hand_checked(self):
    # ratios 1.5, 0.5, 0.5, 5 with A = 1, 1, -1, -1; clip 0.2, dual-clip 3:
    # max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5;
    # max(0.5, 0.8) = 0.8 (clipped); min(max(5, 1.2), 3) = 3 (dual-clipped).
    logp = np.log(np.array([[1.5, 0.5, 0.5, 5.0]], np.float32))
    adv = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    loss, metrics = jit(losses.ppo_policy_loss, clip_c=3.0)(
        logp, np.zeros((1, 4), np.float32), adv, np.ones((1, 4))
    )
    np.testing.assert_allclose(loss, [[-1.2, -0.5, 0.8, 3.0]], rtol=1e-6)
    self.assertAlmostEqual(float(metrics["clip_frac"]), 0.5)
    self.assertAlmostEqual(float(metrics["clip_frac_high"]), 0.25)
    self.assertAlmostEqual(float(metrics["clip_frac_low"]), 0.25)
    self.assertAlmostEqual(float(metrics["dual_clip_frac"]), 0.25)

  def test_clipped_tokens_have_no_gradient(self):
    def total(logp):
      loss, _ = losses.ppo_policy_loss(
          logp, jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2))
      )
      return loss.sum()

    # ratio 1.5 is clipped (grad 0); ratio 1.0 is not (d(-r)/dlogp = -1).
    grad = jax.jit(jax.grad(total))(np.log(np.array([[1.5, 1.0]], np.float32)))
    np.testing.assert_allclose(grad, [[0.0, -1.0]], atol=1e-6)

  def test_bad_dual_clip_raises(self):
    with self.assertRaisesRegex(ValueError, "clip_c must be > 1"):
      losses.ppo_policy_loss(
          np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1,)),
          np.ones((1, 1)), clip_c=0.5,
      )


class CISPOTest(_Base):
  """CISPO: the gradient sg(clip(r)) * A * grad log pi per token, against
  numpy and by hand; clipped tokens keep their gradient (unlike PPO's)."""

  @parameterized.parameters((0.2, 0.28), (1.0, 0.28), (5.0, 0.1))
  def test_vs_numpy_oracle(self, clip_low, clip_high):
    b, t = 4, 6
    old = np.log(self.rng.uniform(0.05, 1, size=(b, t))).astype(np.float32)
    logp = (old + self.rng.normal(scale=0.6, size=(b, t))).astype(np.float32)
    adv_B = self.rng.normal(size=(b,)).astype(np.float32)
    mask = random_mask(self.rng, b, t)
    fn = functools.partial(losses.cispo_policy_loss, clip_low=clip_low,
                           clip_high=clip_high)
    loss, metrics = jax.jit(fn)(logp, old, adv_B, mask)
    ratio = np.exp(logp.astype(np.float64) - old)
    weight = np.clip(ratio, max(0.0, 1 - clip_low), 1 + clip_high)
    adv_BxT = np.broadcast_to(adv_B[:, None], (b, t))
    np.testing.assert_allclose(loss, -adv_BxT * weight * mask, rtol=1e-5,
                               atol=1e-6)
    # d loss_t / d logp_t = -A * clip(r): the weight carries no gradient.
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, old, adv_B, mask)[0])))(
        logp)
    np.testing.assert_allclose(grad, -adv_BxT * weight * mask, rtol=1e-5,
                               atol=1e-6)
    outside = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)) * mask
    self.assertGreater(outside.sum(), 0)  # The clip is exercised.
    self.assertAlmostEqual(float(metrics["clip_frac"]),
                           outside.sum() / mask.sum(), places=6)
    self.assertAlmostEqual(float(metrics["ratio_mean"]),
                           (ratio * mask).sum() / mask.sum(), places=5)

  def test_hand_checked_and_clipped_tokens_keep_their_gradient(self):
    # ratios 1.5, 0.5, 1.0 with A = 1, -1, 2; clip 0.2 / 0.28: weights
    # 1.28, 0.8, 1.0; loss -A * w = -1.28, 0.8, -2.0; the gradient is the
    # same. PPO gives the clipped tokens (1.5 with A > 0, 0.5 with A < 0)
    # no gradient; CISPO gives them -A * w.
    logp = np.log(np.array([[1.5, 0.5, 1.0]], np.float32))
    adv = np.array([[1.0, -1.0, 2.0]], np.float32)
    old, mask = np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32)

    def total(name, x):
      loss, _ = registry.get("policy_loss", name)(
          x, old, adv, mask, clip_low=0.2, clip_high=0.28)
      return loss.sum()

    loss, metrics = jit(losses.cispo_policy_loss, clip_low=0.2,
                        clip_high=0.28)(logp, old, adv, mask)
    np.testing.assert_allclose(loss, [[-1.28, 0.8, -2.0]], rtol=1e-6)
    self.assertAlmostEqual(float(metrics["clip_frac_high"]), 1 / 3, places=6)
    self.assertAlmostEqual(float(metrics["clip_frac_low"]), 1 / 3, places=6)
    cispo = jax.grad(functools.partial(total, "cispo"))(logp)
    ppo = jax.grad(functools.partial(total, "ppo"))(logp)
    np.testing.assert_allclose(cispo, [[-1.28, 0.8, -2.0]], rtol=1e-6)
    np.testing.assert_allclose(ppo, [[0.0, 0.0, -2.0]], atol=1e-6)

  def test_dual_clip_is_refused(self):
    with self.assertRaisesRegex(ValueError, "no dual clip"):
      losses.cispo_policy_loss(np.zeros((1, 1)), np.zeros((1, 1)),
                               np.ones((1,)), np.ones((1, 1)), clip_c=3.0)


class KLTest(_Base):

  @parameterized.parameters("k1", "k2", "k3")
  def test_vs_numpy_oracle(self, kind):
    logp = np.log(self.rng.uniform(0.01, 1, size=(3, 5)))
    ref = np.log(self.rng.uniform(0.01, 1, size=(3, 5)))
    got = jax.jit(registry.get("kl_estimator", kind))(
        logp.astype(np.float32), ref.astype(np.float32)
    )
    np.testing.assert_allclose(
        got, np_kl(logp, ref, kind), rtol=2e-5, atol=1e-6
    )

  def test_hand_checked(self):
    # pi = 1/2, ref = 1/4: k1 = ln 2 = 0.6931472; k2 = (ln 2)^2 / 2 = 0.2402265;
    # r = ref/pi = 1/2, k3 = r - ln r - 1 = 0.5 + ln 2 - 1 = 0.1931472.
    logp = np.log(np.array([[0.5]], np.float32))
    ref = np.log(np.array([[0.25]], np.float32))
    for fn, want in (
        (losses.kl_k1, 0.6931472),
        (losses.kl_k2, 0.2402265),
        (losses.kl_k3, 0.1931472),
    ):
      np.testing.assert_allclose(jax.jit(fn)(logp, ref), [[want]], rtol=1e-6)

  def test_kl_loss_term(self):
    logp = np.log(np.array([[0.5, 0.5]], np.float32))
    ref = np.log(np.array([[0.25, 0.25]], np.float32))
    mask = np.array([[1.0, 0.0]], np.float32)
    kl_loss = jit(losses.kl_loss, beta=0.1, estimator="k3")
    np.testing.assert_allclose(
        kl_loss(logp, ref, mask), [[0.01931472, 0.0]], rtol=1e-5
    )
    # d k3 / d logp = 1 - ref/pi = 0.5, times beta; the padded token gets 0.
    grad = jax.jit(jax.grad(lambda x: kl_loss(x, ref, mask).sum()))(logp)
    np.testing.assert_allclose(grad, [[0.05, 0.0]], rtol=1e-5)

  def test_reward_penalty(self):
    logp = np.log(self.rng.uniform(0.01, 1, size=(2, 3))).astype(np.float32)
    ref = np.log(self.rng.uniform(0.01, 1, size=(2, 3))).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    kl = np_kl(logp, ref, "k1") * mask
    penalty = jit(losses.kl_reward_penalty, beta=0.5)
    seq, seq_kl = penalty(np.array([1.0, 0.0]), logp, ref, mask)
    np.testing.assert_allclose(seq, [1, 0] - 0.5 * kl.sum(1), rtol=1e-5)
    np.testing.assert_allclose(seq_kl, kl.sum(1), rtol=1e-5)
    tok, _ = penalty(np.ones((2, 3)), logp, ref, mask)
    np.testing.assert_allclose(tok, 1 - 0.5 * kl, rtol=1e-5)
    # Hand-checked: pi = 1/2, ref = 1/4 on one token: 1 - 0.1 * ln 2.
    hand, _ = jit(losses.kl_reward_penalty, beta=0.1)(
        np.array([1.0]), np.log(np.array([[0.5]])), np.log(np.array([[0.25]])),
        np.ones((1, 1)),
    )
    np.testing.assert_allclose(hand, [0.93068528], rtol=1e-6)

  def test_entropy_metric(self):
    logits = self.rng.normal(size=(2, 3, 5)).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    want = (np_entropy(logits) * mask).sum() / 3
    got = jax.jit(losses.entropy_metric)(logits, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Hand-checked: uniform over 4 tokens on the only valid position: ln 4.
    got = jax.jit(losses.entropy_metric)(
        np.zeros((1, 2, 4)), np.array([[1, 0]])
    )
    np.testing.assert_allclose(got, math.log(4.0), rtol=1e-6)


# ------------------------------------------------------------- aggregation ---
class AggregationTest(_Base):

  @parameterized.parameters(*_AGG_MODES)
  def test_vs_numpy_oracle(self, mode):
    loss = self.rng.normal(size=(5, 7)).astype(np.float32)
    mask = random_mask(self.rng, 5, 7)
    loss[mask == 0] = np.nan  # padding must never leak, even as nan
    fn = jax.jit(functools.partial(aggregation.aggregate_loss, mode=mode,
                                   max_len=9))
    np.testing.assert_allclose(
        fn(loss, mask), np_aggregate(np.nan_to_num(loss), mask, mode, 9),
        rtol=1e-5,
    )

  @parameterized.parameters(*_AGG_MODES)
  def test_micro_batch_terms_sum_to_full_batch(self, mode):
    loss = self.rng.normal(size=(6, 5)).astype(np.float32)
    mask = random_mask(self.rng, 6, 5)
    full = jit(aggregation.aggregate_loss, mode=mode, max_len=5)(loss, mask)
    terms = jit(aggregation.aggregate_terms, mode=mode, max_len=5)
    parts = [terms(loss[s], mask[s]) for s in (slice(0, 2), slice(2, 6))]
    num, den = sum(p[0] for p in parts), sum(p[1] for p in parts)
    np.testing.assert_allclose(num / den, full, rtol=1e-5, atol=1e-7)

  def test_hand_checked(self):
    loss = np.array([[1.0, 2, 3, 9], [4, 9, 9, 9]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])

    def agg(mode):
      return float(jit(aggregation.aggregate_loss, mode=mode, max_len=4)(
          loss, mask))

    self.assertAlmostEqual(agg("token-mean"), 10 / 4)  # (1+2+3+4)/4
    self.assertAlmostEqual(agg("seq-mean-token-mean"), 3.0)  # (2+4)/2
    self.assertAlmostEqual(agg("seq-mean-token-sum-norm"), 1.25)  # (6/4+4/4)/2

  def test_empty_mask_is_zero_not_nan(self):
    for mode in _AGG_MODES:
      got = jit(aggregation.aggregate_loss, mode=mode)(
          np.ones((2, 3)), np.zeros((2, 3))
      )
      self.assertEqual(float(got), 0.0, mode)


# ---------------------------------------------------------------- registry ---
class RegistryTest(_Base):

  def test_builtin_names(self):
    self.assertEqual(registry.names("advantage"),
                     ["drgrpo", "grpo", "reinforce_pp",
                      "reinforce_pp_baseline", "rloo"])
    self.assertEqual(registry.names("aggregation"), sorted(_AGG_MODES))
    self.assertEqual(registry.names("kl_estimator"), ["k1", "k2", "k3"])
    self.assertEqual(registry.names("policy_loss"), ["cispo", "gspo", "ppo"])

  def test_unknown_name_lists_known(self):
    with self.assertRaisesRegex(
        ValueError,
        r"Unknown advantage 'gae'; known advantage names: "
        r"\['drgrpo', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', "
        r"'rloo'\]",
    ):
      registry.get("advantage", "gae")
    with self.assertRaisesRegex(ValueError, "token-mean"):
      aggregation.aggregate_loss(np.ones((1, 1)), np.ones((1, 1)), "mean")

  def test_unknown_category(self):
    with self.assertRaisesRegex(ValueError, r"known categories: \['advantage'"):
      registry.get("advantages", "grpo")
    with self.assertRaisesRegex(ValueError, "Unknown registry category"):
      registry.register("optimizer", "adam")

  def test_duplicate_name_raises(self):
    with self.assertRaisesRegex(ValueError, "already registered"):
      registry.register("advantage", "grpo")(lambda r, g: r)

  def test_group_local_property_is_true_of_the_estimator(self):
    # The property the stream check reads, against the estimator itself:
    # group-local <=> advantages of two halves (whole groups) equal the
    # whole batch's.
    rewards_B = np.random.default_rng(0).normal(size=16).astype(np.float32)
    G = 4
    local = registry.names_with("advantage", "group_local")
    self.assertEqual(local, ["drgrpo", "grpo", "rloo"])
    for name in registry.names("advantage"):
      fn = registry.get("advantage", name)
      whole = np.asarray(fn(rewards_B, G))
      halves = np.concatenate([np.asarray(fn(rewards_B[:8], G)),
                               np.asarray(fn(rewards_B[8:], G))])
      self.assertEqual(np.allclose(whole, halves, atol=1e-6), name in local,
                       name)
      # A group estimator's baseline is its group: equal rewards in a
      # group give it no advantage.
      flat = np.repeat(np.arange(4, dtype=np.float32), G)
      self.assertEqual(np.allclose(fn(flat, G), 0, atol=1e-6),
                       registry.has("advantage", name, "group"), name)


if __name__ == "__main__":
  absltest.main()
