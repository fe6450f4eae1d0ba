"""The policy's parts that GRPO and PPO build the same way.

  policy = policy_lib.build(c, source, train_layout, rollout_layout, timeline)

From the `model`, `lora`, `rl`, `optim`, `mesh` and `rollout` sections:
the model (random or HF), the learner (with LoRA: adapters only, its own
graphdef), the train <-> rollout switch (`Colocation`; with LoRA or
`rollout.quantize` its rollout copy is derived by `models/rollout_copy.py`)
and the job's rollouts, which run the rollout model. `fresh_states` turns
the post-SFT params into the checkpointed states: the policy's train state
and, without LoRA, a frozen reference copy (a LoRA policy's reference is
its own base). `fused_scoring` gives the job the forward passes the
long-tail rollout runs on the replicas its tail frees, when they apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from rlhf_jax.config import compose
from rlhf_jax.errors import ConfigError
from rlhf_jax.models import checkpoint_or_preset
from rlhf_jax.models import hf_adapters, lora, rollout_copy
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import colocate
from rlhf_jax.rl import objectives, off_policy
from rlhf_jax.rl.learner import Learner, make_optimizer
from rlhf_jax.scoring.passes import ScoringPasses
from rlhf_jax.rollout import build as rollout_build
from rlhf_jax.step_clock import StepClock


@dataclasses.dataclass
class Policy:
  """The policy model, its learner, layout switch and rollouts."""
  cfg: Any                  # ModelConfig (no adapters).
  graphdef: Any             # The plain model (SFT, export).
  rollout_cfg: Any          # What the rollout engines run
  rollout_graphdef: Any     # (`rollout_copy.rollout_model`).
  params: Any               # Initial weights (random or HF), before SFT.
  learner: Learner
  colocation: colocate.Colocation
  clock: StepClock          # The job's phases on its timeline.
  rollout: Any
  eval_rollout: Any
  sampled_eval_rollout: Any  # `eval.num_samples` a prompt, or None.
  lora_spec: Any            # LoraSpec or None.
  lora_init_from: str
  seed: int
  train_layout: Any

  def trained_params(self, params):
    """The params the learner trains, from the (post-SFT) `params`: with
    LoRA, adapters (fresh, or `lora.init_from`'s) on them as the frozen
    base; else the params themselves."""
    if self.lora_spec is None:
      return params
    lora_cfg, _, policy = lora.attach(self.cfg, params, self.lora_spec,
                                      seed=self.seed,
                                      layout=self.train_layout)
    if self.lora_init_from:  # Adapters saved by an earlier run.
      fresh, base = lora.split(policy)
      saved = hf_adapters.load(self.lora_init_from, lora_cfg, fresh)
      policy = nnx.merge_state(jax.device_put(
          saved, jax.tree.map(lambda x: x.sharding, fresh)), base)
    return policy

  def fresh_states(self, params, key: str, *, copy: bool = True) -> dict:
    """{key: the train state of the post-SFT `params`} and, without LoRA,
    "ref": the reference (a frozen copy unless `copy=False`, a restore
    target: the policy's buffers are donated)."""
    states = {key: self.learner.init_state(self.trained_params(params))}
    if self.lora_spec is None:
      states["ref"] = jax.tree.map(lambda x: jnp.array(x, copy=True),
                                   params) if copy else params
    return states


def build(c, source, train_layout, rollout_layout, timeline=None) -> Policy:
  """The policy of the job sections `c` (see the module doc)."""
  # top_k against the model's vocabulary before its weights are built or
  # loaded: a config error, nothing compiled yet.
  c.rollout.check_sampling(checkpoint_or_preset.config_of(
      c.model, vocab_size=source.tokenizer.vocab_size).vocab_size)
  is_moe = checkpoint_or_preset.config_of(
      c.model, vocab_size=source.tokenizer.vocab_size).is_moe
  if c.rl.routing_replay and not is_moe:
    raise ConfigError("config.rl.routing_replay=True: the model has no "
                      "routed experts (config.model is dense)")
  if c.mesh.context > 1 and is_moe:
    raise ConfigError("config.mesh.context > 1 with an MoE policy: not "
                      "implemented yet (its layers route each device's "
                      "whole sequences); set mesh.context=1")
  cfg, graphdef, params = checkpoint_or_preset.build(
      c.model, seed=c.seed, layout=train_layout,
      vocab_size=source.tokenizer.vocab_size)
  spec = c.lora.spec()
  if c.lora.init_from:  # Before the warm-start: a bad directory loses nothing.
    hf_adapters.check(c.lora.init_from, spec)
  train_graphdef, train_like = graphdef, params
  if spec is not None:
    _, train_graphdef, train_like = lora.attach(
        cfg, model_lib.abstract_params(cfg)[1], spec, seed=c.seed)
  learner = objectives.policy_learner(
      train_graphdef, train_layout, c.rl.policy_loss_config(
          max_len=c.rollout.max_new_tokens), make_optimizer(c.optim),
      micro_batches=c.rl.micro_batches,
      trainable=None if spec is None else lora.ADAPTERS)
  rollout_cfg, rollout_graphdef, rollout_weights = rollout_copy.rollout_model(
      cfg, graphdef, lora_spec=spec, quant=c.rollout.quantize,
      scan_layers=False if c.rollout.unroll_layers else None)
  co = colocate.Colocation.from_section(
      c.mesh, train_layout, rollout_layout, train_like,
      rollout_dtype=cfg.compute_jnp_dtype, rollout_weights=rollout_weights)
  clock = StepClock(timeline, train_layout.mesh.devices.flat)
  rollout, eval_rollout, sampled_eval_rollout = rollout_build.for_job(
      c, rollout_cfg, rollout_graphdef, rollout_layout, source.tokenizer,
      source.stop_ids, clock, lora_spec=spec)
  return Policy(cfg=cfg, graphdef=graphdef, rollout_cfg=rollout_cfg,
                rollout_graphdef=rollout_graphdef, params=params,
                learner=learner,
                colocation=co, clock=clock, rollout=rollout,
                eval_rollout=eval_rollout,
                sampled_eval_rollout=sampled_eval_rollout,
                lora_spec=spec, lora_init_from=c.lora.init_from,
                seed=c.seed, train_layout=train_layout)


def fused_scoring(c, p: Policy, prompt_len: int, *, kind: str,
                  heads_graphdef=None,
                  critic_graphdef=None) -> ScoringPasses | None:
  """The passes the long-tail rollout runs on finished samples
  (`rollout.long_tail.fusion`, `scoring/passes.py`, `scoring/fused.py`): the policy's and
  reference's log-probs, and with `heads_graphdef` (PPO) the reward
  model's scores and the critic's values (`critic_graphdef`, default
  `heads_graphdef`). None where fusion is off or the job has a feature it
  steps aside for (`config/compose.py`, logged): the step then runs them
  after the rollout. `kind`: the algorithm's ("grpo" or "ppo")."""
  tail = c.rollout.long_tail
  if not (tail.enabled and tail.fusion):
    return None
  why = compose.unfused_because(c, kind)
  if why is not None:
    logging.info("rollout.long_tail.fusion: scoring after the rollout, "
                 "because %s", why)
    return None
  # The table's "cast copy" feature reads the config; the switch built
  # from it must agree, or fused old log-probs would be the copy's.
  assert p.colocation.rollout_is_master or off_policy.on_policy(c.rl)
  return ScoringPasses(
      p.graphdef, prompt_len=prompt_len, max_new=c.rollout.max_new_tokens,
      with_policy=not off_policy.on_policy(c.rl),
      heads_graphdef=heads_graphdef, critic_graphdef=critic_graphdef,
      with_rm=heads_graphdef is not None,
      with_critic=heads_graphdef is not None, pack=c.rl.pack_length > 0)
