"""Decode throughput of prefix rows vs repeating the prompt G times.

  python -m benchmarks.engine [--quick] [--num_layers=4 --embed_dim=256 ...]

For G in {1, 4, 16} and prompt length P in {64, 512}, the same Engine code
decodes S live samples (S = --slots, 16) two ways, in the same run:
  prefix rows: S/G rows x G slots; bulk_insert points a prompt's G samples
    at ONE copy of its KV, read once per step for the whole group;
  repeated:    S rows x 1 slot; the prompt is submitted G times (sample
    indices 0..G-1), each copy its own row with its own prompt KV.
Both variants hold the same slot count, so the only difference is how many
prompt KV rows each step reads. For G=1 both are the same configuration (S
distinct prompts, one sample each): its ratio is the noise floor.

Method: steady-state decode only. Per (variant, G, P) one engine with a
single prompt bucket P (decode reads the whole padded bucket, so one engine
per P). Prompts are prefilled once; each repeat re-inserts them into a fresh
state (untimed) and times each `generate` step with `block_until_ready` while
all samples are live (max_new_tokens - 1 steps: temperature-1 sampling, no
stop tokens). The first `generate` (compile) is excluded. Variants are
interleaved repeat by repeat; tok/s = S / median step time over all steps of
all repeats, and the speedup is the median over repeats of the paired ratio
repeated step time / prefix-rows step time (the machine is shared and noisy).

Next to the measured ratio: the theoretical prompt-KV read ratio
((P + M) G) / (P + G M), M = max_new_tokens (the suffix buffer the engine
reads each step), decode-state bytes (`Engine.decode_state_bytes`), and an
estimated time split: step = rest + c * (KV tokens read per step), solved
from the two variants of a setting (they do the same projections, MLP,
logits and sampling and differ only in prompt KV reads). rest bounds the
speedup: repeated step / rest is what free attention would give. (Timing the
jnp attention alone on the same shapes was tried and dropped: standalone it
ran slower than the whole engine step, so it misattributes time.)

Model (default): ModelConfig.tiny with 4 layers, embed 256, 8 query heads,
2 kv heads of dim 64 (GQA 4:1), MLP 768, vocab 1024: 4.2M params (17 MB
fp32). The stock tiny preset (0.46M params, head dim 32) is dispatch-bound
on CPU at this slot count (a step is ~1-5 ms) and understates KV reads. With
this choice one token's KV over all layers (4 KB fp32) is ~1/4000 of the
weights, vs ~1/80000 for Qwen2.5-0.5B or Llama-3.2-1B in bf16: 16 slots here
weigh KV against weights like a few hundred slots per replica would there,
which is the RL-rollout regime the engine is built for. `--quick` took
149 s on a shared 2-core CPU while getting ~55% of it, most of that time
compiling 6 engines (prefill + insert + generate each); the full run took 323 s.

Runs on the default devices (one CPU device unless told otherwise) with a
rollout layout over one device; `--devices=N` asks JAX for N host devices
and decodes with tensor parallelism N inside one replica.

`--smoke` (tests/test_benchmarks_smoke.py): every setting on a 1-layer
64-wide model, 3 new tokens, one repeat; the numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with `decode_tok_s`
(prefix rows, G=16, P=512) and `prefix_rows_speedup_g16_p512`.
`--calibration_out=PATH` also fits the simulator's CPU decode costs to the
measured steps (`sim/hardware.decode_calibration`) and writes them there;
the simulator reads benchmarks/results/engine_costs_cpu.json.
"""

from __future__ import annotations

import json
import platform
import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import report
from benchmarks import timing
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.sim import hardware
from rlhf_jax.sim import models as sim_models

_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats and new tokens.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Live samples in both variants.")
_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens", 0, "Tokens per sample; 0 means 32 (--quick) or 64.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 0, "Timed repeats per setting; 0 means 3 (--quick) or 7.")
_DEVICES = flags.DEFINE_integer(
    "devices", 0, "If > 0, force this many host devices and decode with "
    "tensor parallelism over them (default: the devices JAX sees, 1 used).")
_CALIBRATION_OUT = flags.DEFINE_string(
    "calibration_out", "", "If set, fit the simulator's CPU profile "
    "(decode_mem_eff, step_overhead_s) to the measured steps and write it "
    "here as JSON; the simulator reads "
    "benchmarks/results/engine_costs_cpu.json (sim/hardware.cpu_profile).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 4, "Model override.")
_EMBED_DIM = flags.DEFINE_integer("embed_dim", 256, "Model override.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 8, "Model override.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "Model override.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Model override.")
_MLP_DIM = flags.DEFINE_integer("mlp_dim", 768, "Model override.")
_VOCAB = flags.DEFINE_integer("vocab_size", 1024, "Model override.")
_SMOKE = flags.DEFINE_bool("smoke", False, "A 1-layer 64-wide model, 3 new "
                           "tokens, one repeat: that it runs (tests).")

GROUPS = (1, 4, 16)
PROMPT_LENGTHS = (64, 512)
HEADLINE = (16, 512)  # (G, P) of `decode_tok_s` and the headline speedup.


def _model_config() -> ModelConfig:
  return ModelConfig.tiny(
      num_layers=_NUM_LAYERS.value, embed_dim=_EMBED_DIM.value,
      num_heads=_NUM_HEADS.value, num_kv_heads=_NUM_KV_HEADS.value,
      head_dim=_HEAD_DIM.value, mlp_dim=_MLP_DIM.value,
      vocab_size=_VOCAB.value)


class _Variant:
  """An engine plus the prefilled prompts of one variant; timed per repeat.

  Row r holds prompt r // copies, copies = rows / num_prompts; with one
  sample per row (repeated), copy j of a prompt is its sample index j.
  """

  def __init__(self, engine: Engine, params, prompts_P, cache: dict):
    self.engine, self.params = engine, params
    rows, per_row = engine.num_rows, engine.samples_per_row
    copies = rows // prompts_P.shape[0]
    self.prefixes = []
    for r in range(rows):
      key = (id(engine), r // copies, (r % copies) * per_row)
      if key not in cache:  # Prefill is untimed setup: reuse across G.
        cache[key] = engine.prefill_multisampling(
            params, prompts_P[key[1]], prompts_P.shape[1], per_row,
            prompt_id=key[1], seed=0, first_sample_index=key[2])
      self.prefixes.append(cache[key])
    self.times: list[list[float]] = []

  def run_once(self, timed: bool = True) -> None:
    """Inserts all prompts into a fresh state and decodes them to the end."""
    eng = self.engine
    state = eng.init_decode_state()  # Also marks every row free.
    for r, prefix in enumerate(self.prefixes):
      state = eng.bulk_insert(prefix, state, eng.slots_of_row[r])
    jax.block_until_ready(state)
    times = []
    # Every sample is live for max_new_tokens - 1 generate steps.
    for _ in range(eng.sampling.max_new_tokens - 1 if timed else 1):
      t0 = time.perf_counter()
      state, result = eng.generate(self.params, state)
      result.data.block_until_ready()
      times.append(time.perf_counter() - t0)
    if timed:
      live = int(np.asarray(state.active).sum())
      if live:
        raise AssertionError(f"{live} samples still live after timing")
      self.times.append(times)

  def median_ms(self, which=slice(None)) -> float:
    return 1e3 * float(np.median(np.concatenate(self.times[which])))


def _layout():
  if _DEVICES.value > 0:
    devices = jax.devices()[:_DEVICES.value]
    mesh = mesh_lib.make_mesh(fsdp=-1, devices=devices)
    return mesh_lib.rollout_layout(mesh, tensor=len(devices))
  mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
  return mesh_lib.rollout_layout(mesh)


def _table(rows, M, S) -> str:
  """Throughput table, then the time split of the same settings."""
  head = (f"{'G':>3} {'P':>4} | {'prefix tok/s':>12} {'repeat tok/s':>12} | "
          f"{'speedup':>7} {'KV-read theory':>14} | {'state MB prefix':>15} "
          f"{'repeat':>6}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['G']:>3} {r['P']:>4} | {r['prefix_tok_s']:>12.0f} "
        f"{r['repeated_tok_s']:>12.0f} | {r['speedup']:>6.2f}x "
        f"{r['kv_read_ratio_theory']:>13.2f}x | "
        f"{r['prefix_state_bytes'] / 2**20:>15.2f} "
        f"{r['repeated_state_bytes'] / 2**20:>6.2f}")
  lines += [
      f"S={S} live samples in both variants, M={M} new tokens (temperature "
      f"1, no stop tokens). tok/s = S / median step time; speedup = median "
      f"over repeats of the paired step-time ratio repeated / prefix; "
      f"KV-read theory = ((P+M)G)/(P+GM). decode_tok_s (JSON) = prefix rows "
      f"at G={HEADLINE[0]}, P={HEADLINE[1]}.", ""]
  head = (f"{'G':>3} {'P':>4} | {'step ms prefix':>14} {'repeat':>6} | "
          f"{'KV-read ms prefix':>17} {'repeat':>6} | {'rest ms':>7} | "
          f"{'bound':>6}")
  lines += [head, "-" * len(head)]
  for r in rows:
    if r["G"] == 1:  # Both variants read the same KV: nothing to solve.
      continue
    lines.append(
        f"{r['G']:>3} {r['P']:>4} | {r['prefix_step_ms']:>14.2f} "
        f"{r['repeated_step_ms']:>6.2f} | {r['kv_ms_prefix']:>17.2f} "
        f"{r['kv_ms_repeated']:>6.2f} | {r['rest_ms']:>7.2f} | " +
        (f"{r['speedup_bound']:>5.1f}x" if r["rest_ms"] > 0 else " noise"))
  lines.append(
      "Time split (estimate): step = rest + c * KV tokens read per step "
      "(prefix rows: (S/G) P + S M; repeated: S P + S M), solved from the two "
      "variants of a setting; rest = projections, MLP, logits, sampling, KV "
      "scatter (the same in both). bound = repeated step / rest: the speedup "
      "if attention KV reads cost nothing (\"noise\": rest <= 0, the fit "
      "failed on noisy timings).")
  return "\n".join(lines)


def _write_calibration(cfg: ModelConfig, steps_by_kv, path: str) -> None:
  """The simulator's CPU decode costs fitted to this run's steps, in the
  bytes the simulator counts for this model (`profile_of`: BF16), which is
  how it will apply them to a live CPU model."""
  profile = sim_models.profile_of(cfg)
  fit = hardware.decode_calibration(profile.weight_bytes,
                                    profile.kv_bytes_per_token,
                                    *zip(*steps_by_kv, strict=True))
  worst = fit.pop("worst_rel_error")
  with open(path, "w") as f:
    json.dump({k: round(v, 6) for k, v in fit.items()}, f, indent=1)
    f.write("\n")
  print(f"CPU profile fit ({len(steps_by_kv)} step times, "
        f"{jax.device_count()} device(s), {platform.machine()}): "
        f"decode_mem_eff {fit['decode_mem_eff']:.3f} (of the profile's "
        f"hbm_bw), step_overhead_s {fit['step_overhead_s'] * 1e3:.2f} ms, "
        f"worst step off by {100 * worst:.0f}% -> {path}")


def main(argv):
  del argv
  t_start = time.perf_counter()
  if _SMOKE.value:  # Every (G, P) setting still runs: the same engines.
    timing.smoke_defaults(
        quick=True, max_new_tokens=3, repeats=1, num_layers=1, embed_dim=64,
        num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
        vocab_size=256)
  if _DEVICES.value > 0:  # Before anything initialises the CPU backend.
    timing.fake_cpu_devices(_DEVICES.value)
  quick = _QUICK.value
  M = _MAX_NEW.value or (32 if quick else 64)
  repeats = _REPEATS.value or (3 if quick else 7)
  S = _SLOTS.value
  if any(S % g for g in GROUPS):
    raise ValueError(f"--slots={S} must be a multiple of every G in {GROUPS}")
  cfg = _model_config()
  layout = _layout()
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=M)
  print(f"model: {cfg.num_params() / 1e6:.2f}M params, L={cfg.num_layers} "
        f"D={cfg.embed_dim} H={cfg.num_heads} N={cfg.num_kv_heads} "
        f"K={cfg.head_dim} F={cfg.mlp_dim} V={cfg.vocab_size}; "
        f"devices used: {layout.mesh.size} of {jax.device_count()} "
        f"({jax.default_backend()}); quick={quick}", flush=True)

  results, steps_by_kv = [], []
  rng = np.random.default_rng(0)
  for P in PROMPT_LENGTHS:
    prompts = rng.integers(0, cfg.vocab_size, (S, P)).astype(np.int32)
    # One engine per samples_per_row: the repeated variant (S rows x 1 slot)
    # is that engine for every G, and prefix rows with G=1 are it too.
    engines = {g: Engine(cfg, graphdef, layout, num_rows=S // g,
                         samples_per_row=g, prefill_buckets=(P,),
                         sampling=sampling) for g in GROUPS}
    prefill_cache = {}
    for G in GROUPS:
      prefix = _Variant(engines[G], params, prompts[:S // G], prefill_cache)
      repeated = _Variant(engines[1], params, prompts[:S // G], prefill_cache)
      prefix.run_once(timed=False)  # Compiles insert and generate once.
      repeated.run_once(timed=False)
      ratios = []
      for _ in range(repeats):  # Interleaved, so drift hits both alike.
        prefix.run_once()
        repeated.run_once()
        ratios.append(np.median(repeated.times[-1]) /
                      np.median(prefix.times[-1]))
      pre_ms, rep_ms = prefix.median_ms(), repeated.median_ms()
      # Linear model step = rest + c * (KV tokens read per step), solved
      # from this setting's two variants (same rest, same suffix reads).
      kv_pre, kv_rep = S // G * P + S * M, S * P + S * M
      c = (rep_ms - pre_ms) / (kv_rep - kv_pre) if G > 1 else float("nan")
      rest = rep_ms - c * kv_rep
      row = dict(
          G=G, P=P, prefix_tok_s=1e3 * S / pre_ms,
          repeated_tok_s=1e3 * S / rep_ms, prefix_step_ms=pre_ms,
          repeated_step_ms=rep_ms, speedup=float(np.median(ratios)),
          kv_read_ratio_theory=(P + M) * G / (P + G * M),
          prefix_state_bytes=engines[G].decode_state_bytes(),
          repeated_state_bytes=engines[1].decode_state_bytes(),
          kv_ms_prefix=c * kv_pre, kv_ms_repeated=c * kv_rep, rest_ms=rest,
          speedup_bound=rep_ms / rest)
      results.append(row)
      # (KV tokens read per step, median step s) for the CPU profile's fit;
      # G=1's two variants are one configuration.
      steps_by_kv.append((kv_rep, rep_ms / 1e3))
      if G > 1:
        steps_by_kv.append((kv_pre, pre_ms / 1e3))
      print(f"  G={G:>2} P={P:>3}: prefix {pre_ms:.2f} ms/step, repeated "
            f"{rep_ms:.2f} ms/step, speedup {row['speedup']:.2f}x "
            f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    del engines, prefill_cache

  print()
  print(_table(results, M, S))
  head = next(r for r in results if (r["G"], r["P"]) == HEADLINE)
  if _CALIBRATION_OUT.value:
    _write_calibration(cfg, steps_by_kv, _CALIBRATION_OUT.value)
  wall = time.perf_counter() - t_start
  print(f"wall time: {wall:.0f}s")
  report.emit(dict(
      decode_tok_s=round(head["prefix_tok_s"], 1),
      decode_tok_s_setting=f"prefix rows, G={HEADLINE[0]}, P={HEADLINE[1]}, "
      f"{S} live samples",
      prefix_rows_speedup_g16_p512=round(head["speedup"], 3),
      repeated_decode_tok_s_g16_p512=round(head["repeated_tok_s"], 1),
      kv_read_ratio_theory_g16_p512=round(head["kv_read_ratio_theory"], 3),
      speedup_bound_g16_p512=round(head["speedup_bound"], 2),
      decode_state_bytes_g16_p512=head["prefix_state_bytes"],
      repeated_state_bytes_g16_p512=head["repeated_state_bytes"],
      speedup_by_g_p={f"g{r['G']}_p{r['P']}": round(r["speedup"], 3)
                      for r in results},
      slots=S, max_new_tokens=M, repeats=repeats, quick=quick,
      params_m=round(cfg.num_params() / 1e6, 2), num_layers=cfg.num_layers,
      devices=layout.mesh.size, machine=platform.machine(),
      wall_s=round(wall, 1)))


if __name__ == "__main__":
  app.run(main)
