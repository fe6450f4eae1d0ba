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
  decode_gib_per_device  one engine decode step, 256 live samples (32 rows
                         x G=8) with 4096 tokens of context each (prompt
                         512 shared per row, 3584 of their own), the
                         rollout copy of the weights as the engine holds it
                         (in the compute dtype, bf16; `parallel/colocate`).
                         Also `decode_argument_gib` (weights + KV cache) and
                         `decode_temp_gib`: XLA:CPU upcasts bf16 weights to
                         f32 copies for its dots, which an accelerator does
                         not. `decode_argument_gib_int8`: the arguments
                         with the projections stored int8
                         (`rollout.quantize=int8`).
  move_gib_per_device    a rows-engine consolidation from 8 replicas to 4
                         (`migrate.move_rows`: the rows that change replica
                         sent by collective permutes, the target a view) on the
                         decode state of `decode_gib_per_device`, 4 rows
                         moving; `move_gib_per_device_before`: the gather it
                         replaced (the target's rows replicated on every
                         device, then put on the block), in the same run.
`<preset>.train_gib_per_device_lora`: the same train step of a LoRA policy
(rank 16 on all seven projections, fp32 adapters and their AdamW state,
the frozen base in bf16: it needs no fp32 master; `models/lora.py`).
The baseline, measured in the same run where it compiles: the same train
step with the code paths it replaces (`*_before`: layers in a Python loop,
no remat, T x T attention, the whole [B*T, V] logits); in --quick on
`qwen2.5-0.5b` only (`small.*`), the full run on every preset.

`--smoke` (tests/test_benchmarks_smoke.py): --quick's programs on the
`tiny` preset cut to one layer (also as `small`, its train step compiled
once) with 64 + 192 tokens; numbers meaningless.

Last stdout line: JSON with `<preset>.train_gib_per_device`,
`<preset>.decode_gib_per_device`, `<preset>.compile_s`, ..., and
`small.train_temp_ratio` = temporary bytes before / after.
"""

from __future__ import annotations

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
DECODE_ROWS, DECODE_G = 32, 8
SMALL = "qwen2.5-0.5b"  # The baseline's model (`small.*`).
NUM_LAYERS = None  # None: each preset's own.


def _use_smoke_shapes() -> None:
  """`--smoke`: the same programs on the tiny preset, one layer (a program
  of one layer compiles in ~2/3 the time of two, even scanned), and 64 +
  192 tokens.

  The shapes are module constants the measuring functions read when they
  run; only `--smoke` rebinds them, before anything is measured.
  """
  global PROMPT, RESPONSE, SMALL, NUM_LAYERS
  PROMPT, RESPONSE, SMALL, NUM_LAYERS = 64, 192, "tiny", 1


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


def _train(cfg, learner_of):
  """(train memory, log-prob memory, compile seconds) of `cfg`."""
  import jax
  import jax.numpy as jnp
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(fsdp=_DEVICES)
  layout = mesh_lib.train_layout(mesh)
  graphdef, params = model_lib.abstract_params(cfg)
  learner = learner_of(graphdef, layout)
  params = _abstract(params, layout.param_shardings(params))
  trained, _ = learner.split(params)  # LoRA: the optimizer's share.
  opt = jax.eval_shape(learner.optimizer.init, trained)
  opt = _abstract(opt, learner.opt_shardings(trained, opt))
  from rlhf_jax.rl.learner import TrainState
  state = TrainState(params, opt, jax.ShapeDtypeStruct(
      (), jnp.int32, sharding=layout.replicated()))
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


def _decode(cfg, quant: str = "none"):
  """(decode step memory, compile seconds) on 8 rollout replicas; `quant`:
  the rollout copy's projections stored int8 (`rollout.quantize`)."""
  import jax
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.models import rollout_copy
  from rlhf_jax.parallel import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(fsdp=_DEVICES)
  layout = mesh_lib.rollout_layout(mesh, 1)
  graphdef, params = model_lib.abstract_params(cfg)
  rollout_cfg, graphdef, to_rollout = rollout_copy.rollout_model(
      cfg, graphdef, quant=quant)
  engine = Engine(rollout_cfg, graphdef, layout, num_rows=DECODE_ROWS,
                  samples_per_row=DECODE_G, prefill_buckets=(PROMPT,),
                  sampling=SamplingParams(max_new_tokens=RESPONSE))
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
  state = _abstract(engine.abstract_state(), engine.state_shardings)
  t0 = time.perf_counter()
  step = engine._generate_jit.lower(params, state).compile()  # pylint: disable=protected-access
  return _memory(step), time.perf_counter() - t0


def _move(cfg) -> tuple[dict, dict]:
  """(memory of a consolidation's row move from 8 replicas to 4, of the
  replicated gather it replaced) on the decode state of `_decode`: 8 live
  rows, 4 of them on the dropped replicas (one row from each to a kept
  replica)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rlhf_jax.engine import migrate
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.engine.state import STATE_AXES, DecodeState
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.parallel import submesh

  layout = mesh_lib.rollout_layout(mesh_lib.make_mesh(fsdp=_DEVICES), 1)
  graphdef, _ = model_lib.abstract_params(cfg)
  kw = dict(samples_per_row=DECODE_G, prefill_buckets=(PROMPT,),
            sampling=SamplingParams(max_new_tokens=RESPONSE))
  src = Engine(cfg, graphdef, layout, num_rows=DECODE_ROWS, **kw)
  half = submesh.split(layout, [_DEVICES // 2, _DEVICES // 2])[0]
  dst = Engine(cfg, graphdef, half, num_rows=DECODE_ROWS // 2, **kw)
  state = _abstract(src.abstract_state(), src.state_shardings)
  per = DECODE_ROWS // _DEVICES
  row_map = {r * per: r * per for r in range(4)}  # Kept in place.
  row_map.update({r * per: (r - 4) * per + 1 for r in range(4, 8)})
  shifts, send, recv, valid = migrate._exchange_plan(  # pylint: disable=protected-access
      row_map, _DEVICES, per)
  ours = migrate._exchange_fn(  # pylint: disable=protected-access
      src.state_shardings, layout.mesh, shifts).lower(
          state, send, recv, valid).compile()

  def gather(state, idx):  # Before: the target's rows, replicated.
    return DecodeState(**{
        name: jnp.take(getattr(state, name), idx, axis=axes.index("batch"))
        if "batch" in axes else getattr(state, name)
        for name, axes in STATE_AXES.items()})
  before = jax.jit(gather, out_shardings=layout.replicated()).lower(
      state, jax.ShapeDtypeStruct((dst.num_rows,), np.int32)).compile()
  return _memory(ours), _memory(before)


def _learner_of(cfg):
  from rlhf_jax.models import lora
  from rlhf_jax.rl import objectives
  from rlhf_jax.rl.learner import OptimConfig, make_optimizer

  def build(graphdef, layout):
    return objectives.policy_learner(
        graphdef, layout, objectives.PolicyLossConfig(
            kl_coef=0.01, max_len=RESPONSE),
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
  lora = ours.replace(param_dtype="bfloat16",
                      lora=LoraSpec(16, 32.0, LORA_TARGETS))
  return ours, before, lora


def main(argv):
  del argv
  import jax
  timing.fake_cpu_devices(_DEVICES)
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
    move, move_before = _move(_configs(preset)[0])
    out[f"{preset}.move_gib_per_device"] = round(move["gib"], 2)
    out[f"{preset}.move_gib_per_device_before"] = round(move_before["gib"], 2)
    print(f"  {preset} consolidation move 8 -> 4 replicas: "
          f"{move['gib']:.2f} GiB a device (replicated gather "
          f"{move_before['gib']:.2f}) ({time.perf_counter() - t_start:.0f}s)",
          flush=True)
    if not _QUICK.value:
      measure(preset, preset, before=True)
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
          f" GiB per device ({DECODE_ROWS * DECODE_G} samples x "
          f"{PROMPT + RESPONSE} context)")
    print(f"{preset} consolidation move 8 -> 4 replicas: "
          f"{out[f'{preset}.move_gib_per_device']:.2f} GiB per device "
          f"(replicated gather: "
          f"{out[f'{preset}.move_gib_per_device_before']:.2f})")
  out["quick"] = _QUICK.value
  out["wall_s"] = round(time.perf_counter() - t_start, 1)
  sys.stdout.flush()
  report.emit(out)


if __name__ == "__main__":
  app.run(main)
