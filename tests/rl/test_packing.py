"""Sequence packing: rows of several sequences train exactly what one
sequence per row trains, rows are dealt evenly, and the learner's
micro-batches and shards find the rows dealt to them."""

import types

import fakes
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives, packing
from rlhf_jax.rl.learner import OptimConfig, make_optimizer, split_micro
from rlhf_jax.rl.prepare import AdvantageConfig, Preparer
from rlhf_jax.sched import row_packing as rules
from rlhf_jax.rl.losses import KLConfig

# Gemma-2-like switches (window, soft-caps) so segment masks meet them all.
CFG = ModelConfig.tiny(
    vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    embed_dim=32, mlp_dim=64, sliding_window=6, attn_logit_softcap=20.0,
    final_logit_softcap=10.0, post_norms=True, norm_plus_one=True,
    mlp_activation="gelu", embed_scale=True, tie_embeddings=True,
    attention="chunked")
P, R, N, G = 9, 12, 4, 4


def _samples(seed=0):
  """N groups of G samples: varied prompt and response lengths, one empty
  response; sampler log-probs random."""
  rng = np.random.default_rng(seed)
  out = []
  for n in range(N):
    prompt = rng.integers(1, CFG.vocab_size, rng.integers(2, P + 1))
    for g in range(G):
      r = 0 if (n, g) == (1, 2) else int(rng.integers(1, R + 1))
      out.append(types.SimpleNamespace(
          prompt_id=n, prompt_tokens=prompt.tolist(),
          tokens=rng.integers(1, CFG.vocab_size, r).tolist(),
          logp_raw=-rng.random(r).astype(np.float32)))
  return out


def test_rules_fill_rows_and_deal_them_evenly():
  rng = np.random.default_rng(0)
  units = rng.integers(1, 40, 50).tolist()
  rows = rules.fill_rows(units, 64)
  assert sorted(u for r in rows for u in r) == list(range(50))
  tokens = [sum(units[u] for u in r) for r in rows]
  assert max(tokens) <= 64
  # First-fit decreasing: within 11/9 of the optimum (+1 row).
  assert len(rows) <= 11 / 9 * (sum(units) / 64) + 1
  with pytest.raises(ValueError, match="pack_length"):
    rules.fill_rows([65], 64)
  assert [rules.rows_per_slot(n, 4) for n in (1, 4, 5, 9, 13, 100, 200)] == [
      1, 1, 2, 3, 4, 32, 64]
  slots = rules.deal_rows(tokens, 4, rules.rows_per_slot(len(rows), 4))
  assert sorted(r for s in slots for r in s) == list(range(len(rows)))
  load = [sum(tokens[r] for r in s) for s in slots]
  assert max(load) - min(load) <= max(tokens)


def test_a_small_step_gives_every_minibatch_trained_tokens():
  """Fewer rows than slots: ties go round the mini-batches first, so no
  mini-batch is all padding (its update would be a zero-gradient AdamW
  step that still moves the weights by momentum)."""
  assert rules.deal_rows([50, 40, 30], 8, 1, minibatches=2) == [
      [0], [2], [], [], [1], [], [], []]
  with pytest.raises(ValueError, match="not 3 mini-batches"):
    rules.deal_rows([5], 8, 1, minibatches=3)
  samples = _samples()
  keep = np.ones(N * G, bool)
  for m, length, group_size in ((2, 64, G), (4, 32, 0)):
    slots = packing.Slots(length, minibatches=m, micro_batches=2, shards=8)
    arrays, _ = packing.pack(samples, slots, group_size=group_size,
                             keep=keep)
    per_minibatch = arrays["loss_mask"].reshape(m, -1).sum(axis=1)
    rows = arrays["loss_mask"].any(axis=1).sum()
    assert rows < slots.count  # The case: most slots stay empty.
    assert (per_minibatch > 0).all(), per_minibatch
    assert per_minibatch.sum() == sum(len(s.tokens) for s in samples)


def test_slot_order_is_where_split_micro_and_the_mesh_put_each_slot(mesh8):
  """Row `slot_order(...)[cell]` lands in that cell: its mini-batch block,
  the micro-batch `split_micro` makes, the device the batch axis puts it
  on (checked on the real 8-device train layout)."""
  layout = mesh_lib.train_layout(mesh8)
  slots = packing.Slots(8, minibatches=2, micro_batches=3,
                        shards=layout.shards("batch"))
  k = 2
  order = slot_order = packing.slot_order(slots, k).reshape(
      2, 3, slots.shards, k)
  n = 3 * slots.shards * k
  rows = np.arange(2 * n)
  for m in range(2):
    micro = np.asarray(split_micro({"x": jnp.asarray(rows[m * n:(m + 1) * n])},
                                   3)["x"])
    for u in range(3):
      on = jax.device_put(micro[u], layout.sharding(("batch",), micro[u].shape))
      by_device = {s.device: np.asarray(s.data) for s in on.addressable_shards}
      for d, device in enumerate(layout.mesh.devices.reshape(-1)[
          :slots.shards]):
        np.testing.assert_array_equal(by_device[device], order[m, u, d])
  assert sorted(slot_order.reshape(-1)) == list(range(2 * n))


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _train_view(samples, rewards, keep, params, ref, layout,
                **pack_kw):
  """(batch, info, {mode: (loss, grads)}) of one layout: the ADVANTAGES
  stage (KL as a reward penalty), then the learner's gradient sums over 2
  micro-batches for "seq-mean-token-mean" (KL also as a loss term) and one
  jitted value-and-grad for every aggregation mode."""
  graphdef, _ = model_lib.abstract_params(CFG)

  def loss_config(mode):
    return objectives.PolicyLossConfig(kl=KLConfig(0.05), aggregation=mode,
                                       max_len=R)

  learner = objectives.policy_learner(
      graphdef, layout, loss_config(MODES[1]), make_optimizer(OptimConfig()),
      micro_batches=2)
  preparer = Preparer(learner, AdvantageConfig(
      "grpo", G, kl=KLConfig(0.05, in_loss=False)))
  packed = batch_lib.pack(samples, P, R, keep=keep, **pack_kw)
  batch, info = preparer(params, ref, preparer.put(packed, rewards))
  grads, num, _, weight = learner.grad_sums(params, batch)
  out = {"learner": (float(num / weight),
                     jax.tree.map(lambda g: np.asarray(g / weight), grads))}

  # GSPO at weights moved off the batch's old ones: each sequence's ratio
  # is its own (at the old weights every ratio is 1, and a row's mean
  # would pass), some sequences clipped.
  gspo = objectives.PolicyLossConfig(
      policy_loss="gspo", clip_low=0.02, clip_high=0.02,
      aggregation=MODES[1])
  moved = jax.tree.map(lambda x: x * 1.04, params)

  @jax.jit
  def every_mode(params, moved, batch):
    res = {}
    with use_layout(layout):
      for mode, config, at in [(m, loss_config(m), params) for m in MODES] + [
          ("gspo", gspo, moved)]:
        terms, weight_fn = objectives.policy_terms(config)

        def loss(p, terms=terms, weight_fn=weight_fn):
          num, aux = terms(graphdef, p, batch)
          return num / weight_fn(batch), aux["clip_frac"]

        res[mode] = jax.value_and_grad(loss, has_aux=True)(at)
    return res

  clipped = {}
  for mode, ((loss, clipped[mode]), grads) in every_mode(
      params, moved, batch).items():
    out[mode] = (float(loss), jax.tree.map(np.asarray, grads))
  info = {**jax.device_get(info), "gspo_clip_frac": float(clipped["gspo"])}
  return batch, info, out


def test_packed_batch_loss_equals_unpacked(mesh8):
  """Packed rows, with and without shared prompts, give the repeated
  layout's loss and gradients in every aggregation mode and with GSPO's
  sequence ratio (through the learner's micro-batched gradient sums too,
  on 8 devices), and its
  sequence KL and rewards from the ADVANTAGES stage; an untrained sample
  and an empty response take no room in the rows."""
  layout = mesh_lib.train_layout(mesh8)
  _, params = model_lib.init_params(CFG, 0, layout)
  ref = jax.tree.map(lambda x: x * 1.05, params)
  samples = _samples()
  rewards = np.random.default_rng(1).normal(size=N * G).astype(np.float32)
  keep = np.ones(N * G, bool)
  keep[5] = False
  slots = packing.Slots(32, micro_batches=2, shards=layout.shards("batch"))
  views = {
      "repeated": _train_view(samples, rewards, keep, params, ref,
                              layout),
      "packed": _train_view(samples, rewards, keep, params, ref,
                            layout, slots=slots),
      "packed_groups": _train_view(samples, rewards, keep, params, ref,
                                   layout, group_size=G, slots=slots),
  }
  batch0, info0, out0 = views["repeated"]
  trained = sum(len(s.tokens) for b, s in enumerate(samples) if keep[b])
  for name, (batch, info, out) in views.items():
    np.testing.assert_allclose(info["kl"], info0["kl"], rtol=1e-4, atol=1e-5,
                               err_msg=name)
    np.testing.assert_allclose(info["rewards"], info0["rewards"])
    assert float(np.sum(batch["loss_mask"])) == trained
    for key, (loss0, grads0) in out0.items():
      assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads0)) > 1e-4
      loss, grads = out[key]
      np.testing.assert_allclose(loss, loss0, rtol=2e-5, atol=1e-6,
                                 err_msg=f"{name} {key}")
      for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads)):
        np.testing.assert_allclose(b, a, rtol=5e-4, atol=2e-6,
                                   err_msg=f"{name} {key}")
  # The three modes differ (the check would see a mode mix-up); GSPO
  # clipped some sequences and not others.
  assert len({round(out0[m][0], 6) for m in MODES}) == 3
  assert 0 < info0["gspo_clip_frac"] < 1, info0["gspo_clip_frac"]
  # Packed rows hold real tokens only where they hold any (the 16 slots of
  # this tiny batch are mostly empty rows; at scale they fill), and fewer
  # than the padded layout's rows do: no prompt twice with shared prompts.
  real = {k: int(np.sum(np.asarray(v[0]["seg"]) >= 0))
          for k, v in views.items() if k.startswith("packed")}
  repeated_real = int(np.sum(np.asarray(batch0["attn_mask"])))
  assert real["packed_groups"] < real["packed"] < repeated_real, (
      real, repeated_real)


def test_packed_advantages_sit_on_their_sequence_tokens(mesh8):
  """Per-token advantages of packed rows are each token's sequence's group
  advantage (recomputed here from the rewards: (r - mean) / (std + eps))."""
  layout = mesh_lib.train_layout(mesh8)
  _, params = model_lib.init_params(CFG, 0, layout)
  samples = _samples(3)
  rewards = np.random.default_rng(2).normal(size=N * G).astype(np.float32)
  packed = batch_lib.pack(samples, P, R, group_size=G, slots=packing.Slots(
      40, micro_batches=2, shards=layout.shards("batch")))
  graphdef, _ = model_lib.abstract_params(CFG)
  learner = objectives.policy_learner(
      graphdef, layout, objectives.PolicyLossConfig(),
      make_optimizer(OptimConfig()), micro_batches=2)
  preparer = Preparer(learner, AdvantageConfig("grpo", G))
  batch, _ = preparer(params, params, preparer.put(packed, rewards))
  r = rewards.reshape(N, G)
  adv = ((r - r.mean(1, keepdims=True)) /
         (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
  seq, mask = np.asarray(batch["seq"]), np.asarray(batch["loss_mask"]) > 0
  np.testing.assert_allclose(np.asarray(batch["advantages"])[mask],
                             adv[seq[mask]], rtol=1e-4, atol=1e-5)
  # Each sample's targets are its response, in order, in one row.
  targets = np.asarray(batch["targets"])
  for b, s in enumerate(samples):
    rows, cols = np.nonzero(seq == b)
    assert len(set(rows)) == (1 if s.tokens else 0)
    np.testing.assert_array_equal(targets[rows, cols], s.tokens)


def test_grpo_job_with_packing_equals_unpacked(tiny_grpo_job):
  """configs/tiny_grpo.py:runlocal with `rl.pack_length` (shared prompts
  in packed rows) takes the unpacked job's step on the same samples (the
  plain step's, replayed: packing is the train side's): loss, gradient
  norm and KL (one mini-batch: the two layouts then hold the same
  sequences)."""
  metrics, jobs, rollout = {}, {}, None
  for name, pack_length in (("plain", 0), ("packed", 40)):
    jobs[name] = tiny_grpo_job({"rl.num_minibatches": 1,
                                "rl.pack_length": pack_length})
    seen = fakes.capture_samples(jobs[name])
    prompts = next(jobs[name].iterator)
    _, metrics[name] = fakes.first_step(jobs[name], prompts, rollout)
    if rollout is None:  # The plain step's samples, for the packed one.
      rollout = fakes.ScriptedRollout(
          fakes.ScriptedRollout.recorded(seen[0].samples))
  assert [sizes for _, _, sizes in rollout.streams] == [
      [jobs["packed"].c.rollout.samples_per_row] * len(prompts.prompt_ids)]
  ours, plain = metrics["packed"], metrics["plain"]
  for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss",
            "train/grad_norm", "train/kl", "train/entropy"):
    np.testing.assert_allclose(ours[k], plain[k], rtol=1e-4, atol=1e-7,
                               err_msg=k)
  assert plain["train/grad_norm"] > 0


def test_positions_count_what_each_layout_computes_on():
  """`PackedBatch.positions()`: (positions computed, of them real tokens),
  against a hand count from the samples' lengths."""
  samples = _samples()
  prompt = [len(samples[n * G].prompt_tokens) for n in range(N)]
  response = [len(s.tokens) for s in samples]
  # Repeated: B rows of P + R, each holding its prompt and response.
  repeated = batch_lib.pack(samples, P, R)
  assert repeated.positions() == (N * G * (P + R),
                                  sum(G * p for p in prompt) + sum(response))
  # Grouped: each prompt once in [N, P], responses in [N, G, R].
  grouped = batch_lib.pack(samples, P, R, group_size=G)
  assert grouped.positions() == (N * P + N * G * R,
                                 sum(prompt) + sum(response))
  # Packed, shared prompts: per group its prompt core (p - 1 tokens) and
  # per non-empty response a copy of the prompt's last token and all but
  # its last token (the last is only a target): p - 1 + sum(r). Rows of 64
  # hold a whole group (P - 1 + G * R = 56), so no prompt core repeats.
  slots = packing.Slots(length=64, minibatches=1, micro_batches=2)
  packed = batch_lib.pack(samples, P, R, group_size=G, slots=slots)
  computed, real = packed.positions()
  assert computed == packed.arrays["tokens"].size
  assert computed % (2 * 64) == 0
  assert real == sum(prompt[n] - 1 + sum(response[n * G:(n + 1) * G])
                     for n in range(N))
