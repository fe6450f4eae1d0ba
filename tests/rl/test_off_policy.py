"""Sampler vs trainer (`rl/off_policy.py`): importance weights, the
geometric sequence mask and the decoupled-PPO / TIS / MIS / IcePop / CISPO
losses against numpy, the mismatch statistics, and the alarm through the
GRPO job (exact path vs a perturbed sampler)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fakes
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import grouped, losses, objectives, off_policy
from rlhf_jax.rl.losses import KLConfig

CFG = ModelConfig.tiny(vocab_size=61, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, embed_dim=32, mlp_dim=48)


FLOOR = 0.7  # IcePop's lower bound in these tests.


def np_weights(prox, behav, mask, mode, cap, floor=FLOOR):
  w = np.exp(prox.astype(np.float64) - behav)
  if mode == "none":
    w = np.ones_like(w)
  elif mode == "tis":
    w = np.minimum(w, cap)
  elif mode == "mis":
    w = np.where(w > cap, 0.0, w)
  elif mode == "icepop":
    w = np.where((w > cap) | (w < floor), 0.0, w)
  return np.where(mask > 0, w, 0.0)


def np_sequence_keep(prox, behav, mask, band, seq=None):
  """1 on the tokens of the sequences whose geometric-mean weight is in
  `band`; each row one sequence, or the ids of `seq` (-1: none)."""
  if seq is None:
    seq = np.where(mask > 0, np.arange(mask.shape[0])[:, None], -1)
  log_w = (prox.astype(np.float64) - behav) * (mask > 0)
  keep = np.zeros(mask.shape)
  ratios = {}
  for s in np.unique(seq[seq >= 0]):
    tokens = (seq == s) & (mask > 0)
    if not tokens.any():
      continue
    ratios[s] = np.exp(log_w[tokens].mean())
    keep[seq == s] = band[0] <= ratios[s] <= band[1]
  return keep, ratios


def np_decoupled_ppo(logp, prox, behav, adv, mask, mode, cap, eps=0.2):
  """AReaL's decoupled PPO per token, written out:
  -w * min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_prox."""
  r = np.exp(logp.astype(np.float64) - prox)
  a = adv[:, None]
  surrogate = np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
  return -np_weights(prox, behav, mask, mode, cap) * surrogate * mask


def _logs(rng, shape, spread):
  base = -rng.random(shape) * 3
  return base, base + rng.normal(size=shape) * spread


@pytest.mark.parametrize("mode", off_policy.WEIGHTINGS)
def test_weights_and_metrics_equal_numpy(mode):
  rng = np.random.default_rng(0)
  prox, behav = _logs(rng, (6, 20), 1.0)
  mask = (rng.random((6, 20)) > 0.3).astype(np.float32)
  w, m = jax.jit(lambda *a: off_policy.behaviour_weights(
      *a, weighting=mode, cap=1.5, floor=FLOOR))(
          prox.astype(np.float32), behav.astype(np.float32), mask)
  np.testing.assert_allclose(w, np_weights(prox, behav, mask, mode, 1.5),
                             rtol=1e-5)
  raw = np.exp(prox - behav)[mask > 0]
  np.testing.assert_allclose(m["is_weight_mean"], raw.mean(), rtol=1e-5)
  outside = (raw > 1.5) | ((raw < FLOOR) if mode == "icepop" else False)
  capped = outside.mean() if mode in ("tis", "mis", "icepop") else 0.0
  np.testing.assert_allclose(m["is_capped_frac"], capped, rtol=1e-6)
  assert 0 < (raw > 1.5).mean() < 1  # The cap is exercised both ways,
  assert 0 < (raw < FLOOR).mean() < 1  # and the floor.


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["none", "tis"])
def test_geometric_sequence_mask_equals_numpy(mode, packed):
  """The sequence mask keeps a sequence iff exp(mean of its log weights)
  is in the band, on top of the token weights: one sequence a row, and
  packed rows of several (`seq` ids, -1 between them)."""
  rng = np.random.default_rng(7)
  prox, behav = _logs(rng, (6, 24), 1.0)
  mask = (rng.random((6, 24)) > 0.2).astype(np.float32)
  seq = None
  if packed:  # Three sequences a row, one padding column between them,
    # with the batch's sample indices: beyond this array's 144 cells.
    seq = np.full((6, 24), -1, np.int32)
    for r in range(6):
      for j, start in enumerate((0, 8, 16)):
        seq[r, start:start + 7] = 1000 + 37 * (3 * r + j)
    mask = mask * (seq >= 0)
  band = (np.exp(-0.12), np.exp(0.15))
  w, m = jax.jit(lambda *a: off_policy.behaviour_weights(
      *a, weighting=mode, cap=1.5, sequence_mask="geometric",
      sequence_band=band, seq_BxT=seq))(
          prox.astype(np.float32), behav.astype(np.float32), mask)
  keep, ratios = np_sequence_keep(prox, behav, mask, band, seq)
  # No sequence sits within fp32 rounding of an end of the band, and the
  # band keeps some and drops some.
  logs = np.log(np.array(list(ratios.values())))
  assert np.min(np.abs(logs[:, None] - np.log(band)[None])) > 1e-4
  assert 0 < keep[mask > 0].mean() < 1
  expected = np_weights(prox, behav, mask, mode, 1.5) * keep
  np.testing.assert_allclose(w, expected, rtol=1e-5)
  kept = np.array([band[0] <= r <= band[1] for r in ratios.values()])
  np.testing.assert_allclose(m["seq_masked_frac"], 1 - kept.mean(),
                             rtol=1e-6)
  np.testing.assert_allclose(m["seq_ratio_mean"],
                             np.mean(list(ratios.values())), rtol=1e-5)


def test_band_edges_are_kept_and_a_mask_of_everything_is_zero():
  """Ratios exactly at an end of a band stay in: a token at IcePop's floor
  or cap, a sequence whose geometric mean is the band's end; a band no
  sequence meets gives weight 0 everywhere (finite, no nan)."""
  logp = -np.random.default_rng(2).random((3, 7)).astype(np.float32)
  mask = np.ones((3, 7), np.float32)
  for floor, cap in ((1.0, 2.0), (0.5, 1.0)):  # raw = 1 at each end.
    w, m = off_policy.behaviour_weights(logp, logp, mask, weighting="icepop",
                                        cap=cap, floor=floor)
    np.testing.assert_array_equal(w, mask)
    assert float(m["is_capped_frac"]) == 0.0
  w, m = off_policy.behaviour_weights(
      logp, logp, mask, weighting="none", cap=2.0,
      sequence_mask="geometric", sequence_band=(1.0, 1.0))
  np.testing.assert_array_equal(w, mask)
  assert float(m["seq_masked_frac"]) == 0.0
  behav = logp - 0.5  # Every ratio e^0.5, outside both bands.
  for kw in (dict(weighting="icepop", cap=1.5, floor=0.5),
             dict(weighting="tis", cap=1.5, sequence_mask="geometric",
                  sequence_band=(0.9, 1.1))):
    w, m = off_policy.behaviour_weights(logp, behav, mask, **kw)
    np.testing.assert_array_equal(w, np.zeros_like(mask))
    assert max(float(m.get("is_capped_frac", 0)),
               float(m.get("seq_masked_frac", 0))) == 1.0


@pytest.fixture(scope="module")
def model(mesh8):
  layout = mesh_lib.train_layout(mesh8)
  graphdef, params = model_lib.init_params(CFG, 0, layout)
  return layout, graphdef, params


def _batch(B=8, T=16, seed=3):
  rng = np.random.default_rng(seed)
  lens = rng.integers(T // 2, T + 1, B)
  tokens = np.where(np.arange(T)[None] < lens[:, None],
                    rng.integers(1, CFG.vocab_size, (B, T)), 0).astype(
                        np.int32)
  loss_mask = ((np.arange(T)[None] >= 3)
               & (np.arange(T)[None] < lens[:, None] - 1)).astype(np.float32)
  return dict(tokens=tokens,
              positions=np.broadcast_to(np.arange(T, dtype=np.int32),
                                        (B, T)).copy(),
              attn_mask=np.arange(T)[None] < lens[:, None],
              targets=np.concatenate([tokens[:, 1:],
                                      np.zeros((B, 1), np.int32)], 1),
              loss_mask=loss_mask, ref_logp=np.zeros((B, T), np.float32),
              advantages=rng.normal(size=B).astype(np.float32))


SEQ_BAND = (np.exp(-0.25), np.exp(0.25))


@pytest.mark.parametrize("mode", ["is", "tis", "mis", "icepop", "geometric",
                                  "cispo", "all-masked"])
def test_decoupled_losses_and_gradients_equal_numpy(model, mode):
  """Through the learner's policy terms on 8 devices: the loss is the
  numpy decoupled-PPO sum, and the gradient is that of sum_t w_t *
  ppo_t with the numpy weights as constants (no gradient through w).
  "geometric": the sequence mask alone (weights 1 in kept sequences);
  "cispo": CISPO's loss with TIS weights; "all-masked": a sequence band
  no sequence meets, so the loss and every gradient are 0."""
  layout, graphdef, params = model
  batch = _batch()
  with use_layout(layout):
    logp = np.asarray(jax.jit(grouped.token_logprobs_in_layout,
                              static_argnums=0)(graphdef, params, batch),
                      np.float64)
  rng = np.random.default_rng(1)
  # The proximal policy near the current one (so the PPO clip is hit
  # both ways), the sampler further off (so the cap is hit).
  prox = logp + rng.normal(size=logp.shape) * 0.3
  behav = prox + rng.normal(size=logp.shape) * 0.8
  batch.update(old_logp=prox.astype(np.float32),
               sampler_logp=behav.astype(np.float32))
  weighting = {"geometric": "none", "all-masked": "none",
               "cispo": "tis"}.get(mode, mode)
  band = (1.0, 1.0) if mode == "all-masked" else SEQ_BAND
  c = objectives.PolicyLossConfig(
      aggregation="token-mean", importance_weight=weighting,
      importance_cap=1.5, importance_floor=FLOOR,
      policy_loss="cispo" if mode == "cispo" else "ppo",
      sequence_mask=("geometric" if mode in ("geometric", "all-masked")
                     else "none"), sequence_band=band)
  terms, weight = objectives.policy_terms(c)

  def loss(p):
    num, aux = terms(graphdef, p, batch)
    return num / weight(batch), aux

  w_np = np_weights(prox, behav, batch["loss_mask"], weighting, 1.5)
  if c.sequence_mask == "geometric":
    keep, _ = np_sequence_keep(prox, behav, batch["loss_mask"], band)
    assert (0 < keep[batch["loss_mask"] > 0].mean() < 1
            if mode == "geometric" else not keep.any())
    w_np = w_np * keep
  per_token_loss = {"cispo": losses.cispo_policy_loss}.get(
      mode, losses.ppo_policy_loss)

  def oracle_loss(p):  # The unweighted per-token terms, weighted outside.
    logp_p, _, _ = grouped.target_logprobs(graphdef, p, batch)
    per_token, _ = per_token_loss(
        logp_p, batch["old_logp"], batch["advantages"], batch["loss_mask"])
    return jnp.sum(per_token * w_np) / np.sum(batch["loss_mask"])

  with use_layout(layout):
    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params)
    oracle_grads = jax.jit(jax.grad(oracle_loss))(params)
  if mode == "cispo":  # -w * A * clip(r, 1 - eps, 1 + eps), written out.
    r = np.exp(logp - prox)
    per_token = (-w_np * batch["advantages"][:, None]
                 * np.clip(r, 0.8, 1.2) * batch["loss_mask"])
  else:
    per_token = np_decoupled_ppo(logp, prox, behav, batch["advantages"],
                                 batch["loss_mask"], weighting, 1.5)
    if c.sequence_mask == "geometric":
      per_token = per_token * keep
  expected = per_token.sum() / np.sum(batch["loss_mask"])
  np.testing.assert_allclose(float(value), expected, rtol=1e-4, atol=1e-6)
  if weighting in ("tis", "mis", "icepop"):
    assert float(aux["is_capped_frac"]) > 0
  if c.sequence_mask == "geometric":
    assert 0 < float(aux["seq_masked_frac"]) <= 1.0
  flat = jax.tree.leaves(jax.device_get(grads))
  flat_oracle = jax.tree.leaves(jax.device_get(oracle_grads))
  largest = max(float(np.max(np.abs(g))) for g in flat)
  if mode == "all-masked":
    assert float(value) == 0.0 and largest == 0.0
    return
  assert largest > 1e-4
  for g, o in zip(flat, flat_oracle):
    np.testing.assert_allclose(g, o, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override,message", [
    (dict(importance_floor=3.0), "config.rl.importance_floor=3.0: must be "
     ">= 0 and below importance_cap (2.0)"),
    (dict(sequence_band=(1.1, 1.2)), "config.rl.sequence_band=(1.1, 1.2): "
     "must be (lo, hi) with 0 < lo <= 1 <= hi"),
    (dict(sequence_mask="arith"), "config.rl.sequence_mask='arith': must be "
     "one of ['none', 'geometric']"),
])
def test_a_bad_band_is_one_line(override, message):
  from rlhf_jax.config import sections
  from rlhf_jax.errors import ConfigError
  with pytest.raises(ConfigError) as error:
    sections.RL(**override)
  assert str(error.value) == message


def test_weights_are_one_on_policy():
  """Sampler == trainer: every weighting gives the classic loss."""
  logp = -np.random.default_rng(2).random((3, 7)).astype(np.float32)
  mask = np.ones((3, 7), np.float32)
  for mode in off_policy.WEIGHTINGS:
    w, _ = off_policy.behaviour_weights(logp, logp, mask, weighting=mode,
                                        cap=1.0, sequence_mask="geometric")
    np.testing.assert_array_equal(w, mask)


def test_mismatch_statistics_equal_numpy():
  rng = np.random.default_rng(4)
  trainer, sampler = _logs(rng, (5, 12), 0.5)
  mask = (rng.random((5, 12)) > 0.4).astype(np.float32)
  m = jax.jit(off_policy.mismatch)(trainer.astype(np.float32),
                                   sampler.astype(np.float32), mask)
  d = (trainer - sampler)[mask > 0]
  np.testing.assert_allclose(m["gap_max"], np.abs(d).max(), rtol=1e-5)
  np.testing.assert_allclose(m["gap_mean"], np.abs(d).mean(), rtol=1e-5)
  # k3 with r = trainer / sampler: E_sampler[r - 1 - log r] = KL(s || t).
  np.testing.assert_allclose(m["mismatch_kl"], (np.exp(d) - 1 - d).mean(),
                             rtol=1e-5)
  empty = off_policy.mismatch(trainer, sampler, np.zeros_like(mask))
  assert all(float(v) == 0.0 for v in empty.values())


def test_alarm_fires_past_the_threshold_only():
  quiet = off_policy.alarm({"rollout/mismatch_kl": 1e-4}, 1e-3, step=1)
  loud = off_policy.alarm({"rollout/mismatch_kl": 2e-3}, 1e-3, step=1)
  off = off_policy.alarm({"rollout/mismatch_kl": 5.0}, 0.0, step=1)
  assert (quiet["rollout/mismatch_alarm"], loud["rollout/mismatch_alarm"],
          off["rollout/mismatch_alarm"]) == (0.0, 1.0, 0.0)


@pytest.fixture(scope="module")
def tiny_job(mesh8):
  del mesh8
  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rl.importance_weight = "tis"
  job = rl_job.build(c)
  return job, next(job.iterator)


def test_exact_path_agrees_and_a_perturbed_sampler_sounds_the_alarm(
    tiny_job, caplog):
  """Colocated, on-policy, fp32 rollout: the sampler and the trainer agree
  to fp32 noise (max |d log p| < 1e-4, KL < 1e-7), the alarm stays quiet
  and TIS weights are 1. With noise added to the sampler's weights the
  alarm fires, in the metric and the log."""
  job, prompts = tiny_job
  assert job.c.rl.mismatch_alarm_kl == 0.01  # The default.
  _, exact = fakes.first_step(job, prompts)
  assert exact["rollout/logprob_gap"] < 1e-4
  assert exact["rollout/mismatch_kl"] < 1e-7
  assert exact["rollout/mismatch_alarm"] == 0.0
  assert exact["train/is_capped_frac"] == 0.0
  np.testing.assert_allclose(exact["train/is_weight_mean"], 1.0, atol=1e-4)

  rollout = job.sampler
  set_weights = rollout.set_weights
  keys = iter(jax.random.split(jax.random.key(0), 1000))

  def noisy(params, version, master=None):
    params = jax.tree.map(
        lambda x: x + 0.3 * jnp.std(x) * jax.random.normal(
            next(keys), x.shape, x.dtype) if x.ndim == 2 else x, params)
    set_weights(params, version, master=master)

  rollout.set_weights = noisy
  try:
    with caplog.at_level("WARNING"):
      _, perturbed = fakes.first_step(job, prompts)
  finally:
    rollout.set_weights = set_weights
  assert perturbed["rollout/mismatch_kl"] > 0.01, perturbed
  assert perturbed["rollout/mismatch_alarm"] == 1.0
  assert "sampler and trainer disagree" in caplog.text
  assert perturbed["train/is_capped_frac"] > 0  # TIS truncated some.


@pytest.mark.parametrize("share_prompt", [False, True])
def test_on_policy_update_equals_the_update_after_an_old_logp_pass(
    model, share_prompt):
  """One update per batch (`off_policy.on_policy`): no old-log-prob pass,
  the loss anchors on stop_gradient(logp). Through the Preparer and the
  learner (2 micro-batches, TIS, KL loss, 8 devices, repeated and grouped
  layouts), the update equals the one after the pass (params, loss, grad
  norm), and the mismatch the loss measures equals numpy's from the
  trainer's log-probs over the current samples' tokens."""
  import optax

  from rlhf_jax.rl import batch as batch_lib
  from rlhf_jax.rl.learner import train_epochs
  from rlhf_jax.rl.prepare import AdvantageConfig, Preparer
  layout, graphdef, params = model
  rng = np.random.default_rng(5)
  N, G, P, M = 4, 4, 6, 10
  samples = fakes.random_samples(rng, N, G, range(3, P + 1),
                                 range(2, M + 1), CFG.vocab_size)
  packed = batch_lib.pack(samples, P, M, group_size=G if share_prompt else 0)
  rewards = rng.random(N * G).astype(np.float32)
  current = rng.random(N * G) > 0.3
  results = {}
  for on_policy in (False, True):
    learner = objectives.policy_learner(
        graphdef, layout, objectives.PolicyLossConfig(
            kl=KLConfig(0.05), importance_weight="tis", importance_cap=1.2,
            on_policy=on_policy), optax.sgd(0.5), micro_batches=2)
    preparer = Preparer(learner, AdvantageConfig(
        "grpo", G, kl=KLConfig(0.05), on_policy=on_policy))
    if not on_policy:  # The sampler: the trainer's log-probs, perturbed.
      trainer = np.asarray(learner.logprobs(params, learner.put_batch(
          dict(packed.arrays))))
      noise = rng.normal(size=trainer.shape).astype(np.float32) * 0.3
      mask = packed.arrays["loss_mask"]
      packed.sampler_logp[...] = (trainer + noise) * mask
    batch = preparer.put(packed, rewards, current)
    batch, info = preparer(params, params, batch)
    state = learner.init_state(jax.tree.map(jnp.copy, params))
    (state,), (trained,) = train_epochs([learner], [state], batch, epochs=1,
                                        num_minibatches=1, seed=0)
    results[on_policy] = (set(batch), jax.device_get(info), trained,
                          jax.device_get(state.params))
  keys_off, info_off, trained_off, params_off = results[False]
  keys_on, info_on, trained_on, params_on = results[True]
  assert "old_logp" in keys_off and "old_logp" not in keys_on
  assert "gap_max" in info_off and "gap_max" not in info_on
  measured, trained_on = off_policy.measured_in_updates(trained_on)
  for k in ("loss", "grad_norm", "kl", "is_weight_mean", "is_capped_frac"):
    np.testing.assert_allclose(trained_on[0][k], trained_off[0][k],
                               rtol=1e-5, atol=1e-7, err_msg=k)
  assert trained_on[0]["is_capped_frac"] > 0  # TIS is exercised.
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(params_on), jax.tree.leaves(jax.device_get(params))))
  assert moved > 1e-3
  for a, b in zip(jax.tree.leaves(params_on), jax.tree.leaves(params_off)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # numpy over the current samples' trained tokens.
  flat = lambda x: np.asarray(x, np.float64).reshape(N * G, -1)  # noqa: E731
  tokens = flat(mask) * current[:, None]
  d = (flat(trainer) - flat(packed.sampler_logp))[tokens > 0]
  expected = {"gap_max": np.abs(d).max(), "gap_mean": np.abs(d).mean(),
              "mismatch_kl": (np.exp(d) - 1 - d).mean()}
  for k, v in expected.items():
    np.testing.assert_allclose(measured[k], v, rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(info_off[k], v, rtol=1e-5, err_msg=k)
