"""Decode throughput of a prompt read once per group vs repeated G times.

  python -m benchmarks.engine [--quick] [--num_layers=4 --embed_dim=256 ...]

For G in {1, 4, 16} and prompt length P in {64, 512}, the paged engine
(`Engine` + `Driver`, what jobs decode on) decodes S live samples
(S = --slots, 16) two ways, in the same run:
  shared:   S/G requests of G samples each: one group per prompt, whose
    prompt pages are stored once and read once per decode step for all its
    G samples;
  repeated: the prompt submitted G times as requests of 1 sample (sample
    indices 0..G-1): S groups of one sample, each with its own copy of the
    prompt's pages, read once per sample.
Both variants decode the same S samples (same keys: the same tokens), so
the only difference is how many prompt KV pages each step reads. For G=1
both are the same configuration (S distinct prompts, one sample each): its
ratio is the noise floor.

Method: steady-state decode only. Per P, one engine per samples_per_group
(G for shared; 1 for repeated and for G=1), with one prompt bucket P,
pages of --page_size tokens, the default page pool (room for every
group's prompt and every sample's own tokens up to max_new_tokens: nothing
waits for a slot or a page), `num_groups` = the run's prompts (all
admitted at once; a larger group table lets the jnp attention read up to
its floor of 4 group rows, empty ones included, at G=16) and
`decode_window=1`, so that one `generate` call is one decode step. A
repeat is one `Driver.run` of all requests: admission and prefill are
untimed; every `generate` call runs alone (the device idle before it,
waited for after it) and the max_new_tokens - 1 calls during which every
sample is live are timed (temperature-1 sampling, no stop tokens). A first
run per variant compiles and is excluded. Variants are interleaved repeat
by repeat; tok/s = S / median step time over all steps of all repeats, and
the speedup is the median over repeats of the paired ratio repeated step
time / shared step time (the machine is shared and noisy).

Next to the measured ratio: the theoretical KV-read ratio, repeated /
shared KV tokens a step reads as the engine's jnp attention reads them
(`common_prefix.kv_tokens_read`: the prompt pages of each group once, and
each listed slot's own pages, up to the step's bounds rounded up to
powers of two, `engine/state.step_bounds`): here (S P + S B) / ((S/G) P +
S B), B = ceil((M + 1) / T) T own tokens read per sample (while that is at
most 8 pages), M = max_new_tokens, T the page size; decode-state bytes
(`common_prefix.decode_state_bytes`: the page pool and the tables); and an
estimated time split: step = rest + c * (KV tokens read per step), solved
from the two variants of a setting (they do the same projections, MLP,
logits and sampling and differ only in prompt KV reads). rest bounds the
speedup: repeated step / rest is what free attention would give.

Model (default): ModelConfig.tiny with 4 layers, embed 256, 8 query heads,
2 kv heads of dim 64 (GQA 4:1), MLP 768, vocab 1024: 4.2M params (17 MB
fp32). The stock tiny preset (0.46M params, head dim 32) is dispatch-bound
on CPU at this slot count (a step is ~1-5 ms) and understates KV reads. With
this choice one token's KV over all layers (4 KB fp32) is ~1/4000 of the
weights, vs ~1/80000 for Qwen2.5-0.5B or Llama-3.2-1B in bf16: 16 slots here
weigh KV against weights like a few hundred slots per replica would there,
which is the RL-rollout regime the engine is built for. Wall time: not yet
measured on the paged engine (the rows engine's --quick took 149 s, its
full run 323 s; each repeat now also prefills its prompts, untimed).

Runs on the default devices (one CPU device unless told otherwise) with a
rollout layout over one device; `--devices=N` asks JAX for N host devices
and decodes with tensor parallelism N inside one replica.

`--smoke` (tests/test_benchmarks_smoke.py): every setting on a 1-layer
64-wide model, 3 new tokens, one repeat; the numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with `decode_tok_s`
(shared, G=16, P=512) and `prompt_once_speedup_g16_p512` (called
`prefix_rows_speedup_g16_p512` while this measured the rows engine's
prefix rows, which are gone).
`--calibration_out=PATH` also fits the simulator's CPU decode costs to the
measured steps of the paged engine (`sim/hardware.decode_calibration`, KV
tokens read per step as above) and writes them there; the simulator reads
benchmarks/results/engine_costs_cpu.json.
"""

from __future__ import annotations

import json
import platform
import time

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import common_prefix as paged_runs
from benchmarks import report
from benchmarks import timing
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.samples import Request
from rlhf_jax.sched.cost_model import hardware
from rlhf_jax.sched.cost_model import profiles as sim_models

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
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
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
  """A paged engine, the requests of one variant, and their step times."""

  def __init__(self, engine: Engine, params, requests):
    self.engine, self.params, self.requests = engine, params, requests
    self.times: list[list[float]] = []
    self.kv_read = 0.0
    self.tokens = None

  def run_once(self, timed: bool = True) -> None:
    """One whole rollout; the decode steps with every sample live timed."""
    run = paged_runs.timed_run(Driver(self.engine, self.params),
                               self.requests, each_call=True)
    # Every sample is live for max_new_tokens - 1 decode steps.
    live = self.engine.sampling.max_new_tokens - 1
    if len(run.live(live)) != live:
      raise AssertionError(f"{len(run.live(live))} decode calls of one step "
                           f"while every sample was live, expected {live}")
    self.kv_read, self.tokens = run.kv_read(live), run.tokens
    if timed:
      self.times.append(run.step_s(live))

  def median_ms(self, which=slice(None)) -> float:
    return 1e3 * float(np.median(np.concatenate(self.times[which])))


def _layout():
  if _DEVICES.value > 0:
    devices = jax.devices()[:_DEVICES.value]
    mesh = mesh_lib.make_mesh(fsdp=-1, devices=devices)
    return mesh_lib.rollout_layout(mesh, tensor=len(devices))
  mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
  return mesh_lib.rollout_layout(mesh)


def _table(rows, M, S, T) -> str:
  """Throughput table, then the time split of the same settings."""
  head = (f"{'G':>3} {'P':>4} | {'shared tok/s':>12} {'repeat tok/s':>12} | "
          f"{'speedup':>7} {'KV-read theory':>14} | {'state MB shared':>15} "
          f"{'repeat':>6}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['G']:>3} {r['P']:>4} | {r['shared_tok_s']:>12.0f} "
        f"{r['repeated_tok_s']:>12.0f} | {r['speedup']:>6.2f}x "
        f"{r['kv_read_ratio_theory']:>13.2f}x | "
        f"{r['shared_state_bytes'] / 2**20:>15.2f} "
        f"{r['repeated_state_bytes'] / 2**20:>6.2f}")
  lines += [
      f"S={S} live samples in both variants, M={M} new tokens (temperature "
      f"1, no stop tokens), pages of {T} tokens. tok/s = S / median step "
      f"time; speedup = median over repeats of the paired step-time ratio "
      f"repeated / shared; KV-read theory = repeated / shared KV tokens a "
      f"step reads (the attention's page-rounded reads). decode_tok_s (JSON) "
      f"= shared at G={HEADLINE[0]}, P={HEADLINE[1]}.", ""]
  head = (f"{'G':>3} {'P':>4} | {'KV tok/step shared':>18} {'repeat':>6} | "
          f"{'step ms shared':>14} {'repeat':>6} | "
          f"{'KV-read ms shared':>17} {'repeat':>6} | {'rest ms':>7} | "
          f"{'bound':>6}")
  lines += [head, "-" * len(head)]
  for r in rows:
    if r["G"] == 1:  # Both variants read the same KV: nothing to solve.
      continue
    lines.append(
        f"{r['G']:>3} {r['P']:>4} | {r['kv_shared']:>18.0f} "
        f"{r['kv_repeated']:>6.0f} | {r['shared_step_ms']:>14.2f} "
        f"{r['repeated_step_ms']:>6.2f} | {r['kv_ms_shared']:>17.2f} "
        f"{r['kv_ms_repeated']:>6.2f} | {r['rest_ms']:>7.2f} | " +
        (f"{r['speedup_bound']:>5.1f}x" if r["rest_ms"] > 0 else " noise"))
  lines.append(
      "Time split (estimate): step = rest + c * KV tokens read per step "
      "(the columns KV tok/step), solved from the two variants of a setting; "
      "rest = projections, MLP, logits, sampling, KV writes (the same in "
      "both). bound = repeated step / rest: the speedup if attention KV "
      "reads cost nothing (\"noise\": rest <= 0, the fit failed on noisy "
      "timings).")
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

  T = _PAGE_SIZE.value
  results, steps_by_kv = [], []
  rng = np.random.default_rng(0)
  for P in PROMPT_LENGTHS:
    prompts = rng.integers(0, cfg.vocab_size, (S, P)).astype(np.int32)
    # One engine per samples_per_group: the repeated variant (S groups of
    # one sample) is that engine for every G, and shared with G=1 is it too.
    engines = {g: Engine(
        cfg, graphdef, layout, num_slots=S, samples_per_group=g,
        prefill_buckets=(P,), sampling=sampling, page_size=T,
        num_groups=S // g, prefill_batch=S // g, decode_window=1)
               for g in GROUPS}
    for G in GROUPS:
      n = S // G
      shared = _Variant(engines[G], params, [
          Request(i, prompts[i], G, seed=0) for i in range(n)])
      repeated = _Variant(engines[1], params, [
          Request(i, prompts[i], 1, seed=0, first_sample_index=j)
          for i in range(n) for j in range(G)])
      shared.run_once(timed=False)  # Compiles prefill, insert, start,
      repeated.run_once(timed=False)  # generate.
      ratios = []
      for _ in range(repeats):  # Interleaved, so drift hits both alike.
        shared.run_once()
        repeated.run_once()
        ratios.append(np.median(repeated.times[-1]) /
                      np.median(shared.times[-1]))
      sh_ms, rep_ms = shared.median_ms(), repeated.median_ms()
      # Linear model step = rest + c * (KV tokens read per step), solved
      # from this setting's two variants (same rest, same own-token reads).
      kv_sh, kv_rep = shared.kv_read, repeated.kv_read
      c = ((rep_ms - sh_ms) / (kv_rep - kv_sh) if kv_rep != kv_sh
           else float("nan"))
      rest = rep_ms - c * kv_rep
      row = dict(
          G=G, P=P, shared_tok_s=1e3 * S / sh_ms,
          repeated_tok_s=1e3 * S / rep_ms, shared_step_ms=sh_ms,
          repeated_step_ms=rep_ms, speedup=float(np.median(ratios)),
          kv_shared=kv_sh, kv_repeated=kv_rep,
          kv_read_ratio_theory=kv_rep / kv_sh,
          shared_state_bytes=paged_runs.decode_state_bytes(engines[G]),
          repeated_state_bytes=paged_runs.decode_state_bytes(engines[1]),
          kv_ms_shared=c * kv_sh, kv_ms_repeated=c * kv_rep, rest_ms=rest,
          speedup_bound=rep_ms / rest,
          same_tokens=shared.tokens == repeated.tokens)
      results.append(row)
      # (KV tokens read per step, median step s) for the CPU profile's fit;
      # G=1's two variants are one configuration.
      steps_by_kv.append((kv_rep, rep_ms / 1e3))
      if G > 1:
        steps_by_kv.append((kv_sh, sh_ms / 1e3))
      print(f"  G={G:>2} P={P:>3}: shared {sh_ms:.2f} ms/step, repeated "
            f"{rep_ms:.2f} ms/step, speedup {row['speedup']:.2f}x, same "
            f"tokens: {row['same_tokens']} "
            f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    del engines

  print()
  print(_table(results, M, S, T))
  head = next(r for r in results if (r["G"], r["P"]) == HEADLINE)
  if _CALIBRATION_OUT.value:
    _write_calibration(cfg, steps_by_kv, _CALIBRATION_OUT.value)
  wall = time.perf_counter() - t_start
  print(f"wall time: {wall:.0f}s")
  report.emit(dict(
      decode_tok_s=round(head["shared_tok_s"], 1),
      decode_tok_s_setting=f"paged engine, prompt once per group, "
      f"G={HEADLINE[0]}, P={HEADLINE[1]}, {S} live samples",
      # Was prefix_rows_speedup_g16_p512: the rows engine's prefix rows.
      prompt_once_speedup_g16_p512=round(head["speedup"], 3),
      repeated_decode_tok_s_g16_p512=round(head["repeated_tok_s"], 1),
      kv_read_ratio_theory_g16_p512=round(head["kv_read_ratio_theory"], 3),
      speedup_bound_g16_p512=round(head["speedup_bound"], 2),
      decode_state_bytes_g16_p512=head["shared_state_bytes"],
      repeated_state_bytes_g16_p512=head["repeated_state_bytes"],
      speedup_by_g_p={f"g{r['G']}_p{r['P']}": round(r["speedup"], 3)
                      for r in results},
      same_tokens=all(r["same_tokens"] for r in results),
      engine="paged", page_size=T,
      slots=S, max_new_tokens=M, repeats=repeats, quick=quick,
      params_m=round(cfg.num_params() / 1e6, 2), num_layers=cfg.num_layers,
      devices=layout.mesh.size, machine=platform.machine(),
      wall_s=round(wall, 1)))


if __name__ == "__main__":
  app.run(main)
