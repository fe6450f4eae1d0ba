"""Typed, frozen config sections: the locked ConfigDict stops at the job.

A config file builds each section from the dataclass defaults here
(`config_dict(Rollout, num_rows=64, ...)`), so every key has a default and
the locked config rejects a mistyped override. A job turns the ConfigDict
into these dataclasses once (`from_config`); each section validates itself
and names the offending key (`ConfigError`), and the checks that span
sections live in `config/checks.py`. Library code reads attributes of
these objects, never `config.get(key, default)`.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, ClassVar

from rlhf_jax.data import sources as data_sources
from rlhf_jax.engine import sampling
from rlhf_jax.envs import tools
from rlhf_jax.errors import ConfigError
from rlhf_jax.typed_config import (fail, from_dict, in_range, one_of,
                                   positive_ints)
from rlhf_jax.models import config as model_config
from rlhf_jax.rl import off_policy
from rlhf_jax.rl.learner import OptimConfig
from rlhf_jax.sched import staleness


# ----------------------------------------------------------------- sections
def router_loss(section):
  """An `RL` or `SFT` section's MoE router terms (`objectives.RouterLoss`)."""
  from rlhf_jax.rl.objectives import RouterLoss  # pylint: disable=g-import-not-at-top
  return RouterLoss(balance_coef=section.moe_balance_coef,
                    z_coef=section.moe_z_coef,
                    balance_per_layer=section.moe_balance_per_layer)


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy: a preset with overrides, or a local HF checkpoint."""
  PATH: ClassVar[str] = "model"
  preset: str = "tiny"         # tiny | qwen2.5-0.5b | llama3.2-1b | ...
  overrides: dict = dataclasses.field(default_factory=dict)  # ModelConfig
  param_dtype: str = "float32"   # Master weights (the optimizer's).
  compute_dtype: str = "float32"
  path: str = ""               # Local HF checkpoint directory ("": random).
  # How the layers run: `jax.lax.scan` over the stacked layers (False: a
  # Python loop), and activation checkpointing: "none" | "full" | "dots".
  scan_layers: bool = True
  remat: str = "none"
  # Training / prefill attention (kernels_pallas/flash_attention.py):
  # "auto" (splash on TPU, cuDNN on GPU where they apply, else chunked),
  # "chunked", "splash", "cudnn", "reference" (T x T; tests).
  attention: str = "auto"

  def __post_init__(self):
    for key in ("param_dtype", "compute_dtype"):
      one_of(self, key, model_config.DTYPES)
    one_of(self, "remat", model_config.REMAT_POLICIES)
    one_of(self, "attention", model_config.ATTENTION_IMPLS)

  def model_config(self, **fixed):
    """The preset's `ModelConfig` with the overrides; `fixed` wins."""
    kw = dict(self.overrides, param_dtype=self.param_dtype,
              compute_dtype=self.compute_dtype, scan_layers=self.scan_layers,
              remat=self.remat, attention=self.attention, **fixed)
    try:
      return model_config.ModelConfig.preset(self.preset, **kw)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.model: {e}") from None


@dataclasses.dataclass(frozen=True)
class Logging:
  """Where metrics go beside metrics.jsonl and TensorBoard
  (`metrics.MetricWriter`): `wandb="offline"` also writes a Weights &
  Biases run under <workdir>/wandb (the optional extra `.[wandb]`; sync it
  with `wandb sync` from a machine that may reach W&B: the job itself
  talks to no server). "off": no W&B."""
  PATH: ClassVar[str] = "logging"
  wandb: str = "off"
  wandb_project: str = "rlhf_jax"

  def __post_init__(self):
    one_of(self, "wandb", ("off", "offline"))


@dataclasses.dataclass(frozen=True)
class Lora:
  """LoRA policy training (`models/lora.py`): only adapters on the named
  projections train; the reference is the frozen base; rollout merges.
  rank 0: every weight trains (no adapters)."""
  PATH: ClassVar[str] = "lora"
  rank: int = 0
  alpha: float = 16.0
  targets: tuple = ("q", "k", "v", "o")  # Of q k v o gate up down.
  # A PEFT adapter directory (`python -m rlhf_jax.export --adapters`) the
  # adapters start from ("": fresh, B = 0).
  init_from: str = ""

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank < 0:
      fail(self, "rank", "must be an int >= 0 (0: no adapters)")
    if self.init_from and not self.rank:
      fail(self, "init_from", "needs lora.rank > 0 (the adapters' shape)")
    self.spec()

  def spec(self):
    """The model's `LoraSpec` (which checks rank, alpha and targets), None
    when off."""
    if not self.rank:
      return None
    try:
      return model_config.LoraSpec(self.rank, self.alpha, tuple(self.targets))
    except ValueError as e:
      raise ConfigError(f"config.lora.{e}") from None  # "alpha must ..."


@dataclasses.dataclass(frozen=True)
class Mesh:
  """Training mesh axes (one may be -1) and the rollout layout."""
  PATH: ClassVar[str] = "mesh"
  num_devices: int = 0        # 0 = all devices; n = the first n.
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  expert: int = 1             # An MoE's experts split over this many devices.
  context: int = 1            # Each sequence's tokens over this many devices.
  rollout_tensor: int = 1     # Rollout = the same devices as replicas x
  rollout_expert: int = 1     # expert x tensor.
  offload: bool = True        # Optimizer state + reference in host memory.
  # Unstacked layers per jitted reshard (stacked: one leaf per group).
  layers_per_group: int = 1
  stale_samples: str = "raise"  # Samples of older weights: raise | drop.

  def __post_init__(self):
    positive_ints(self, "expert", "context", "rollout_tensor",
                  "rollout_expert", "layers_per_group")
    one_of(self, "stale_samples", staleness.STALE_POLICIES)
    if sum(v == -1 for v in (self.data, self.fsdp, self.tensor)) > 1:
      fail(self, "data", "at most one of data, fsdp, tensor may be -1")
    if self.context > 1 and self.tensor != 1:
      fail(self, "context", "context > 1 with mesh.tensor != 1: not "
           "implemented yet (the gathered attention splits heads over "
           "tensor untested); set one of them to 1")


@dataclasses.dataclass(frozen=True)
class LongTail:
  """Long-tail rollout on the trainer's mesh (`engine/long_tail.py`).

  Length-aware assignment, tail consolidation onto fewer replicas (R_t),
  cost-aware replica count; the same samples as without it.
  """
  PATH: ClassVar[str] = "rollout.long_tail"
  enabled: bool = False
  history_alpha: float = 0.5       # EWMA weight of the per-prompt lengths.
  admission: str = "continuous"    # "static" | "continuous"
  assignment: str = "length"       # "fifo" | "length" | "grouped" (RLHFless)
  cut_tau: float = 0.8             # "grouped": finished fraction to cut at
  consolidate_below: float = 0.2   # R_t (unfinished fraction); 0: never
  migration: str = "kv"            # "kv" | "reprefill" | "auto"
  reprefill_max_tokens: int = 64   # "auto": re-prefill rows this short
  fusion: bool = True              # device scorers score as samples finish
  score_chunk: int = 8             # samples per scoring dispatch
  replicas: str | int = "all"      # "all" | "cost" | a count
  cost_lambda: float = 0.7         # weight of latency vs device-seconds
  default_length: float = 0.0      # prediction for unseen prompts (0: M/2)

  def __post_init__(self):
    if isinstance(self.replicas, str) and self.replicas.isdigit():
      object.__setattr__(self, "replicas", int(self.replicas))  # CLI "4".
    one_of(self, "admission", ("static", "continuous"))
    one_of(self, "assignment", ("fifo", "length", "grouped"))
    in_range(self, "consolidate_below", 0.0, 1.0)
    one_of(self, "migration", ("kv", "reprefill", "auto"))
    positive_ints(self, "score_chunk")
    if not (self.replicas in ("all", "cost") or (
        isinstance(self.replicas, int) and self.replicas >= 1)):
      fail(self, "replicas", "must be 'all', 'cost' or a count >= 1")
    for key in ("cost_lambda", "history_alpha", "cut_tau"):
      in_range(self, key, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Workers:
  """Elastic rollout workers (`rollout/elastic.py`, docs/elastic.md)."""
  PATH: ClassVar[str] = "rollout.workers"
  num: int = 0                 # 0 = the trainer's mesh only.
  kind: str = "local"          # "local" in-process | "ray" actors.
  theta: int = 4               # Queued requests per worker at most.
  poll_steps: int = 8          # Decode steps per poll round.
  devices_per_worker: int = 1  # Local devices per worker.
  timeout_s: float = 300.0     # A silent worker counts as preempted.
  # Ray resources each worker actor asks for: CPUs, GPUs, custom ones
  # ({"TPU": 4}, {"spot": 1}: docs/elastic.md).
  cpus_per_worker: float = 1.0
  gpus_per_worker: float = 0.0
  ray_resources: dict = dataclasses.field(default_factory=dict)
  # Scale to demand (workers/demand_pool.py): hold every available worker
  # ("all") or the cost-aware count ("cost"; lambda = weight of latency vs
  # cost).
  scale: str = "all"
  cost_lambda: float = 0.5
  # Adaptive offload (RLBoost Algorithm 1): the trainer's engine seeds for
  # T_seed, then hands its unfinished samples to the workers.
  seed: bool = False
  seed_init_s: float = 1.0
  seed_eta: float = 3.0
  seed_floor_s: float = 0.05

  def __post_init__(self):
    if self.num < 0:
      fail(self, "num", "must be >= 0")
    one_of(self, "kind", ("local", "ray"))
    positive_ints(self, "theta", "poll_steps", "devices_per_worker")
    if not self.cpus_per_worker > 0:
      fail(self, "cpus_per_worker", "must be > 0")
    if self.gpus_per_worker < 0:
      fail(self, "gpus_per_worker", "must be >= 0")
    bad = {k: v for k, v in self.ray_resources.items()
           if not (isinstance(v, (int, float)) and v > 0)}
    if bad:
      fail(self, "ray_resources", f"amounts must be > 0, got {bad}")
    one_of(self, "scale", ("all", "cost"))
    in_range(self, "cost_lambda", 0.0, 1.0)
    if not (self.seed_init_s >= 0 and self.seed_floor_s >= 0):
      fail(self, "seed_init_s", "seed_init_s and seed_floor_s must be >= 0")
    if not self.seed_eta > 0:
      fail(self, "seed_eta", "must be > 0")


@dataclasses.dataclass(frozen=True)
class Rollout:
  """The decode engine's static shapes, sampling, and the rollout layers."""
  PATH: ClassVar[str] = "rollout"
  num_rows: int = 8              # Prompts decoding at once (engine rows).
  samples_per_row: int = 8       # G: samples per prompt, sharing its KV.
  prefill_buckets: tuple = (64,)  # Padded prompt lengths.
  max_new_tokens: int = 64
  max_seq_len: int = 128         # KV capacity: bucket + max_new_tokens.
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  attention_impl: str = "auto"   # "auto" | "xla" | "pallas"
  # > 0: a token prefix all prompts of a batch share (system prompt, chat
  # template) is prefilled and stored once, up to this length.
  max_common_length: int = 0
  # Decoding runs on the paged engine (engine/engine.py: KV in a page pool,
  # a finished sample frees its pages and slot at once, decode reads live
  # pages only) on the trainer's mesh, in evaluation and on the elastic
  # workers alike.
  page_size: int = 16            # Tokens per page.
  # paged: most decode steps one engine call runs while no sample waits
  # for a slot (one dispatch, one result copy for all; a sample that ends
  # inside the window is read at its end).
  decode_window: int = 8
  kv_pages: int = 0              # paged: pool pages; 0: every slot's
                                 # sample at max_new_tokens with its prompt.
  num_slots: int = 0             # paged: samples decoding at once; 0:
                                 # num_rows x samples_per_row.
  # Weight-only quantized rollout copy of the block projections: "int8",
  # "fp8" (per-channel scales; models/rollout_copy.py); "none": the
  # compute dtype.
  quantize: str = "none"
  # True: prefill and decode loop over the layers where the model scans
  # them (GPU: no weight-slice copies; ~10x the compile; docs/results.md).
  unroll_layers: bool = False
  long_tail: LongTail = dataclasses.field(default_factory=LongTail)
  workers: Workers = dataclasses.field(default_factory=Workers)

  def __post_init__(self):
    positive_ints(self, "num_rows", "samples_per_row", "page_size",
                   "decode_window")
    self.check_sampling()
    one_of(self, "quantize", model_config.WEIGHT_QUANTS)
    if self.kv_pages < 0 or self.num_slots < 0:
      fail(self, "kv_pages" if self.kv_pages < 0 else "num_slots",
            "must be >= 0 (0: automatic)")
    if not self.prefill_buckets or min(self.prefill_buckets) < 1:
      fail(self, "prefill_buckets", "must be positive lengths")
    one_of(self, "attention_impl", ("auto", "xla", "pallas"))
    if self.max_common_length < 0:
      fail(self, "max_common_length", "must be >= 0")
    cache = max(self.prefill_buckets) + self.max_new_tokens
    if cache > self.max_seq_len:
      fail(self, "max_seq_len",
            f"the largest prefill bucket {max(self.prefill_buckets)} + "
            f"max_new_tokens {self.max_new_tokens} = {cache} does not fit")

  def check_sampling(self, vocab_size: int | None = None) -> None:
    """temperature, top_k, top_p and max_new_tokens against the engine's
    rule (`engine/sampling.range_errors`); top_k's upper bound once the
    model's `vocab_size` is known."""
    for key, rule in sampling.range_errors(
        self.temperature, self.top_k, self.top_p, self.max_new_tokens,
        vocab_size):
      fail(self, key, rule)


@dataclasses.dataclass(frozen=True)
class RL:
  """The RL objective, advantages and update schedule (GRPO and PPO)."""
  PATH: ClassVar[str] = "rl"
  # Registered "advantage" name (grpo | drgrpo | rloo | reinforce_pp | ...),
  # or "gae" (PPO: the critic's values, GAE(gamma, lambda)).
  advantage: str = "grpo"
  policy_loss: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.2         # > clip_low: DAPO clip-higher.
  clip_c: float = 0.0            # Dual-clip constant; 0 = off.
  kl_coef: float = 0.0           # beta.
  kl_estimator: str = "k3"
  kl_in_loss: bool = True        # False: KL is a per-token reward penalty.
  aggregation: str = "token-mean"
  ppo_epochs: int = 1
  num_minibatches: int = 1
  micro_batches: int = 1
  # Log-probs and training run each prompt once for its G responses
  # (rl/grouped.py); False repeats the prompt in every sequence.
  share_prompt: bool = True
  # Sequence packing (rl/packing.py): > 0 trains rows of this many tokens,
  # several sequences each (with share_prompt, a group's prompt once per
  # row), dealt to mini-batches, micro-batches and shards by token count;
  # padding is neither computed nor trained. 0 = one sequence per row.
  pack_length: int = 0
  # Micro-batch streaming (rl/train_stage.Streamed): once the trainer's
  # devices leave the rollout they train on finished groups, stream_parts
  # parts a step, while the rest is still decoding.
  stream: bool = False
  stream_parts: int = 2
  # DAPO: refill groups whose rewards are all equal from later prompt
  # batches (at most dynamic_max_rounds rollouts per step).
  dynamic_sampling: bool = False
  dynamic_max_rounds: int = 3
  # DAPO soft overlong penalty over the last overlong_buffer tokens of
  # rollout.max_new_tokens (0 = off).
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  rewards: tuple = ()            # Registered reward names (GRPO).
  reward_weights: tuple = ()     # One per reward, or () for all 1.
  on_reward_error: str = "raise"  # | "zero": score 0 and count it.
  # PPO (advantage="gae"): discount, GAE lambda, whitening, value clip.
  gamma: float = 1.0
  lam: float = 0.95
  whiten_advantages: bool = True
  value_clip: float = 0.2        # 0 = unclipped value loss.
  tracked_rewards: tuple = ()    # Logged only, never trained on (PPO).
  # The sampler's log-probs vs the trainer's (rl/off_policy.py): weight
  # each token by pi_trainer / pi_sampler: "none" | "is" (decoupled PPO) |
  # "tis" (truncated at importance_cap) | "mis" (masked past it) |
  # "icepop" (masked outside [importance_floor, importance_cap]).
  importance_weight: str = "none"
  importance_cap: float = 2.0
  importance_floor: float = 0.5
  # Drop whole sequences whose geometric-mean weight leaves sequence_band
  # (both ends kept): "none" | "geometric"; composes with the above.
  sequence_mask: str = "none"
  sequence_band: tuple = (0.99, 1.01)
  # Warn and set rollout/mismatch_alarm when KL(sampler || trainer) per
  # token passes this (0 = off).
  mismatch_alarm_kl: float = 0.01
  # An MoE policy's router losses in the policy loss (`models/moe.py`):
  # load balancing (transformers' router_aux_loss_coef is 0.001), each
  # layer's (True) or transformers' form over all layers together (False),
  # and the z-loss.
  moe_balance_coef: float = 0.0
  moe_balance_per_layer: bool = True
  moe_z_coef: float = 0.0
  # Rollout routing replay (MoE): the engine records the experts each token
  # went to and the trainer's log-prob passes and update route every token
  # to them (`moe.route`); `rollout/moe_flip_rate` is the share of (token,
  # layer) choices the trainer's own routing makes differently at the
  # step's starting weights (`train/moe_flip_rate`: in the updates).
  routing_replay: bool = False

  def __post_init__(self):
    from rlhf_jax.rl import registry
    positive_ints(self, "ppo_epochs", "num_minibatches", "micro_batches",
                   "dynamic_max_rounds", "stream_parts")
    known = [("policy_loss", "policy_loss"), ("kl_estimator", "kl_estimator"),
             ("aggregation", "aggregation")]
    if self.advantage != "gae":
      known.append(("advantage", "advantage"))
    for key, category in known:
      if getattr(self, key) not in registry.names(category):
        fail(self, key, f"unknown; known: {registry.names(category)}")
    for key in ("rewards", "tracked_rewards"):
      for name in getattr(self, key):
        if name not in registry.names("reward"):
          fail(self, key, f"{name!r} is not a registered reward; known: "
                f"{registry.names('reward')}")
    if len(self.reward_weights) not in (0, len(self.rewards)):
      fail(self, "reward_weights",
            f"has {len(self.reward_weights)} entries for "
            f"{len(self.rewards)} rewards")
    one_of(self, "on_reward_error", ("raise", "zero"))
    one_of(self, "importance_weight", off_policy.WEIGHTINGS)
    if not self.importance_cap > 0:
      fail(self, "importance_cap", "must be > 0")
    if not 0 <= self.importance_floor < self.importance_cap:
      fail(self, "importance_floor",
           f"must be >= 0 and below importance_cap ({self.importance_cap})")
    one_of(self, "sequence_mask", off_policy.SEQUENCE_MASKS)
    band = self.sequence_band
    if not (len(band) == 2 and 0 < band[0] <= 1 <= band[1]):
      fail(self, "sequence_band",
           "must be (lo, hi) with 0 < lo <= 1 <= hi")
    if self.mismatch_alarm_kl < 0:
      fail(self, "mismatch_alarm_kl", "must be >= 0 (0 = off)")
    for key in ("moe_balance_coef", "moe_z_coef"):
      if getattr(self, key) < 0:
        fail(self, key, "must be >= 0 (0 = off)")
    if not isinstance(self.kl_coef, float) or self.kl_coef < 0:
      fail(self, "kl_coef", "must be a float >= 0")
    if self.overlong_buffer < 0:
      fail(self, "overlong_buffer", "must be >= 0")
    for key in ("gamma", "lam"):
      in_range(self, key, 0.0, 1.0)
    if self.value_clip < 0:
      fail(self, "value_clip", "must be >= 0 (0 = off)")
    if not isinstance(self.share_prompt, bool):
      fail(self, "share_prompt", "must be a bool")
    if not isinstance(self.pack_length, int) or self.pack_length < 0:
      fail(self, "pack_length", "must be an int >= 0 (0 = no packing)")

  def kl_config(self):
    """The KL to the reference (`rl/losses.KLConfig`), one object for the
    loss and the advantages."""
    from rlhf_jax.rl.losses import KLConfig
    return KLConfig(self.kl_coef, self.kl_estimator, self.kl_in_loss)

  def advantage_config(self, group_size: int):
    """How this section turns rewards into advantages (`rl/prepare.py`)."""
    from rlhf_jax.rl.prepare import AdvantageConfig
    return AdvantageConfig(
        estimator=self.advantage, group_size=group_size,
        kl=self.kl_config(), gamma=self.gamma, lam=self.lam,
        whiten=self.whiten_advantages, on_policy=off_policy.on_policy(self))

  def policy_loss_config(self, max_len: int):
    """The clipped policy objective of this section (`rl/objectives.py`)."""
    from rlhf_jax.rl.objectives import PolicyLossConfig
    return PolicyLossConfig(
        policy_loss=self.policy_loss, clip_low=self.clip_low,
        clip_high=self.clip_high, clip_c=self.clip_c or None,
        kl=self.kl_config(), aggregation=self.aggregation,
        max_len=max_len, importance_weight=self.importance_weight,
        importance_cap=self.importance_cap,
        importance_floor=self.importance_floor,
        sequence_mask=self.sequence_mask,
        sequence_band=tuple(float(x) for x in self.sequence_band),
        on_policy=off_policy.on_policy(self),
        router=router_loss(self))


@dataclasses.dataclass(frozen=True)
class Train:
  PATH: ClassVar[str] = "train"
  steps: int = 100
  prompts_per_step: int = 8
  checkpoint_every: int = 10
  keep_checkpoints: int = 2

  def __post_init__(self):
    positive_ints(self, "steps", "prompts_per_step", "checkpoint_every",
                   "keep_checkpoints")


@dataclasses.dataclass(frozen=True)
class Eval:
  PATH: ClassVar[str] = "eval"
  every: int = 25
  num_rows: int = 40         # Rows of the greedy eval engine.
  batch_size: int = 200      # Held-out prompts per eval batch.
  num_prompts: int = 0       # jsonl data: held-out records (0 = all).
  # Beside the greedy accuracy: num_samples responses a held-out prompt at
  # `temperature` (the rollout's top_p / top_k), scored by pass@k and
  # maj@k for k = 1, 2, 4, ... and num_samples (scoring/pass_at_k.py);
  # 0 = greedy only. GRPO jobs.
  num_samples: int = 0
  temperature: float = 1.0

  def __post_init__(self):
    positive_ints(self, "every", "num_rows", "batch_size")
    if not isinstance(self.num_samples, int) or self.num_samples < 0:
      fail(self, "num_samples", "must be an int >= 0 (0: greedy only)")
    if self.num_samples and not self.temperature > 0:
      fail(self, "temperature", "must be > 0 with num_samples (greedy "
           "samples would all be equal)")


@dataclasses.dataclass(frozen=True)
class SFT:
  """The warm-start before RL (teacher forcing on task solutions)."""
  PATH: ClassVar[str] = "sft"
  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 0
  grad_clip: float = 1.0
  log_every: int = 25
  checkpoint_every: int = 100  # And on SIGTERM; a rerun resumes the SFT.
  # An MoE policy's router losses (as rl.moe_balance_coef, ...).
  moe_balance_coef: float = 0.0
  moe_balance_per_layer: bool = True
  moe_z_coef: float = 0.0

  def __post_init__(self):
    if self.steps < 0:
      fail(self, "steps", "must be >= 0")
    positive_ints(self, "batch_size", "log_every", "checkpoint_every")
    for key in ("moe_balance_coef", "moe_z_coef"):
      if getattr(self, key) < 0:
        fail(self, key, "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class Critic:
  """PPO's critic: initialised from the reward model, its own optimizer."""
  PATH: ClassVar[str] = "critic"
  init: str = "reward_model"
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)

  def __post_init__(self):
    one_of(self, "init", ("reward_model",))


@dataclasses.dataclass(frozen=True)
class RewardModel:
  """PPO's reward model: the workdir of an `rm` job (its last checkpoint)."""
  PATH: ClassVar[str] = "reward_model"
  workdir: str = ""


@dataclasses.dataclass(frozen=True)
class Agent:
  """Multi-turn, tool-using rollouts (`envs/`): the policy's turns end at
  a tool call or its end of turn; the tool's output is appended and
  decoding goes on (the conversation's KV kept). GRPO on the paged engine."""
  PATH: ClassVar[str] = "agent"
  enabled: bool = False
  tools: tuple = ("calc",)     # Of "calc", "python" (envs/tools.py).
  format: str = "tagged"       # "tagged" (tiny models) | "qwen".
  max_turns: int = 4           # Model turns per episode (calls + 1).
  disable_tools: bool = False  # Ablation: every call answers an error.
  python_timeout_s: float = 5.0
  python_memory_mb: int = 256
  # An agent written against the `openai` client instead of `tools`
  # ("module:function", `envs/agent_env.py`): each episode's agent talks to
  # the rollout's endpoint on 127.0.0.1 (`serving/`), its return value the
  # episode's reward.
  agent_fn: str = ""
  # Or a program run per episode (a command line): the endpoint, its key
  # and the prompt in its environment, its reward its last output line.
  agent_cmd: str = ""
  # agent_fn in this many worker processes (`envs/agent_workers.py`): each
  # imports it once and runs episodes in threads; 0 = the job's threads.
  agent_workers: int = 0
  # Agents running at once (0: one per live sample, the rollout's slots);
  # the others' samples stay parked until one ends.
  max_running: int = 0
  # The alternatives per token an agent may ask for (`top_logprobs`): the
  # engines record this many for every drawn token (0: none; at most 20).
  top_logprobs: int = 0
  chat_template: str = ""         # The endpoint's; "" = the format's own.
  # An agent's longest wait between moves; a program's or a worker
  # agent's whole episode too.
  agent_timeout_s: float = 60.0

  def __post_init__(self):
    positive_ints(self, "max_turns", "python_memory_mb")
    one_of(self, "format", tools.FORMATS)
    if self.agent_fn and self.agent_cmd:
      fail(self, "agent_cmd", "give agent_fn or agent_cmd, not both")
    if self.agent_fn:
      module, _, name = self.agent_fn.partition(":")
      if not module or not name.isidentifier():
        fail(self, "agent_fn", "must be 'module:function'")
    if self.agent_workers < 0:
      fail(self, "agent_workers", "must be >= 0")
    if self.max_running < 0:
      fail(self, "max_running", "must be >= 0 (0: no limit)")
    if self.max_running and not self.through_endpoint:
      fail(self, "max_running", "limits agents through the endpoint "
           "(agent_fn or agent_cmd)")
    if not 0 <= self.top_logprobs <= 20:
      fail(self, "top_logprobs", "must be in [0, 20]")
    if self.top_logprobs and not self.through_endpoint:
      fail(self, "top_logprobs", "is for an agent through the endpoint "
           "(agent_fn or agent_cmd)")
    if self.agent_workers and not self.agent_fn:
      fail(self, "agent_workers", "runs agent_fn; give agent_fn")
    if self.agent_cmd and not shlex.split(self.agent_cmd):
      fail(self, "agent_cmd", "is an empty command line")
    if self.through_endpoint:
      if not self.chat_template and self.format != "tagged":
        fail(self, "chat_template", f"format={self.format!r} has no "
             "built-in endpoint template yet; give one (Jinja)")
    if self.agent_timeout_s <= 0:
      fail(self, "agent_timeout_s", "must be > 0")
    for name in self.tools:
      if name not in tools.TOOL_NAMES:
        fail(self, "tools", f"unknown tool {name!r}; known: "
              f"{list(tools.TOOL_NAMES)}")
    if self.python_timeout_s <= 0:
      fail(self, "python_timeout_s", "must be > 0")

  @property
  def through_endpoint(self) -> bool:
    """Whether an agent (a function or a program) drives the episodes
    through the job's OpenAI-compatible endpoint."""
    return bool(self.agent_fn or self.agent_cmd)


@dataclasses.dataclass(frozen=True)
class Async:
  """Async GRPO (`rollout/asynchronous.py`): rollout on its own devices,
  at most max_staleness versions behind the trainer (0 = synchronous)."""
  PATH: ClassVar[str] = "asynchronous"
  enabled: bool = False
  max_staleness: int = 1          # eta.
  rollout_devices: int = 0        # The rollout part's devices; 0 = half,
                                  # -1 = the cost model's choice.
  switch_after_groups: int = -1   # Finished after batch v, then take v;
                                  # -1 = half a batch.
  in_flight: str = "continue"     # At a switch: "continue" | "restart".

  def __post_init__(self):
    for key, low in (("max_staleness", 0), ("rollout_devices", -1),
                     ("switch_after_groups", -1)):
      if getattr(self, key) < low:
        fail(self, key, f"must be >= {low}")
    one_of(self, "in_flight", ("continue", "restart"))


@dataclasses.dataclass(frozen=True)
class RLJob:
  """The typed sections of a GRPO or PPO job (`from_config`)."""
  seed: int
  model: Model
  mesh: Mesh
  rollout: Rollout
  rl: RL
  optim: OptimConfig
  train: Train
  eval: Eval
  sft: SFT
  critic: Critic | None = None             # PPO only.
  reward_model: RewardModel | None = None  # PPO only.
  lora: Lora = Lora()                      # Off where the config has none.
  agent: Agent = Agent()                   # Off where the config has none.
  asynchronous: Async = Async()            # Off where the config has none.
  logging: Logging = Logging()             # Off where the config has none.
  # The prompts: a section of `data.kind` (`data/sources.KINDS`) and the
  # kind's task (AdditionTask, Sums) or None.
  data: Any = None
  task: Any = None

  @classmethod
  def from_config(cls, config) -> "RLJob":
    """The sections of `config` (a ConfigDict), each validated; the PPO
    sections only where the config has them."""
    sections = {"seed": config.seed}
    for name, kind in _SECTIONS.items():
      if name in config or cls.__dataclass_fields__[name].default is (
          dataclasses.MISSING):
        sections[name] = from_dict(kind, config[name], name)
    sections["data"], sections["task"] = data_sources.sections_of(config)
    return cls(**sections)

  @property
  def shared_prompt_group(self) -> int:
    """G where a group's G samples share one copy of their prompt in the
    training batch (`rl.share_prompt` and G > 1), else 0."""
    G = self.rollout.samples_per_row
    return G if self.rl.share_prompt and G > 1 else 0

  @property
  def grouped_layout(self) -> bool:
    """Whether the training rows are whole groups, [N, P + G*T] (the
    prompt once, `rl/grouped.py`): a shared prompt, rows not packed."""
    return bool(self.shared_prompt_group) and not self.rl.pack_length


_SECTIONS = {"model": Model, "mesh": Mesh, "rollout": Rollout, "rl": RL,
             "optim": OptimConfig, "train": Train, "eval": Eval, "sft": SFT,
             "critic": Critic, "reward_model": RewardModel, "lora": Lora,
             "agent": Agent, "asynchronous": Async, "logging": Logging}
