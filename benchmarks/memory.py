"""Per-device memory of the train step, log-prob pass and decode step at
7-8B scale, proven by AOT compilation on 8 fake CPU devices (nothing is
allocated).

  python -m benchmarks.memory [--quick] [--presets=qwen2.5-7b,llama3.1-8b]

Each step is `jax.jit(...).lower(abstract args).compile()` on
ShapeDtypeStructs that carry the real shardings (FSDP 8 for training, 8
replicas for the rollout), and `compiled.memory_analysis()` gives bytes per
device of XLA:CPU's allocation (a proxy for an accelerator's):
  train_gib_per_device   argument + output - aliased + temporary bytes of
                         one `Learner` update (forward, backward, AdamW),
                         grouped layout with G=8, 4 sequences x 4096 tokens
                         per device per micro-batch (prompt 512 + response
                         3584), bf16 compute, fp32 master weights and
                         optimizer state, layers scanned, remat "full",
                         chunked attention and log-probs;
  logprob_gib_per_device the forward-only log-prob pass on the same batch
                         (the ADVANTAGES stage runs two);
  decode_gib_per_device  one decode step of the paged engine
                         (`engine/engine.py`, `decode_window=1`), 256 live
                         samples (32 groups x G=8) with 4096 tokens of
                         context each (prompt 512 in its group's pages,
                         read once per group, 3584 in each sample's own
                         pages), the page pool sized for them (the
                         engine's automatic size: pages of 16 tokens, 32 x
                         32 prompt pages + 256 x 225 own pages of up to
                         3584 + 1 tokens), the rollout copy of the weights
                         as the engine holds it (in the compute dtype,
                         bf16; `parallel/colocate`). On CPU the step is the
                         jnp attention, reading dense rows up to its bounds
                         (the accelerators' Pallas kernel walks the page
                         tables instead). Also `decode_argument_gib`
                         (weights + page pool) and `decode_temp_gib`:
                         XLA:CPU upcasts bf16 weights to f32 copies for its
                         dots, which an accelerator does not.
                         `decode_argument_gib_int8`: the arguments with the
                         projections stored int8 (`rollout.quantize=int8`).
  move_gib_per_device    a paged consolidation from 8 replicas to 4
                         (`Driver.consolidate`) on the engine of
                         `decode_gib_per_device`: the state is viewed on
                         the kept replicas (`adopt_state`, no copy), and 4
                         groups of G=8 samples at 3584 tokens, one from
                         each dropped replica, move their pages to kept
                         ones: `gather_kv` reads their prompt and own pages
                         dense and replicated on every device, `insert`
                         and `place` write them into the target's pages.
                         The largest of those programs (compiled here)
                         with the other gathered KV alive beside it;
                         `move_gathered_gib`: that gathered KV (prompt +
                         own pages of the moving groups, on every device).
                         (The rows engine's `move_gib_per_device_before`,
                         the target's rows gathered whole, has no paged
                         counterpart: the kept replicas' state is a view.)
`<preset>.train_gib_per_device_lora`: the same train step of a LoRA policy
(rank 16 on all seven projections, fp32 adapters and their AdamW state,
the frozen base in bf16: it needs no fp32 master; `models/lora.py`).
The baseline, measured in the same run where it compiles: the same train
step with the code paths it replaces (`*_before`: layers in a Python loop,
no remat, T x T attention, the whole [B*T, V] logits); in --quick on
`qwen2.5-0.5b` only (`small.*`), the full run on every preset.

`<preset>.train_gib_per_device_<len>_cp<N>` (first preset): the train step
of the repeated layout with one sequence of <len> tokens (32k, 64k, 128k)
for each data-parallel rank, on 8 devices with `context` = N (1: FSDP 8,
one whole sequence a device; 8: one sequence split over the 8 devices,
`parallel/context.py`), the same remat ("full") and micro-batch (1);
`..._temp_gib_<len>_cp<N>` its temporaries (the activations; the
arguments, params and AdamW state FSDP over all 8 devices in both, do not
change) and `long_temp_ratio_<len>` = temporaries at N = 1 / at N = 8.

`--smoke` (tests/test_benchmarks_smoke.py): --quick's programs on the
`tiny` preset cut to one layer (also as `small`, its train step compiled
once) with 64 + 192 tokens; numbers meaningless.

Last stdout line: JSON with `<preset>.train_gib_per_device`,
`<preset>.decode_gib_per_device`, `<preset>.compile_s`, ..., and
`small.train_temp_ratio` = temporary bytes before / after.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time

from absl import app
from absl import flags

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "One preset; baseline on the small "
                           "model only (< 3 minutes).")
_PRESETS = flags.DEFINE_list("presets", None, "Model presets (default: "
                             "qwen2.5-7b in --quick, + llama3.1-8b).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The tiny preset in every role "
                           "and short sequences: that it compiles (tests).")
_DEVICES = 8
GIB = 2**30
# Per device per micro-batch: 4 sequences of 512 + 3584 tokens, G = 8.
SEQ_PER_DEVICE, PROMPT, RESPONSE, G = 4, 512, 3584, 8
DECODE_GROUPS, DECODE_G = 32, 8
PAGE_SIZE = 16  # Tokens per KV page (`rollout.page_size`'s default).
MOVE_GROUPS = 4  # Groups moving in a consolidation, one per dropped replica.
SMALL = "qwen2.5-0.5b"  # The baseline's model (`small.*`).
NUM_LAYERS = None  # None: each preset's own.
# The MoE model: two hosts of 8 devices, experts split 8 ways inside a host
# (FSDP 2 across the hosts), 8K tokens per device per micro-batch; the
# rollout: 2 replicas of 8 devices, a 64K-token KV pool per device.
MOE_PRESET, MOE_DEVICES, MOE_EXPERT = "qwen3-30b-a3b", 16, 8
MOE_SEQS, MOE_SEQ_LEN, MOE_KV_TOKENS = 2, 4096, 65536
# Long sequences: tokens of one sequence, and the `context` sizes compared.
LONG_LENGTHS, LONG_CONTEXT = (32768, 65536, 131072), (1, 8)


def _use_smoke_shapes() -> None:
  """`--smoke`: the same programs on the tiny preset, one layer (a program
  of one layer compiles in ~2/3 the time of two, even scanned), and 64 +
  192 tokens.

  The shapes are module constants the measuring functions read when they
  run; only `--smoke` rebinds them, before anything is measured.
  """
  global PROMPT, RESPONSE, SMALL, NUM_LAYERS, MOE_PRESET, MOE_SEQ_LEN
  global MOE_KV_TOKENS, LONG_LENGTHS
  PROMPT, RESPONSE, SMALL, NUM_LAYERS = 64, 192, "tiny", 1
  LONG_LENGTHS = (2048,)
  MOE_PRESET, MOE_SEQ_LEN, MOE_KV_TOKENS = "tiny-moe", 64, 1024


def _abstract(tree, shardings):
  import jax
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes
           - m.alias_size_in_bytes + m.temp_size_in_bytes)
  return {"gib": total / GIB, "temp_gib": m.temp_size_in_bytes / GIB,
          "argument_gib": m.argument_size_in_bytes / GIB}


def _dense_mesh():
  """FSDP over the first `_DEVICES` devices (the process has more when
  the MoE model is measured)."""
  import jax
  from rlhf_jax.parallel import mesh as mesh_lib
  return mesh_lib.make_mesh(fsdp=_DEVICES, devices=jax.devices()[:_DEVICES])


def _train_state(learner, layout, params):
  """(params, the learner's TrainState) as ShapeDtypeStructs on their
  shardings, from abstract params."""
  import jax
  import jax.numpy as jnp
  from rlhf_jax.rl.learner import TrainState
  params = _abstract(params, layout.param_shardings(params))
  trained, _ = learner.split(params)  # LoRA: the optimizer's share.
  opt = jax.eval_shape(learner.optimizer.init, trained)
  opt = _abstract(opt, learner.opt_shardings(trained, opt))
  return params, TrainState(params, opt, jax.ShapeDtypeStruct(
      (), jnp.int32, sharding=layout.replicated()))


def _train(cfg, learner_of):
  """(train memory, log-prob memory, compile seconds) of `cfg`."""
  import jax
  import jax.numpy as jnp
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  layout = mesh_lib.train_layout(_dense_mesh())
  graphdef, params = model_lib.abstract_params(cfg)
  learner = learner_of(graphdef, layout)
  params, state = _train_state(learner, layout, params)
  n_groups = SEQ_PER_DEVICE * _DEVICES // G
  shapes = {"prompt_tokens": ((n_groups, PROMPT), jnp.int32),
            "prompt_len": ((n_groups,), jnp.int32),
            "response_tokens": ((n_groups, G, RESPONSE), jnp.int32),
            "loss_mask": ((n_groups, G, RESPONSE), jnp.float32),
            "old_logp": ((n_groups, G, RESPONSE), jnp.float32),
            "ref_logp": ((n_groups, G, RESPONSE), jnp.float32),
            "advantages": ((n_groups, G), jnp.float32)}
  batch = {k: jax.ShapeDtypeStruct(
      s, d, sharding=layout.sharding(("batch",) + (None,) * (len(s) - 1), s))
           for k, (s, d) in shapes.items()}
  t0 = time.perf_counter()
  train = learner._step_jit.lower(state, batch).compile()  # pylint: disable=protected-access
  compile_s = time.perf_counter() - t0
  logp_batch = {k: v for k, v in batch.items()
                if k not in ("old_logp", "ref_logp", "advantages")}
  logp = learner._logprobs_jit.lower(params, logp_batch).compile()  # pylint: disable=protected-access
  return _memory(train), _memory(logp), compile_s


def _long_train(cfg, length: int, context: int) -> tuple[dict, float]:
  """(train memory, compile seconds) of one `length`-token sequence for
  each data-parallel rank on `_DEVICES` devices with `context` of them
  splitting each sequence (the repeated layout)."""
  import jax
  import jax.numpy as jnp
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  layout = mesh_lib.train_layout(mesh_lib.make_mesh(
      fsdp=_DEVICES // context, context=context,
      devices=jax.devices()[:_DEVICES]))
  graphdef, params = model_lib.abstract_params(cfg)
  learner = _learner_of(cfg, max_len=length)(graphdef, layout)
  _, state = _train_state(learner, layout, params)
  B = _DEVICES // context
  shapes = {"tokens": jnp.int32, "positions": jnp.int32,
            "attn_mask": jnp.bool_, "targets": jnp.int32,
            "loss_mask": jnp.float32, "old_logp": jnp.float32,
            "ref_logp": jnp.float32}
  batch = {k: jax.ShapeDtypeStruct(
      (B, length), d, sharding=layout.sharding(("batch", None), (B, length)))
           for k, d in shapes.items()}
  batch["advantages"] = jax.ShapeDtypeStruct(
      (B,), jnp.float32, sharding=layout.sharding(("batch",), (B,)))
  t0 = time.perf_counter()
  compiled = learner._step_jit.lower(state, batch).compile()  # pylint: disable=protected-access
  return _memory(compiled), time.perf_counter() - t0


def _paged_engine(cfg, graphdef, layout, groups=DECODE_GROUPS, **pool):
  """The paged engine of `groups` groups of G=`DECODE_G` slots on `layout`
  (one decode step a call; the pool: automatic, or `pool`'s num_pages)."""
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.sampling import SamplingParams
  return Engine(cfg, graphdef, layout, num_slots=groups * DECODE_G,
                samples_per_group=DECODE_G, num_groups=groups,
                prefill_buckets=(PROMPT,),
                sampling=SamplingParams(max_new_tokens=RESPONSE),
                page_size=PAGE_SIZE, decode_window=1, **pool)


def _abstract_state(engine):
  """The engine's decode state as ShapeDtypeStructs on its shardings."""
  import jax
  from rlhf_jax.engine.state import DecodeState
  return DecodeState(**{
      name: jax.ShapeDtypeStruct(shape, dtype,
                                 sharding=getattr(engine.state_shardings,
                                                  name))
      for name, (_, shape, dtype) in engine._fields().items()})  # pylint: disable=protected-access


def _replicated(engine, shape, dtype):
  import jax
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=engine.layout.replicated())


def _decode(cfg, quant: str = "none"):
  """(decode step memory, compile seconds) on 8 rollout replicas; `quant`:
  the rollout copy's projections stored int8 (`rollout.quantize`)."""
  import functools

  import jax
  import numpy as np
  from rlhf_jax.engine import state as state_lib
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models import rollout_copy
  from rlhf_jax.parallel import mesh as mesh_lib

  layout = mesh_lib.rollout_layout(_dense_mesh(), 1)
  graphdef, params = model_lib.abstract_params(cfg)
  rollout_cfg, graphdef, to_rollout = rollout_copy.rollout_model(
      cfg, graphdef, quant=quant)
  engine = _paged_engine(rollout_cfg, graphdef, layout)
  # The rollout copy as `Colocation` makes it: floating leaves in the
  # compute dtype (the fp32 master weights wait in host memory), or what
  # `models/rollout_copy.py` derives (int8 projections, fp32 scales).
  if to_rollout is None:
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, cfg.compute_jnp_dtype)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, params)
  else:
    params = jax.eval_shape(to_rollout, params)
  params = _abstract(params, engine.param_shardings)
  state = _abstract_state(engine)
  # Every slot live: each replica's 4 groups, a prompt's 32 pages, a
  # sample's own pages up to its cap (`Engine.generate`'s bounds;
  # the Pallas kernel walks the tables and needs none).
  D = engine.replicas
  caps = (engine.num_groups // D, engine.max_prompt_pages,
          engine.max_own_pages)
  bounds = ((0, 0, 0) if engine._walks_tables  # pylint: disable=protected-access
            else state_lib.step_bounds(caps, caps))
  listed = D * state_lib.pow2_at_least(
      engine.num_slots // D, engine.num_slots // D,
      state_lib.STEP_FLOORS[0])
  step = jax.jit(functools.partial(engine._window_fn, bounds=bounds),  # pylint: disable=protected-access
                 **engine._generate_sh)  # pylint: disable=protected-access
  t0 = time.perf_counter()
  compiled = step.lower(
      params, state,
      _replicated(engine, (engine._growth_rows, 3), np.int32),  # pylint: disable=protected-access
      _replicated(engine, (listed,), np.int32),
      _replicated(engine, (), np.int32)).compile()
  return _memory(compiled), time.perf_counter() - t0


def _move(cfg) -> tuple[dict, float]:
  """(memory of a paged consolidation's KV move from 8 replicas to 4: the
  largest of its programs with the other gathered KV alive beside it, GiB
  of that gathered KV per device) on the engine of `_decode`:
  `MOVE_GROUPS` groups of G samples at their longest move."""
  import jax
  import numpy as np
  from rlhf_jax.engine.state import Prefill
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.parallel import submesh

  layout = mesh_lib.rollout_layout(_dense_mesh(), 1)
  graphdef, _ = model_lib.abstract_params(cfg)
  src = _paged_engine(cfg, graphdef, layout)
  half = submesh.split(layout, [_DEVICES // 2, _DEVICES // 2])[0]
  # As `EngineSet.engine(4)`: the same blocks per replica.
  dst = _paged_engine(cfg, graphdef, half, groups=DECODE_GROUPS // 2,
                      num_pages=src.num_pages // 2)
  i32 = np.int32
  X, A = MOVE_GROUPS * DECODE_G, src.max_own_pages
  prompt_rows = _replicated(src, (MOVE_GROUPS, src.max_prompt_pages), i32)
  own_rows = _replicated(src, (X, A), i32)
  state = _abstract_state(src)
  gather = src._gather_jit  # pylint: disable=protected-access
  kv_prompt = jax.eval_shape(gather, state, prompt_rows)
  kv_own = jax.eval_shape(gather, state, own_rows)
  size = lambda tree: sum(x.size * x.dtype.itemsize
                          for x in jax.tree.leaves(tree)) / GIB
  P, O = size(kv_prompt), size(kv_own)  # Replicated: whole on each device.
  on_dst = lambda x, dtype=None: _replicated(dst, x.shape, dtype or x.dtype)
  kv_prompt = [on_dst(x) for x in kv_prompt]
  kv_own = [on_dst(x) for x in kv_own]
  target = _abstract_state(dst)
  B, G = MOVE_GROUPS, DECODE_G
  pre = Prefill(*kv_prompt, on_dst(np.zeros((B, G), i32)),
                on_dst(np.zeros((B, G), np.float32)),
                on_dst(np.zeros((B, G), np.float32)))
  memory = lambda c: _memory(c)["gib"]
  programs = [  # (GiB of the program, GiB of gathered KV alive beside it)
      (memory(gather.lower(state, prompt_rows).compile()), 0.0),
      (memory(gather.lower(state, own_rows).compile()), P),
      (memory(dst._insert_jit.lower(  # pylint: disable=protected-access
          target, pre, on_dst(np.zeros(B, i32)),
          on_dst(np.zeros((B, src.max_prompt_pages), i32)),
          *(on_dst(np.zeros(B, i32)) for _ in range(2)),
          on_dst(np.zeros(B, np.uint32))).compile()), O),
      (memory(dst._place_jit.lower(  # pylint: disable=protected-access
          target, on_dst(np.zeros(X, i32)),
          on_dst(np.zeros((X, dst.max_own_pages), i32)), *kv_own,
          on_dst(np.zeros(X, i32)), on_dst(np.zeros(X, i32))).compile()), P),
  ]
  return {"gib": max(a + b for a, b in programs)}, P + O


@contextlib.contextmanager
def _grouped_matmul_as_a_kernel_holds_it():
  """`jax.lax.ragged_dot` replaced, while a program is traced for its
  memory, by a matmul of the same operands and output ([rows, in] x
  [in, out] -> [rows, out]): the bytes an accelerator's grouped-matmul
  kernel holds. XLA:CPU lowers `ragged_dot` densely, with temporaries of
  groups x rows x out (forward and gradient) that no accelerator holds;
  the difference of the two programs is that term. Only compiled, never
  run: the values would be wrong."""
  import jax
  import jax.numpy as jnp
  real = jax.lax.ragged_dot

  def as_kernel(lhs, rhs, group_sizes, precision=None,
                preferred_element_type=None, group_offset=None):
    del group_sizes, precision, group_offset
    return jnp.einsum("md,df->mf", lhs, rhs[0],
                      preferred_element_type=preferred_element_type)

  jax.lax.ragged_dot = as_kernel
  try:
    yield
  finally:
    jax.lax.ragged_dot = real


def _moe_train(cfg, devices) -> dict:
  """The GRPO train step of an MoE `cfg` on `devices` (FSDP x EP
  `MOE_EXPERT`): repeated layout, `MOE_SEQS` sequences of `MOE_SEQ_LEN`
  tokens per device; compiled as XLA:CPU lowers `ragged_dot` and as a
  grouped-matmul kernel holds it. Returns their memories and the EP."""
  import jax
  import jax.numpy as jnp
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  layout = mesh_lib.train_layout(mesh_lib.make_mesh(
      fsdp=-1, expert=MOE_EXPERT, devices=devices))
  B, T = MOE_SEQS * len(devices), MOE_SEQ_LEN
  shapes = {"tokens": ((B, T), jnp.int32), "positions": ((B, T), jnp.int32),
            "attn_mask": ((B, T), jnp.bool_), "targets": ((B, T), jnp.int32),
            "loss_mask": ((B, T), jnp.float32),
            "old_logp": ((B, T), jnp.float32),
            "ref_logp": ((B, T), jnp.float32),
            "advantages": ((B,), jnp.float32)}
  batch = {k: jax.ShapeDtypeStruct(
      s, d, sharding=layout.sharding(("batch",) + (None,) * (len(s) - 1), s))
           for k, (s, d) in shapes.items()}
  out = {}
  for name, context in (("cpu", contextlib.nullcontext),
                        ("kernel", _grouped_matmul_as_a_kernel_holds_it)):
    graphdef, params = model_lib.abstract_params(cfg)
    learner = _learner_of(cfg)(graphdef, layout)
    _, state = _train_state(learner, layout, params)
    t0 = time.perf_counter()
    with context():
      compiled = learner._step_jit.lower(state, batch).compile()  # pylint: disable=protected-access
    out[name] = {**_memory(compiled),
                 "compile_s": time.perf_counter() - t0}
    # Gone before the next: an equal live learner would lend it its
    # programs, traced with the other `ragged_dot` (`shared_programs`).
    del learner, state, compiled
    gc.collect()
  out["expert_parallel"] = layout.mesh.shape["expert"]
  out["fsdp"] = layout.mesh.shape["fsdp"]
  return out


def _moe_rollout(cfg, devices) -> dict:
  """Bytes per device of the rollout layout (replicas x EP `MOE_EXPERT`):
  the rollout copy of the weights in the compute dtype, each on its real
  sharding, and a KV pool of `MOE_KV_TOKENS` tokens (a replica's pool is
  on each of its devices: attention runs on every device of the
  replica, the experts split over them)."""
  import math
  import jax
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  layout = mesh_lib.rollout_layout(
      mesh_lib.make_mesh(fsdp=-1, devices=devices), expert=MOE_EXPERT)
  _, params = model_lib.abstract_params(cfg)
  shardings = layout.param_shardings(params)
  item = jax.numpy.dtype(cfg.compute_jnp_dtype).itemsize
  weights = sum(math.prod(sh.shard_shape(x.shape)) * item
                for x, sh in zip(jax.tree.leaves(params),
                                 jax.tree.leaves(shardings)))
  kv_heads = layout.shards("kv_heads")
  kv = (MOE_KV_TOKENS * cfg.num_layers * 2 * cfg.num_kv_heads // kv_heads
        * cfg.head_dim * item)
  return {"weights_gib": weights / GIB, "kv_pool_gib": kv / GIB,
          "replicas": layout.mesh.shape["data"],
          "expert_parallel": layout.mesh.shape["expert"]}


def _learner_of(cfg, max_len: int = 0):
  from rlhf_jax.models import lora
  from rlhf_jax.rl import objectives
  from rlhf_jax.rl.losses import KLConfig
  from rlhf_jax.rl.learner import OptimConfig, make_optimizer

  def build(graphdef, layout):
    return objectives.policy_learner(
        graphdef, layout, objectives.PolicyLossConfig(
            kl=KLConfig(0.01), max_len=max_len or RESPONSE),
        make_optimizer(OptimConfig()), micro_batches=1,
        trainable=None if cfg.lora is None else lora.ADAPTERS)
  return build


def _configs(preset: str):
  """(ours, before, LoRA) ModelConfigs: bf16 compute on fp32 master
  weights; LoRA: rank 16 on every projection (fp32 adapters) over a
  frozen bf16 base, which needs no master copy."""
  from rlhf_jax.models.config import LORA_TARGETS, LoraSpec, ModelConfig
  layers = {} if NUM_LAYERS is None else dict(num_layers=NUM_LAYERS)
  cfg = ModelConfig.preset(preset, param_dtype="float32",
                           compute_dtype="bfloat16", **layers)
  ours = cfg.replace(scan_layers=True, remat="full", attention="chunked")
  before = cfg.replace(scan_layers=False, remat="none", attention="reference",
                       logprob_chunks=(0, 0))
  targets = tuple(t for t in LORA_TARGETS  # An MoE's experts take none.
                  if not (cfg.is_moe and t in ("gate", "up", "down")))
  lora = ours.replace(param_dtype="bfloat16",
                      lora=LoraSpec(16, 32.0, targets))
  return ours, before, lora


def main(argv):
  del argv
  import jax
  timing.fake_cpu_devices(MOE_DEVICES)  # The dense presets use 8 of them.
  jax.config.update("jax_platforms", "cpu")
  if _SMOKE.value:
    timing.smoke_defaults(quick=True, presets=["tiny"])
    _use_smoke_shapes()
  t_start = time.perf_counter()
  presets = _PRESETS.value or (["qwen2.5-7b"] if _QUICK.value
                               else ["qwen2.5-7b", "llama3.1-8b"])
  out, rows = {}, []

  def measure(name, preset, before: bool, lora: bool = False):
    ours, base, with_lora = _configs(preset)
    cfg = with_lora if lora else base if before else ours
    train, logp, compile_s = _train(cfg, _learner_of(cfg))
    suffix = "_before" if before else "_lora" if lora else ""
    out[f"{name}.train_gib_per_device{suffix}"] = round(train["gib"], 2)
    out[f"{name}.train_temp_gib{suffix}"] = round(train["temp_gib"], 2)
    out[f"{name}.logprob_gib_per_device{suffix}"] = round(logp["gib"], 2)
    out[f"{name}.compile_s{suffix}"] = round(compile_s, 1)
    path = "before" if before else "lora" if lora else "ours"
    rows.append((name, path, train, logp, compile_s))
    print(f"  {name} {path}: train "
          f"{train['gib']:.2f} GiB (temp {train['temp_gib']:.2f}), "
          f"compile {compile_s:.1f}s ({time.perf_counter() - t_start:.0f}s)",
          flush=True)

  for preset in presets:
    measure(preset, preset, before=False)
    measure(preset, preset, before=False, lora=True)
    decode, decode_s = _decode(_configs(preset)[0])
    out[f"{preset}.decode_gib_per_device"] = round(decode["gib"], 2)
    # Arguments: the bf16 rollout weights and the KV cache. XLA:CPU has no
    # bf16 dot and keeps f32 copies of the stacked weights in temporaries
    # (hoisted out of the layer loop): a CPU artifact, shown apart.
    out[f"{preset}.decode_argument_gib"] = round(decode["argument_gib"], 2)
    out[f"{preset}.decode_temp_gib"] = round(decode["temp_gib"], 2)
    out[f"{preset}.decode_compile_s"] = round(decode_s, 1)
    int8, _ = _decode(_configs(preset)[0], quant="int8")
    out[f"{preset}.decode_argument_gib_int8"] = round(int8["argument_gib"], 2)
    print(f"  {preset} decode: {decode['gib']:.2f} GiB, arguments "
          f"{decode['argument_gib']:.2f} GiB (int8 projections "
          f"{int8['argument_gib']:.2f}) ({time.perf_counter() - t_start:.0f}s)",
          flush=True)
    move, gathered = _move(_configs(preset)[0])
    out[f"{preset}.move_gib_per_device"] = round(move["gib"], 2)
    out[f"{preset}.move_gathered_gib"] = round(gathered, 2)
    print(f"  {preset} consolidation move 8 -> 4 replicas: "
          f"{move['gib']:.2f} GiB a device (gathered KV {gathered:.2f}) "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    if not _QUICK.value:
      measure(preset, preset, before=True)
  preset = presets[0]
  for length in LONG_LENGTHS:
    name = f"{length // 1024}k"
    temps = {}
    for context in LONG_CONTEXT:
      train, compile_s = _long_train(_configs(preset)[0], length, context)
      out[f"{preset}.train_gib_per_device_{name}_cp{context}"] = round(
          train["gib"], 2)
      out[f"{preset}.train_temp_gib_{name}_cp{context}"] = round(
          train["temp_gib"], 2)
      temps[context] = train["temp_gib"]
      print(f"  {preset} {name} tokens a sequence, context {context}: "
            f"train {train['gib']:.2f} GiB (temp {train['temp_gib']:.2f}), "
            f"compile {compile_s:.1f}s ({time.perf_counter() - t_start:.0f}s)",
            flush=True)
    out[f"{preset}.long_temp_ratio_{name}"] = round(
        temps[LONG_CONTEXT[0]] / temps[LONG_CONTEXT[-1]], 2)
  moe_cfg = _configs(MOE_PRESET)[0]
  devices = jax.devices()[:MOE_DEVICES]
  moe_train = _moe_train(moe_cfg, devices)
  moe_rollout = _moe_rollout(moe_cfg, devices)
  kernel, cpu = moe_train["kernel"], moe_train["cpu"]
  out.update({
      # The gate's figure: a grouped matmul as an accelerator's kernel
      # holds it; XLA:CPU's dense lowering of ragged_dot apart.
      f"{MOE_PRESET}.train_gib_per_device": round(kernel["gib"], 2),
      f"{MOE_PRESET}.train_temp_gib": round(kernel["temp_gib"], 2),
      f"{MOE_PRESET}.train_argument_gib": round(kernel["argument_gib"], 2),
      f"{MOE_PRESET}.train_gib_per_device_cpu_ragged_dot": round(
          cpu["gib"], 2),
      f"{MOE_PRESET}.ragged_dot_dense_cpu_gib": round(
          cpu["gib"] - kernel["gib"], 2),
      f"{MOE_PRESET}.compile_s": round(kernel["compile_s"], 1),
      f"{MOE_PRESET}.devices": len(devices),
      f"{MOE_PRESET}.expert_parallel": moe_train["expert_parallel"],
      f"{MOE_PRESET}.fsdp": moe_train["fsdp"],
      f"{MOE_PRESET}.tokens_per_device": MOE_SEQS * MOE_SEQ_LEN,
      f"{MOE_PRESET}.rollout_weights_gib": round(
          moe_rollout["weights_gib"], 2),
      f"{MOE_PRESET}.rollout_kv_pool_gib": round(
          moe_rollout["kv_pool_gib"], 2),
      f"{MOE_PRESET}.rollout_expert_parallel": moe_rollout["expert_parallel"],
      f"{MOE_PRESET}.rollout_replicas": moe_rollout["replicas"],
  })
  print(f"  {MOE_PRESET}: train {kernel['gib']:.2f} GiB a device "
        f"({cpu['gib']:.2f} with XLA:CPU's dense ragged_dot), rollout "
        f"weights {moe_rollout['weights_gib']:.2f} + KV pool "
        f"{moe_rollout['kv_pool_gib']:.2f} GiB "
        f"({time.perf_counter() - t_start:.0f}s)", flush=True)
  for before in (False, True):  # The baseline on a model both compile for.
    if not before and SMALL in presets:  # Measured above (--smoke: tiny).
      out.update({f"small.{k}": out[f"{SMALL}.{k}"] for k in (
          "train_gib_per_device", "train_temp_gib", "logprob_gib_per_device",
          "compile_s")})
      rows.append(("small",) + next(r for r in rows if r[:2] == (
          SMALL, "ours"))[1:])
    else:
      measure("small", SMALL, before=before)
  out["small.preset"] = SMALL
  out["small.train_temp_ratio"] = round(
      out["small.train_temp_gib_before"] / out["small.train_temp_gib"], 2)

  print(f"\n{_DEVICES} fake CPU devices, FSDP {_DEVICES}; grouped G={G}, "
        f"{SEQ_PER_DEVICE} x ({PROMPT}+{RESPONSE}) tokens per device per "
        "micro-batch; bf16 compute, fp32 master weights and AdamW state")
  head = (f"{'model':<14}{'path':<8}{'train GiB':>10}{'temp GiB':>10}"
          f"{'logp GiB':>10}{'compile s':>11}")
  print(head)
  print("-" * len(head))
  for name, path, train, logp, compile_s in rows:
    print(f"{name:<14}{path:<8}{train['gib']:>10.2f}{train['temp_gib']:>10.2f}"
          f"{logp['gib']:>10.2f}{compile_s:>11.1f}")
  for preset in presets:
    print(f"{preset} decode step: {out[f'{preset}.decode_gib_per_device']:.2f}"
          f" GiB per device ({DECODE_GROUPS * DECODE_G} samples x "
          f"{PROMPT + RESPONSE} context, paged)")
    print(f"{preset} consolidation move 8 -> 4 replicas: "
          f"{out[f'{preset}.move_gib_per_device']:.2f} GiB per device "
          f"({MOVE_GROUPS} groups moving; their KV gathered on every "
          f"device: {out[f'{preset}.move_gathered_gib']:.2f})")
  print(f"{MOE_PRESET} on {len(devices)} devices (FSDP "
        f"{moe_train['fsdp']} x EP {moe_train['expert_parallel']}), "
        f"repeated layout, {MOE_SEQS} x {MOE_SEQ_LEN} tokens per device: "
        f"train step {kernel['gib']:.2f} GiB per device with the grouped "
        f"matmul as a kernel holds it (XLA:CPU's dense ragged_dot: "
        f"{cpu['gib']:.2f}); rollout ({moe_rollout['replicas']} replicas x "
        f"EP {moe_rollout['expert_parallel']}): weights "
        f"{moe_rollout['weights_gib']:.2f} GiB + a {MOE_KV_TOKENS}-token KV "
        f"pool {moe_rollout['kv_pool_gib']:.2f} GiB per device")
  out["quick"] = _QUICK.value
  out["wall_s"] = round(time.perf_counter() - t_start, 1)
  sys.stdout.flush()
  report.emit(out)


if __name__ == "__main__":
  app.run(main)
