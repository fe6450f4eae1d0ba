"""Context parallelism (`parallel/context.py`): sequences split over the
`context` mesh axis compute what the unsplit ones do.

The oracle of each comparison is the same computation on the same 8 devices
with `context` = 1 (FSDP 8: every sequence whole on one device); the chunk
layout's oracle is numpy. Tolerances: max |diff| <= 1e-5 x max |reference|
per tensor (fp32)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import model as model_lib
from rlhf_jax.models import reward_model
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import context
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import critic, grouped, objectives, packing
from rlhf_jax.rl.learner import OptimConfig, make_optimizer
from rlhf_jax.rl.losses import KLConfig
from rlhf_jax.rl.prepare import AdvantageConfig, Preparer

# GQA (4 query heads on 2 kv heads), a sliding window shorter than the
# sequences, soft-caps: every mask and score path the split must keep.
CFG = ModelConfig.tiny(
    vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    embed_dim=32, mlp_dim=64, sliding_window=12, attn_logit_softcap=20.0,
    final_logit_softcap=10.0, attention="chunked", attention_block=16)
P, R, N, G = 20, 40, 4, 4
PACK = 96  # Rows of several sequences; at C = 8 a shard holds 16 tokens.
SHARDS = (2, 4, 8)


def _layout(C: int):
  return mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1, context=C))


def _layouts(mesh8):
  """(C, the training layout with context = C): 1, then SHARDS. Tests
  init their weights once and place them on each (an init compiled per
  layout cost 1.6 s each, 8 in this module; init under a layout is
  tests/models/test_model.py's subject)."""
  yield 1, mesh_lib.train_layout(mesh8)
  for C in SHARDS:
    yield C, _layout(C)


def _close(got, want, what):
  want, got = np.asarray(want), np.asarray(got)
  bound = 1e-5 * max(float(np.abs(want).max()), 1e-30)
  assert float(np.abs(got - want).max()) <= bound, what


def _samples(seed=0):
  """N groups of G responses; lengths so that packed sequences cross the
  shards' boundaries; sampler log-probs random."""
  rng = np.random.default_rng(seed)
  out = []
  for n in range(N):
    prompt = rng.integers(1, CFG.vocab_size, int(rng.integers(8, P + 1)))
    for _ in range(G):
      r = int(rng.integers(10, R + 1))
      out.append(types.SimpleNamespace(
          prompt_id=n, prompt_tokens=prompt.tolist(),
          tokens=rng.integers(1, CFG.vocab_size, r).tolist(),
          logp_raw=-rng.random(r).astype(np.float32)))
  return out


@pytest.mark.parametrize("C", SHARDS)
def test_balance_gives_device_i_chunks_i_and_its_mirror(mesh8, C):
  """`balance` puts chunks i and 2C-1-i of each row on device i of the
  context axis (numpy oracle), and `unbalance` undoes it."""
  del mesh8
  layout = _layout(C)
  T = 2 * C * 8
  x = jnp.arange(3 * T, dtype=jnp.int32).reshape(3, T)
  with use_layout(layout):
    moved, back = jax.jit(lambda x: (context.balance(x), context.unbalance(
        context.balance(x))))(x)
  c = T // (2 * C)
  want = np.concatenate(
      [np.arange(j * c, (j + 1) * c) for i in range(C)
       for j in (i, 2 * C - 1 - i)])
  np.testing.assert_array_equal(np.asarray(moved), np.asarray(x)[:, want])
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  np.testing.assert_array_equal(context.balanced_order(T, C), want)
  # The point of the layout: every device has 2C + 1 causal (query chunk,
  # key chunk) pairs; contiguous shards give device i 4i + 3.
  chunk_of = np.arange(T) // c
  for order, pairs in ((want, [2 * C + 1] * C),
                       (np.arange(T), [4 * i + 3 for i in range(C)])):
    held = chunk_of[order].reshape(C, -1)  # Device i's tokens' chunks.
    assert [len({(q, k) for q in set(h) for k in range(q + 1)})
            for h in held] == pairs
  # Each device holds its two chunks: the split is along the tokens.
  device_index = {d: i for i, d in enumerate(
      layout.mesh.devices.reshape(-1))}
  for shard in moved.addressable_shards:
    i = np.unravel_index(device_index[shard.device],
                         layout.mesh.devices.shape)[2]
    np.testing.assert_array_equal(
        np.asarray(shard.data)[0],
        np.concatenate([np.arange(i * c, (i + 1) * c),
                        np.arange((2 * C - 1 - i) * c, (2 * C - i) * c)]))


def _grpo(layout, params, ref, samples, rewards):
  """(per-token log-probs, reference log-probs, loss, grads) of GRPO on
  packed rows with shared prompts (sub-segments), through the Preparer
  (the trainer's old log-probs, the reference's, advantages) and the
  learner's gradient sums, as a step runs them. The rows are dealt for 8
  shards in every layout, so the arrays line up."""
  graphdef, _ = model_lib.abstract_params(CFG)
  # A KL term large enough that the loss is not the near-cancelling sum of
  # group-normalised advantages (its rounding would be measured against
  # a loss near 0).
  config = objectives.PolicyLossConfig(
      kl=KLConfig(1.0), aggregation="seq-mean-token-mean", max_len=R)
  learner = objectives.policy_learner(
      graphdef, layout, config, make_optimizer(OptimConfig()),
      micro_batches=1)
  preparer = Preparer(learner, AdvantageConfig("grpo", G))
  packed = batch_lib.pack(samples, P, R, group_size=G,
                          slots=packing.Slots(PACK, shards=8))
  batch, _ = preparer(params, ref, preparer.put(packed, rewards))
  grads, num, _, weight = learner.grad_sums(params, batch)
  mask = np.asarray(batch["loss_mask"])
  return (np.asarray(batch["old_logp"]) * mask,
          np.asarray(batch["ref_logp"]) * mask, float(num / weight),
          jax.tree.map(lambda g: np.asarray(g / weight), grads))


def test_grpo_on_packed_rows_equals_the_unsplit_sequences(mesh8):
  """context = 2, 4, 8: the per-token log-probs of the policy and of the
  reference (the ADVANTAGES stage's passes), the loss and every gradient
  equal context = 1's."""
  samples = _samples()
  rewards = np.random.default_rng(1).normal(size=N * G).astype(np.float32)
  runs = {}
  # One init, placed on each layout (`_layouts`): the same weights.
  _, params0 = model_lib.init_params(CFG, 0, mesh_lib.train_layout(mesh8))
  for C, layout in _layouts(mesh8):
    params = mesh_lib.to_layout(params0, layout)
    ref = jax.tree.map(lambda x: x * 1.5, params)
    runs[C] = _grpo(layout, params, ref, samples, rewards)
  logp0, ref0, loss0, grads0 = runs[1]
  assert loss0 > 0.01
  assert np.count_nonzero(logp0) > 300  # Trained tokens compared.
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads0)) > 1e-4
  for C in SHARDS:
    logp, ref, loss, grads = runs[C]
    _close(logp, logp0, f"C={C} log-probs")
    _close(ref, ref0, f"C={C} reference log-probs")
    _close(loss, loss0, f"C={C} loss")
    for (path, g), g0 in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree.leaves(grads0)):
      _close(g, g0, f"C={C} grad {jax.tree_util.keystr(path)}")


def _ppo_critic(layout, critic_params, batch_np):
  """(values, GAE advantages and returns, value loss, its gradients) of the
  critic on packed rows: `reward_model.batch_values`, `critic.ppo_targets`
  and `objectives.value_terms`, as the PPO job runs them."""
  graphdef, _ = reward_model.abstract_params(CFG)
  terms, weight = objectives.value_terms(0.2)
  batch = jax.device_put(batch_np, layout.replicated())

  @jax.jit
  def run(params, batch):
    with use_layout(layout):
      values = reward_model.batch_values(graphdef, params, batch)
      targets = critic.ppo_targets(
          batch["scores"], batch["sampler_logp"], batch["ref_logp"], values,
          batch["loss_mask"], kl_coef=0.05, seq_BxT=batch["seq"],
          sequence_sums=lambda x: grouped.sequence_sums(x, batch, N * G))
      mb = {**batch, "old_values": values, "returns": targets["returns"]
            + 0.3 * batch["noise"]}
      (loss, _), grads = jax.value_and_grad(
          lambda p: terms(graphdef, p, mb), has_aux=True)(params)
      return (values, targets["advantages"], targets["returns"],
              loss / weight(mb), grads)

  return jax.tree.map(np.asarray, run(critic_params, batch))


def test_ppo_critic_on_packed_rows_equals_the_unsplit_sequences(mesh8):
  """PPO's critic with context = 2, 4, 8: values, GAE's advantages and
  returns over the split sequences, the clipped value loss and its
  gradients equal context = 1's."""
  samples = _samples(3)
  packed = batch_lib.pack(samples, P, R, group_size=G,
                          slots=packing.Slots(PACK, shards=8))
  rng = np.random.default_rng(4)
  batch = {**packed.arrays, "sampler_logp": packed.sampler_logp,
           "ref_logp": packed.sampler_logp - 0.1 * rng.random(
               packed.sampler_logp.shape).astype(np.float32),
           "scores": rng.normal(size=N * G).astype(np.float32),
           "noise": rng.normal(size=packed.sampler_logp.shape).astype(
               np.float32)}
  runs = {}
  _, params0 = reward_model.init_params(CFG, 5, mesh_lib.train_layout(mesh8))
  for C, layout in _layouts(mesh8):
    params = mesh_lib.to_layout(params0, layout)
    # A value head that is not zero (it is born at zero).
    params["value_head"].set_value(jax.device_put(
        jnp.linspace(-1.0, 1.0, CFG.embed_dim),
        params["value_head"].get_value().sharding))
    runs[C] = _ppo_critic(layout, params, batch)
  *firsts0, grads0 = runs[1]
  assert float(np.abs(firsts0[0]).max()) > 0.1
  for C in SHARDS:
    *firsts, grads = runs[C]
    for name, a, b in zip(("values", "advantages", "returns", "loss"),
                          firsts, firsts0):
      _close(a, b, f"C={C} {name}")
    for (path, g), g0 in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree.leaves(grads0)):
      _close(g, g0, f"C={C} grad {jax.tree_util.keystr(path)}")


@pytest.mark.slow
def test_grpo_job_with_context_4_gives_the_unsplit_metrics(mesh8, tmp_path):
  """configs/tiny_grpo.py:runlocal with packed rows of 64 tokens (several
  sequences a row, crossing the 16-token shards) run for 3 RL steps with
  `mesh.context=4` (FSDP 2) gives `mesh.context=1`'s metrics (FSDP 8),
  warm-start included. One mini-batch a step: rows are dealt to the batch
  shards (8 or 2 here), so with two mini-batches each would hold other
  sequences in the two runs (tests/rl/test_packing.py does the same)."""
  del mesh8
  import resume  # pylint: disable=g-import-not-at-top
  from configs import tiny_grpo  # pylint: disable=g-import-not-at-top
  from rlhf_jax.metrics import MetricWriter  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top

  records = {}
  for C in (1, 4):
    config = resume.override(tiny_grpo.get_config("runlocal"), **{
        "train.steps": 3, "eval.every": 3, "rl.pack_length": 64,
        "rl.num_minibatches": 1, "mesh.context": C})
    workdir = str(tmp_path / f"context{C}")
    rl_job.run(config, workdir)
    records[C] = {r["step"]: r for r in MetricWriter(
        workdir, enabled=False).read() if r["phase"] == "rl"}
  assert sorted(records[4]) == sorted(records[1]) == [0, 1, 2, 3]
  keys = ("train/loss", "train/kl", "train/grad_norm", "train/entropy",
          "rollout/reward_mean", "rollout/response_len_mean")
  for step in (1, 2, 3):
    for key in keys:
      a, b = records[4][step][key], records[1][step][key]
      # As tests/trainers/test_grpo.py: fp32 relative 1e-5, and 1e-6 for
      # the policy loss's near-cancelling sum.
      assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, (step, key, a, b)
  assert all(records[1][s]["train/grad_norm"] > 1e-3 for s in (1, 2, 3))
  for key in ("eval/accuracy",):
    assert records[4][3][key] == records[1][3][key]


def test_config_errors_name_the_key():
  """`mesh.context` below 1, and an MoE policy split over `context`, are
  refused in one line before anything compiles."""
  import resume  # pylint: disable=g-import-not-at-top
  from configs import tiny_grpo_moe  # pylint: disable=g-import-not-at-top
  from rlhf_jax.config import sections  # pylint: disable=g-import-not-at-top
  from rlhf_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="config.mesh.context=0"):
    sections.Mesh(context=0)
  with pytest.raises(ConfigError, match=r"^config\.mesh\.context=2: context "
                     r"> 1 with mesh\.tensor != 1: not implemented yet"):
    sections.Mesh(context=2, tensor=2)
  c = resume.override(tiny_grpo_moe.get_config("runlocal"),
                      **{"mesh.context": 2, "rl.pack_length": 64})
  with pytest.raises(ConfigError, match=r"^config\.mesh\.context > 1 with an "
                     r"MoE policy: not implemented yet [^\n]*$"):
    rl_job.build(c)
