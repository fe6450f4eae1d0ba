"""The ADVANTAGES stage: a sampled batch becomes a training batch in one
jitted function, shared by GRPO and PPO.

  batch = preparer.put(packed, rewards)            # the step's one put
  batch, info = preparer(params, ref_params, batch, values=None)
  batch, info = preparer.from_scores(batch, scores)  # passes already run

Inside: old log-probs (the policy the samples came from, recomputed by the
trainer; not on the on-policy path, `off_policy.on_policy`, where the loss
anchors on its own and measures the mismatch), reference log-probs, the KL
reward penalty (when the KL is not a loss term), the advantage estimator (a
registered group estimator on the sequence rewards, or GAE on the critic's
`values` for PPO), and the sampler-vs-trainer mismatch
(`rl/off_policy.py`). The result holds what the policy loss (and the
critic's value loss) read, the sampler's log-probs included; `info`
(replicated) the sequence rewards (before the penalty), the sequence KL,
the mismatch and, with GAE, the mean critic value and return. `from_scores`
is the same stage when the forward passes already ran elsewhere
(`scoring/passes.py`: on the devices the long tail freed, while it
decoded): only the advantages remain. Every layout of `rl/grouped.py` works
(packed rows: sequence sums by segment, advantages laid out per token; GAE,
PPO's, restarts where a row's next sequence begins).

Dimension letters: B sequences, T positions, N groups, G per group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax.models import lora
from rlhf_jax.parallel.layout import constrain, use_layout
from rlhf_jax.rl import critic, grouped, losses, off_policy, registry
from rlhf_jax.rl.aggregation import masked_mean
from rlhf_jax.rl.batch import PackedBatch
from rlhf_jax.rl.learner import (
    Learner, batch_axes, batch_logprobs, own_routing_logprobs)

# Inputs of the stage that the model's forward does not read.
_INPUTS = ("rewards", "sampler_logp", "current")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """How rewards become advantages."""
  estimator: str          # Registered "advantage" name, or "gae" (critic).
  group_size: int         # G.
  kl: losses.KLConfig = losses.KLConfig()  # A reward penalty unless in_loss.
  gamma: float = 1.0      # GAE.
  lam: float = 0.95
  whiten: bool = True
  # One update per batch (`off_policy.on_policy`): no old-log-prob pass;
  # the loss anchors on its own log-probs and measures the mismatch.
  on_policy: bool = False


class Preparer:
  """The stage for one policy learner (its model, layout, micro-batches)."""

  def __init__(self, learner: Learner, c: AdvantageConfig):
    if c.estimator != "gae":
      registry.get("advantage", c.estimator)  # Fail early on a bad name.
    self.learner, self.c = learner, c
    self.trace_count = 0
    self._jit = jax.jit(self._prepare)
    self._jit_scored = jax.jit(self._advantages)

  def put(self, packed: PackedBatch, rewards=None, current=None) -> dict:
    """The packed host arrays (+ sampler log-probs, + host rewards [B]) on
    device, batch-sharded: the step's one host->device transfer.
    `current` [B] bool (default all): the samples the trainer's weights
    drew (async RL), the only ones the mismatch is measured on."""
    arrays = {**packed.arrays, "sampler_logp": packed.sampler_logp}
    batch = self.learner.put_batch(arrays)
    per_sequence = {"rewards": rewards, "current": current}
    for key, values in per_sequence.items():
      if values is None:  # Host numpy: no device round trip here.
        continue
      values = np.asarray(values, np.float32)
      if grouped.is_packed(arrays):  # [B]: not row-aligned; replicated.
        batch[key] = jax.device_put(values, self.learner.layout.replicated())
      else:
        batch.update(self.learner.put_batch(
            {key: values.reshape(packed.sampler_logp.shape[:-1])}))
    return batch

  def __call__(self, params, ref_params, batch: dict, values=None):
    """(training batch, info) from a `put` batch; `batch["rewards"]` [B]
    (or [N, G]) are sequence rewards, e.g. scores of a reward model, and
    `values` [B, T] the critic's (GAE only)."""
    if (values is None) != (self.c.estimator != "gae"):
      raise ValueError(f"estimator {self.c.estimator!r}: critic values are "
                       f"{'required' if values is None else 'unused'}")
    return self._jit(params, ref_params, batch, values)

  def from_scores(self, batch: dict, scores: dict):
    """(training batch, info) from a `put` batch whose forward passes ran
    already: `scores` holds host arrays laid out like `loss_mask`,
    "old_logp" and "ref_logp", and "values" for GAE."""
    if ("values" in scores) != (self.c.estimator == "gae"):
      raise ValueError(f"estimator {self.c.estimator!r}: critic values are "
                       f"{'unused' if 'values' in scores else 'required'}")
    if ("old_logp" in scores) == self.c.on_policy:
      raise ValueError(f"on_policy={self.c.on_policy}: old log-probs are "
                       f"{'unused' if self.c.on_policy else 'required'}")
    placed = self.learner.put_batch(dict(scores))
    return self._jit_scored(batch, placed.get("old_logp"), placed["ref_logp"],
                            placed.get("values"))

  def _prepare(self, params, ref_params, batch, values):
    lr = self.learner
    with use_layout(lr.layout):
      model_batch = {k: v for k, v in batch.items() if k not in _INPUTS}
      old_logp = None if self.c.on_policy else batch_logprobs(
          lr.graphdef, params, model_batch, lr.micro_batches)
      if ref_params is None:  # A LoRA policy's reference: its own base.
        ref_params = lora.without_adapters(params)
      ref_logp = batch_logprobs(lr.graphdef, ref_params, model_batch,
                                lr.micro_batches)
      own_routing = None
      if any(k.endswith("routes") for k in model_batch):  # Routing replay.
        # The mismatch replay removes, and the router's flips: the
        # trainer's own routing (one more forward a step).
        own_routing = own_routing_logprobs(lr.graphdef, params, model_batch,
                                           lr.micro_batches)
    return self._advantages(batch, old_logp, ref_logp, values, own_routing)

  def _advantages(self, batch, old_logp, ref_logp, values,
                  own_routing=None):
    self.trace_count += 1
    c, lr = self.c, self.learner
    with use_layout(lr.layout):
      model_batch = {k: v for k, v in batch.items() if k not in _INPUTS}
      mask = batch["loss_mask"]
      B = batch["rewards"].size
      # The sequence KL (info only: no reward penalty on the on-policy
      # path) of the sampler's log-probs where the trainer's are not run.
      policy_logp = batch["sampler_logp"] if old_logp is None else old_logp
      rows = [x.reshape(-1, x.shape[-1])
              for x in (policy_logp, ref_logp, mask)]
      rewards = scores = batch["rewards"].reshape(B)
      out = {"ref_logp": ref_logp}
      if old_logp is not None:
        out["old_logp"] = old_logp
      if c.estimator == "gae":  # Packed rows: reset where `seq` changes.
        packed = grouped.is_packed(batch)
        t = critic.ppo_targets(
            rewards, *rows[:2], values, rows[2], kl_coef=c.kl.penalty,
            kl_estimator=c.kl.estimator, gamma=c.gamma, lam=c.lam,
            whiten=c.whiten, seq_BxT=batch["seq"] if packed else None,
            sequence_sums=(lambda x: grouped.sequence_sums(x, batch, B))
            if packed else None)
        kl = t["kl"]
        out.update(advantages=t["advantages"], returns=t["returns"],
                   old_values=values)
        extra = {"value_mean": masked_mean(values, rows[2]),
                 "return_mean": masked_mean(t["returns"], rows[2])}
      else:
        extra = {}
        penalised, kl = losses.kl_reward_penalty(
            rewards, *rows, beta=c.kl.penalty, estimator=c.kl.estimator,
            sequence_sums=lambda x: grouped.sequence_sums(x, batch, B))
        if c.kl.penalty:
          rewards = penalised
        out["advantages"] = grouped.per_sequence_values(  # [B]|[N, G]|[W, L]
            registry.get("advantage", c.estimator)(rewards, c.group_size),
            batch)
      out["sampler_logp"] = batch["sampler_logp"]  # The behaviour policy.
      measured = mask
      if "current" in batch:  # Per token: its sample's flag.
        current = grouped.per_sequence_values(batch["current"].reshape(B),
                                              batch)
        measured = mask * current.reshape(current.shape + (1,) * (
            mask.ndim - current.ndim))
      info = {"rewards": scores, "kl": kl, **extra}
      if own_routing is not None:
        own_logp, flipped, recorded = own_routing
        info["mismatch_kl_without_replay"] = off_policy.mismatch(
            own_logp, batch["sampler_logp"], measured)["mismatch_kl"]
        info["moe_flip_rate"] = flipped / jnp.maximum(recorded, 1.0)
      if old_logp is None:  # The loss measures it on these tokens.
        out["mismatch_mask"] = measured
      else:
        info.update(off_policy.mismatch(old_logp, batch["sampler_logp"],
                                        measured))
      # The batch stays sharded over the batch axes, as `put_batch` places
      # it; the (small) info is replicated: every process reads it whole.
      out = {k: constrain(v, batch_axes(v)) for k, v in out.items()}
      info = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x, lr.layout.replicated()), info)
      return {**model_batch, **out}, info
