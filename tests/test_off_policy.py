"""Sampler vs trainer (`rl/off_policy.py`): importance weights and the
decoupled-PPO / TIS / MIS losses against numpy, the mismatch statistics,
and the alarm through the GRPO job (exact path vs a perturbed sampler)."""

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

CFG = ModelConfig.tiny(vocab_size=61, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, embed_dim=32, mlp_dim=48)


def np_weights(prox, behav, mask, mode, cap):
  w = np.exp(prox.astype(np.float64) - behav)
  if mode == "none":
    w = np.ones_like(w)
  elif mode == "tis":
    w = np.minimum(w, cap)
  elif mode == "mis":
    w = np.where(w > cap, 0.0, w)
  return np.where(mask > 0, w, 0.0)


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
      *a, weighting=mode, cap=1.5))(prox.astype(np.float32),
                                    behav.astype(np.float32), mask)
  np.testing.assert_allclose(w, np_weights(prox, behav, mask, mode, 1.5),
                             rtol=1e-5)
  raw = np.exp(prox - behav)[mask > 0]
  np.testing.assert_allclose(m["is_weight_mean"], raw.mean(), rtol=1e-5)
  capped = (raw > 1.5).mean() if mode in ("tis", "mis") else 0.0
  np.testing.assert_allclose(m["is_capped_frac"], capped, rtol=1e-6)
  assert 0 < (raw > 1.5).mean() < 1  # The cap is exercised both ways.


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


@pytest.mark.parametrize("mode", ["is", "tis", "mis"])
def test_decoupled_losses_and_gradients_equal_numpy(model, mode):
  """Through the learner's policy terms on 8 devices: the loss is the
  numpy decoupled-PPO sum, and the gradient is that of sum_t w_t *
  ppo_t with the numpy weights as constants (no gradient through w)."""
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
  c = objectives.PolicyLossConfig(aggregation="token-mean",
                                  importance_weight=mode, importance_cap=1.5)
  terms, weight = objectives.policy_terms(c)

  def loss(p):
    num, aux = terms(graphdef, p, batch)
    return num / weight(batch), aux

  w_np = np_weights(prox, behav, batch["loss_mask"], mode, 1.5)

  def oracle_loss(p):  # The unweighted per-token terms, weighted outside.
    logp_p, _, _ = grouped.target_logprobs(graphdef, p, batch)
    per_token, _ = losses.ppo_policy_loss(
        logp_p, batch["old_logp"], batch["advantages"], batch["loss_mask"])
    return jnp.sum(per_token * w_np) / np.sum(batch["loss_mask"])

  with use_layout(layout):
    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params)
    oracle_grads = jax.jit(jax.grad(oracle_loss))(params)
  expected = np_decoupled_ppo(logp, prox, behav, batch["advantages"],
                              batch["loss_mask"], mode, 1.5).sum() / np.sum(
                                  batch["loss_mask"])
  np.testing.assert_allclose(float(value), expected, rtol=1e-4, atol=1e-6)
  if mode != "is":
    assert float(aux["is_capped_frac"]) > 0
  flat = jax.tree.leaves(jax.device_get(grads))
  flat_oracle = jax.tree.leaves(jax.device_get(oracle_grads))
  assert max(float(np.max(np.abs(g))) for g in flat) > 1e-4
  for g, o in zip(flat, flat_oracle):
    np.testing.assert_allclose(g, o, rtol=1e-4, atol=1e-6)


def test_weights_are_one_on_policy():
  """Sampler == trainer: every weighting gives the classic loss."""
  logp = -np.random.default_rng(2).random((3, 7)).astype(np.float32)
  mask = np.ones((3, 7), np.float32)
  for mode in off_policy.WEIGHTINGS:
    w, _ = off_policy.behaviour_weights(logp, logp, mask, weighting=mode,
                                        cap=1.0)
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
  from rlhf_jax.trainers import grpo

  c = tiny_grpo.get_config("runlocal")
  c.rl.importance_weight = "tis"
  job = grpo.build(c)
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

  rollout = job.rollout
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
