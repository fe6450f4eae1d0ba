"""Trainer-side prompt sharing: the grouped layout equals the repeated one.

Grouped = each prompt run once for its G responses (rl/grouped.py,
models/grouped_forward.py); repeated = [prompt; response] per sequence. Both go
through the same Learner and loss code on the 8-device training mesh, with
prompts of different lengths (right-padded) and responses of different
lengths, so positions, padding masks and the prefix/suffix merge all count.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fakes
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import grouped, objectives
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer
from rlhf_jax.rl.losses import KLConfig

# 4 groups on 8 devices: prompt rows [N, P] do not split over the 8 data
# shards (replicated), response rows [N*G, R] do: the gradient of the shared
# prompt sums over responses on other devices.
N, G, P, R = 4, 4, 11, 6  # Groups, responses per group, prompt bucket, max new.
B = N * G
TINY = ModelConfig.tiny(vocab_size=64, num_layers=2, embed_dim=32,
                        num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
# Gemma-2 switches: local (sliding window 5) layers, soft-caps, QK-norm.
GEMMA_LIKE = dataclasses.replace(
    TINY, sliding_window=5, attn_logit_softcap=20.0, final_logit_softcap=15.0,
    qk_norm=True, post_norms=True, norm_plus_one=True, embed_scale=True)


def _samples(seed=0):
  """N groups of G samples; prompt lengths 1..P, response lengths 1..R."""
  return fakes.random_samples(np.random.default_rng(seed), N, G,
                              range(1, P + 1), range(1, R + 1),
                              TINY.vocab_size)


def _rl_fields(samples, rng):
  """old/ref log-probs and advantages in both layouts (same values)."""
  old = -rng.random((N, G, R)).astype(np.float32) * 3
  ref = old + 0.3 * rng.standard_normal((N, G, R)).astype(np.float32)
  adv = rng.standard_normal((N, G)).astype(np.float32)
  T = P + R
  old_r, ref_r = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
  for b, s in enumerate(samples):
    p = len(s.prompt_tokens)
    old_r[b, p - 1:p - 1 + R] = old.reshape(B, R)[b]
    ref_r[b, p - 1:p - 1 + R] = ref.reshape(B, R)[b]
  return (dict(old_logp=old, ref_logp=ref, advantages=adv),
          dict(old_logp=old_r, ref_logp=ref_r, advantages=adv.reshape(B)))


def _to_grouped(x_BxT, samples):
  """Response positions of a repeated [B, T] array as [N, G, R]."""
  out = np.zeros((B, R), x_BxT.dtype)
  for b, s in enumerate(samples):
    p = len(s.prompt_tokens)
    out[b] = x_BxT[b, p - 1:p - 1 + R]
  return out.reshape(N, G, R)


def _batches(samples, seed=1):
  rng = np.random.default_rng(seed)
  grouped_b = batch_lib.pack(samples, P, R, group_size=G).arrays
  repeated_b = batch_lib.pack(samples, P, R).arrays
  fg, fr = _rl_fields(samples, rng)
  return {**grouped_b, **fg}, {**repeated_b, **fr}


def _learner(cfg, mesh, aggregation="token-mean", micro_batches=2):
  layout = mesh_lib.train_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
      clip_low=0.2, clip_high=0.28, kl=KLConfig(0.05), aggregation=aggregation,
      max_len=R))
  learner = Learner(graphdef, layout, make_optimizer(OptimConfig()),
                    terms_fn=terms, weight_fn=weight,
                    micro_batches=micro_batches)
  return learner, params, terms, weight


def test_pack_grouped_holds_the_same_tokens():
  samples = _samples()
  g = batch_lib.pack(samples, P, R, group_size=G)
  r = batch_lib.pack(samples, P, R)
  gp = grouped.per_sequence(g.arrays)
  assert g.arrays["prompt_tokens"].shape == (N, P)
  assert gp["targets"].shape == gp["loss_mask"].shape == (B, R)
  np.testing.assert_array_equal(
      gp["targets"] * gp["loss_mask"],
      _to_grouped(r.arrays["targets"] * r.arrays["loss_mask"],
                  samples).reshape(B, R))
  np.testing.assert_array_equal(g.sampler_logp,
                                _to_grouped(r.sampler_logp, samples))
  np.testing.assert_array_equal(g.arrays["prompt_len"],
                                [len(samples[n * G].prompt_tokens)
                                 for n in range(N)])
  with pytest.raises(ValueError, match="not in the group"):
    batch_lib.pack(samples[1:] + samples[:1], P, R, group_size=G)


def test_logprobs_loss_and_grads_match_repeated(mesh8):
  """Gemma-2 switches on, seq-mean-token-mean: one compile per layout."""
  samples = _samples(seed=2)
  learner, params, terms, weight = _learner(GEMMA_LIKE, mesh8,
                                            "seq-mean-token-mean")
  gb, rb = _batches(samples, seed=3)

  def loss(params, batch):
    num, aux = terms(learner.graphdef, params, batch)
    return num / weight(batch), aux

  @jax.jit
  def run(params, batch):
    with use_layout(learner.layout):
      logp = grouped.token_logprobs_in_layout(learner.graphdef, params, batch)
      return logp, jax.value_and_grad(loss, has_aux=True)(params, batch)

  logp_g, ((lg, aux_g), gg) = run(params, learner.put_batch(gb))
  logp_r, ((lr, aux_r), gr) = run(params, learner.put_batch(rb))

  # Log-probs at every response token.
  assert logp_g.shape == (N, G, R)
  assert len(logp_g.sharding.device_set) == 8
  mask = gb["loss_mask"] > 0
  got, want = np.asarray(logp_g), _to_grouped(np.asarray(logp_r), samples)
  np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)
  # Not vacuous: log-probs vary, and the first response token (predicted by
  # the shared prompt's last position) is covered for every sample.
  assert np.ptp(got[mask]) > 0.5 and mask[..., 0].all()

  # Loss, aux metrics and every gradient entry.
  np.testing.assert_allclose(float(lg), float(lr), rtol=1e-5, atol=1e-7)
  for k in aux_r:
    np.testing.assert_allclose(float(aux_g[k]), float(aux_r[k]), rtol=1e-5,
                               atol=1e-7, err_msg=k)
  leaves_g, leaves_r = jax.tree.leaves(gg), jax.tree.leaves(gr)
  scale = max(float(jnp.max(jnp.abs(x))) for x in leaves_r)
  assert scale > 1e-3  # Non-trivial gradients.
  for a, b in zip(leaves_g, leaves_r, strict=True):
    # fp32: elementwise within 1e-5 of the largest gradient entry.
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale
  # The prompt's weights get gradient through the shared prefix part: the
  # embedding rows of tokens that occur only in prompts are non-zero.
  resp = set(np.concatenate([s.tokens for s in samples]).tolist())
  only_prompt = sorted(set(gb["prompt_tokens"].ravel().tolist()) - resp - {0})
  emb = np.asarray(gg["embed"][...])
  assert only_prompt and np.abs(emb[only_prompt]).max() > 0


@pytest.mark.slow
def test_grpo_rl_step_share_prompt_matches_repeated():
  """One GRPO step of the tiny job, share_prompt True vs False."""
  from configs import tiny_grpo
  from rlhf_jax.trainers import rl_job

  c = tiny_grpo.get_config("runlocal")
  c.rl.num_minibatches = 1  # Same mini-batch (all rows) in both layouts.
  c.rl.kl_in_loss = False   # KL as a reward penalty: per-sequence reshapes.
  c.rl.micro_batches = 2    # Micro-batches: sequences vs whole groups.
  c.mesh.num_devices = 1    # Wiring only; sharded parity is tested above.
  job = rl_job.build(c)
  prompts = next(job.iterator)
  out = {}
  for share in (True, False):
    # A reference unlike the policy (x 1.05), so the KL term is not zero.
    rl = dataclasses.replace(job.c.rl, share_prompt=share)
    _, out[share] = fakes.first_step(
        dataclasses.replace(job, c=dataclasses.replace(job.c, rl=rl)),
        prompts)
  # Loss and gradient are exact over micro-batches; kl/entropy are means of
  # per-micro-batch means, and the two layouts split differently.
  for k in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
    np.testing.assert_allclose(out[True][k], out[False][k], rtol=1e-5,
                               atol=1e-7, err_msg=k)
  # The sampler-vs-trainer gap is fp32 rounding in both layouts (~1e-7):
  # its value there depends on the CPU's reduction order (this comparison
  # at rtol 1e-5 failed on one machine with 1.5e-7 vs 5.2e-7, the same
  # at the commit that had passed CI elsewhere), so both stay at rounding.
  for share in (True, False):
    assert abs(out[share]["rollout/logprob_gap_mean"]) < 2e-6, share
  assert out[True]["train/grad_norm"] > 1e-3
  assert out[True]["train/kl"] > 1e-4
