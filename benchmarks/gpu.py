"""The mission on one accelerator ([gpu]): decode, train step, repartition.

  python -m benchmarks.gpu [--quick] [--parts=decode,train,repartition]
      [--model=qwen2.5-1.5b --samples=16 --prompt_len=2048 --new_tokens=512]
  bash benchmarks/gpu_run.sh DIR   # on the GPU machine: tests, then parts

Random weights (speed does not depend on their values) and forced response
lengths (no stop tokens: every sample decodes exactly --new_tokens).

decode: the paged engine on one device, bf16 weights and KV. N prompts x
  G samples (S = N G live slots), all admitted at once, each decoding
  --new_tokens, two ways in the same run and with the same sample keys:
    shared:   N groups of G; a prompt's KV is stored and read once per step
              for its G samples (the engine's prompt-once property);
    repeated: N G groups of 1 (each prompt submitted G times, sample
              indices 0..G-1): the baseline that re-reads the prompt.
  For each attention implementation in --impls ("pallas": the Triton kernel
  on GPU; "xla": the jnp reference). Every driver step is timed (the driver
  pipelines: the host prepares step t+1 while the device runs step t);
  steps that traced a new shape (compiles) are left out and replaced by the
  median step in the totals. decode tok/s = S (new_tokens - 1) / decode
  seconds. One decode step in SAMPLE_EVERY runs alone (device idle before,
  waited for after): the device's step time. Bytes a step must read: the
  weights once plus each KV byte it attends to once (shared: N P + S t
  tokens at step t; repeated: S P + S t); TB/s = those bytes / step time;
  of HBM = device TB/s / --hbm_tb_s. --profile: one mid-decode step runs
  under `jax.profiler.trace`, and its device kernels are summed by name
  (`kernel_times`): where a step's time goes.
train: one GRPO policy update (`objectives.policy_learner`, clipped ratio +
  k3 KL, AdamW) on B sequences of T tokens (repeated layout), fp32 master
  weights, bf16 compute, layers scanned, --remat, the backend's flash
  attention ("auto": cuDNN on GPU), chunked log-probs. tokens/s, model FLOPs
  (6 params tokens + 6 L H K T^2 B for causal attention, no remat
  recompute) / --peak_tflops = MFU, and the device's peak bytes in use.
  Also the forward-only log-prob pass (scoring) on the same batch.
repartition: `Colocation.to_rollout` / `to_train` of the fp32 policy on
  one device (a bf16 rollout copy, the master parked in host memory and
  back), vs the same moves as one-shot calls (a jitted cast of the whole
  tree, one `jax.device_put` of it to host memory and back).

Timings are medians over --repeats. --quick (CPU, < 3 minutes): a 4-layer
256-wide model, 4 prompts x G=4, prompt 128, 32 new tokens, T=256, xla
attention only; --smoke (tests/test_benchmarks_smoke.py): --quick with 1
layer, prompt 32, 16 new tokens, T=64, one repeat. Prints a table per part,
then one JSON line (last stdout line): `prompt_once_decode_speedup`
(repeated / shared decode seconds, the first impl), `decode_hbm_fraction`
(shared, device time), `train_mfu`, `repartition_vs_one_shot` (one-shot /
ours, round trip), and every figure under its part's key (`decode`,
`train`, `repartition`). H100 results: docs/results.md ("GPU")
and benchmarks/results/gpu_h100.json.
"""

from __future__ import annotations

import collections
import gc
import glob
import gzip
import json
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import report

_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes for a CPU check.")
_PARTS = flags.DEFINE_list("parts", ["decode", "train", "repartition"],
                           "Which measurements to run, in order.")
_MODEL = flags.DEFINE_string("model", "qwen2.5-1.5b", "Model preset.")
_LAYERS = flags.DEFINE_integer("num_layers", 0, "Override (0: the preset's).")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Decode: N prompts.")
_G = flags.DEFINE_integer("samples", 16, "Decode: G samples per prompt.")
_P = flags.DEFINE_integer("prompt_len", 2048, "Decode: prompt tokens.")
_M = flags.DEFINE_integer("new_tokens", 512, "Decode: tokens per sample.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Decode: tokens per page.")
_PREFILL_BATCH = flags.DEFINE_integer("prefill_batch", 8,
                                      "Decode: prompts per prefill call.")
_IMPLS = flags.DEFINE_list("impls", None, "Decode attention: pallas, xla "
                           "(default: both on GPU/TPU, xla on CPU).")
_VARIANTS = flags.DEFINE_list("variants", ["shared", "repeated"],
                              "Decode variants.")
_DECODE_SCAN = flags.DEFINE_bool(
    "decode_scan_layers", True, "Decode: layers under lax.scan (False: "
    "unrolled, one kernel sequence per layer without a device loop).")
_B = flags.DEFINE_integer("batch", 8, "Train: sequences per update.")
_T = flags.DEFINE_integer("seq_len", 4096, "Train: tokens per sequence.")
_MICRO = flags.DEFINE_integer("micro_batches", 2, "Train: micro-batches.")
_REMAT = flags.DEFINE_string("remat", "full", "Train: none | full | dots.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (train, "
                                "repartition).")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "Dense bf16 peak; 0: "
                                  "from the device kind (H100/H200 989).")
_HBM = flags.DEFINE_float("hbm_tb_s", 0.0, "HBM bandwidth; 0: from the "
                          "device kind (H100 3.35, H200 4.8).")
_SMOKE = flags.DEFINE_bool("smoke", False, "--quick on a 1-layer model, "
                           "shorter sequences, one repeat: that it runs "
                           "(tests/test_benchmarks_smoke.py).")
_PROFILE = flags.DEFINE_bool("profile", True, "Decode: a profiler trace of "
                             "one mid-decode step run alone, summed per "
                             "device kernel (where the step's time goes).")

# Datasheet peaks (dense bf16 TFLOP/s, HBM TB/s) by device kind substring.
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8)}


def _peaks():
  kind = jax.devices()[0].device_kind
  flops, bw = next((v for k, v in PEAKS.items() if k in kind), (0.0, 0.0))
  return _PEAK_TFLOPS.value or flops, _HBM.value or bw


def _model_cfg(**kw):
  from rlhf_jax.models.config import ModelConfig
  if _QUICK.value:
    cfg = ModelConfig.tiny(num_layers=4, embed_dim=256, num_heads=8,
                           num_kv_heads=2, head_dim=32, mlp_dim=768,
                           vocab_size=4096)
  else:
    cfg = ModelConfig.preset(_MODEL.value)
  if _LAYERS.value:
    cfg = cfg.replace(num_layers=_LAYERS.value)
  return cfg.replace(**kw)


def _one_device_mesh():
  from rlhf_jax.parallel import mesh as mesh_lib
  return mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])


def _peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# ------------------------------------------------------------------ decode
SAMPLE_EVERY = 8  # Decode steps timed alone on the device: one in 8.


def _decode_case(cfg, graphdef, params, layout, prompts_NxP, *, impl: str,
                 shared: bool) -> dict:
  """One paged run of N prompts x G samples; per-step times."""
  from rlhf_jax.samples import Request
  from rlhf_jax.engine.engine import Engine
  from rlhf_jax.engine.driver import Driver
  from rlhf_jax.engine.sampling import SamplingParams

  N, P = prompts_NxP.shape
  G, M, T = _G.value, _M.value, _PAGE.value
  S = N * G
  groups = N if shared else S
  num_pages = groups * math.ceil(P / T) + S * (math.ceil((M + 2) / T) + 1)
  engine = Engine(
      cfg, graphdef, layout, num_slots=S, samples_per_group=G if shared else 1,
      prefill_buckets=(P,), sampling=SamplingParams(temperature=1.0,
                                                    max_new_tokens=M),
      page_size=T, num_pages=num_pages, num_groups=groups,
      prefill_batch=_PREFILL_BATCH.value, attention_impl=impl,
      decode_window=1)  # Timed per decode step.
  if shared:
    requests = [Request(i, prompts_NxP[i], G, seed=1) for i in range(N)]
  else:
    requests = [Request(i, prompts_NxP[i], 1, seed=1, first_sample_index=j)
                for i in range(N) for j in range(G)]
  driver = Driver(engine, params)
  driver.start(requests, admission="static")  # Everything prefilled at once.
  steps, samples, device_s, alone_steps, profile = [], [], [], set(), {}
  # Every SAMPLE_EVERY-th decode step runs alone: the device idle before it,
  # waited for after it; its time is the device's step time (plus one
  # dispatch). Those steps (and the profiled one) are left out of the
  # pipelined step times.
  generate = engine.generate

  def sampled_generate(params, state, *args, **kwargs):
    if len(steps) % SAMPLE_EVERY != SAMPLE_EVERY - 1:
      return generate(params, state, *args, **kwargs)
    alone_steps.add(len(steps))
    jax.block_until_ready(state)
    if _PROFILE.value and not profile and len(steps) >= M // 2:
      # A profiler that fails must not cost the case's timings.
      with tempfile.TemporaryDirectory() as log_dir:
        try:
          jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
          tracing = True
        except Exception as e:  # pylint: disable=broad-except
          profile.update(error=f"start: {type(e).__name__}: {e}"[:300])
          tracing = False
        out = jax.block_until_ready(generate(params, state, *args,
                                             **kwargs))
        try:
          if tracing:
            jax.profiler.stop_trace()
            profile.update(kernel_times(log_dir))
        except Exception as e:  # pylint: disable=broad-except
          profile.update(error=f"{type(e).__name__}: {e}"[:300])
        profile.update(step=len(steps))
        if "error" in profile:
          print(f"  profile failed: {profile['error']}", flush=True)
      return out
    t0 = time.perf_counter()
    out = jax.block_until_ready(generate(params, state, *args, **kwargs))
    device_s.append((len(steps), time.perf_counter() - t0))
    return out

  engine.generate = sampled_generate
  t_run = time.perf_counter()
  while driver.busy:
    traces = sum(engine.trace_counts.values())
    t0 = time.perf_counter()
    samples += driver.step()
    dt = time.perf_counter() - t0
    steps.append((dt, sum(engine.trace_counts.values()) != traces,
                  len(steps) in alone_steps))
  wall = time.perf_counter() - t_run
  if len(samples) != S or any(len(s.tokens) != M for s in samples):
    raise AssertionError(f"expected {S} samples of {M} tokens")
  # Step 0 prefills every prompt (and compiles); the rest decode.
  prefill_s = steps[0][0]
  decode = steps[1:]
  compiled = {i for i, (_, c, _) in enumerate(steps) if c}
  clean = [dt for dt, c, alone in decode if not c and not alone]
  med = statistics.median(clean)
  decode_s = sum(dt if not c and not alone else med
                 for dt, c, alone in decode)
  alone = [(i, dt) for i, dt in device_s if i not in compiled and i > 0]
  token_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim *
                 jnp.dtype(cfg.compute_jnp_dtype).itemsize)
  weight_bytes = sum(x.size * x.dtype.itemsize
                     for x in jax.tree.leaves(params))
  # KV a step attends to (all S samples live, in lock step): the prompts
  # (once per group) and each sample's own tokens so far.
  prompt_tokens = (N if shared else S) * P
  read = lambda i: weight_bytes + token_bytes * (  # noqa: E731
      prompt_tokens + S * i)  # Decode step i (1-based) attends i own tokens.
  bw = [read(i + 1) / dt for i, (dt, c, a) in enumerate(decode)
        if not c and not a]
  device_bw = [read(i) / dt for i, dt in alone]
  return dict(
      impl=impl, variant="shared" if shared else "repeated", slots=S,
      decode_s=decode_s, prefill_s=prefill_s, wall_s=wall,
      compile_steps=len(compiled - {0}),
      median_step_ms=1e3 * med, decode_tok_s=S * len(decode) / decode_s,
      device_step_ms=1e3 * statistics.median(dt for _, dt in alone),
      device_steps_timed=len(alone),
      mean_bytes_per_step=float(np.mean([read(i + 1)
                                         for i in range(len(decode))])),
      achieved_tb_s=float(np.median(bw)) / 1e12,
      device_tb_s=float(np.median(device_bw)) / 1e12,
      kv_bytes_reserved=engine.pool_bytes, weight_bytes=weight_bytes,
      peak_bytes=_peak_bytes(), profile=profile,
      tokens={s.key: s.tokens for s in samples})


def kernel_times(log_dir: str, top: int = 12) -> dict:
  """Device time by kernel name from the Perfetto trace `jax.profiler`
  wrote under `log_dir`: the events of the device processes' stream
  threads (raw kernels; the derived op and module lines would count them
  again), or of every process where there is no device (CPU)."""
  path = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                   recursive=True)[0]
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
  devices = {p for p, n in procs.items() if n.startswith("/device:")}
  streams = {k for k, n in threads.items()
             if k[0] in devices and "stream" in n.lower()}
  totals, launches = collections.Counter(), 0
  for e in events:
    if e.get("ph") != "X":
      continue
    key = (e.get("pid"), e.get("tid"))
    if (key in streams if streams else
        (e.get("pid") in devices if devices else True)):
      totals[e["name"]] += e.get("dur", 0.0) / 1e3  # us -> ms
      launches += 1
  return dict(kernel_ms=sum(totals.values()), kernels=launches,
              top=[(name, round(ms, 4)) for name, ms in
                   totals.most_common(top)],
              source="device streams" if streams else
              "device" if devices else "host")


def decode_part() -> dict:
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib

  _, hbm = _peaks()
  cfg = _model_cfg(param_dtype="bfloat16", compute_dtype="bfloat16",
                   scan_layers=_DECODE_SCAN.value)
  layout = mesh_lib.rollout_layout(_one_device_mesh())
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  impls = _IMPLS.value or (["xla"] if jax.default_backend() == "cpu"
                           else ["pallas", "xla"])
  N, P = _PROMPTS.value, _P.value
  prompts = np.random.default_rng(0).integers(
      0, cfg.vocab_size, (N, P)).astype(np.int32)
  print(f"decode: {cfg.num_params() / 1e9:.2f}B params bf16, {N} prompts x "
        f"G={_G.value}, prompt {P}, {_M.value} new tokens, pages of "
        f"{_PAGE.value}; impls {impls}", flush=True)
  rows, out = [], {}
  for impl in impls:
    for variant in _VARIANTS.value:
      t0 = time.perf_counter()
      r = _decode_case(cfg, graphdef, params, layout, prompts, impl=impl,
                       shared=variant == "shared")
      r["hbm_fraction"] = r["achieved_tb_s"] / hbm if hbm else None
      r["device_hbm_fraction"] = r["device_tb_s"] / hbm if hbm else None
      print(f"  {impl} {variant}: {r['decode_tok_s']:.0f} tok/s, "
            f"{r['median_step_ms']:.2f} ms/step ({r['device_step_ms']:.2f} "
            f"on the device alone), {r['achieved_tb_s']:.2f} TB/s, "
            f"{r['compile_steps']} compile steps "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
      if r["profile"] and "error" not in r["profile"]:
        prof = r["profile"]
        print(f"  profiled step {prof['step']}: {prof['kernel_ms']:.2f} ms "
              f"of {prof['source']} time in {prof['kernels']} kernels; "
              "top: " + "; ".join(
                  f"{n[:60]} {ms:.2f}" for n, ms in prof["top"][:8]),
              flush=True)
      print("  case " + json.dumps({k: v for k, v in r.items()
                                     if k != "tokens"}), flush=True)
      rows.append(r)
      gc.collect()  # The case's engine and KV pool go before the next.
  by = {(r["impl"], r["variant"]): r for r in rows}
  print(f"\n{'impl':<7}{'variant':<10}{'tok/s':>9}{'ms/step':>9}"
        f"{'device':>8}{'GB/step':>9}{'TB/s':>7}{'device':>8}{'of HBM':>8}"
        f"{'step 0 s':>9}{'KV GiB':>8}")
  for r in rows:
    frac = (f"{r['device_hbm_fraction']:.0%}" if r["device_hbm_fraction"]
            else "n/a")
    print(f"{r['impl']:<7}{r['variant']:<10}{r['decode_tok_s']:>9.0f}"
          f"{r['median_step_ms']:>9.2f}{r['device_step_ms']:>8.2f}"
          f"{r['mean_bytes_per_step'] / 1e9:>9.2f}"
          f"{r['achieved_tb_s']:>7.2f}{r['device_tb_s']:>8.2f}{frac:>8}"
          f"{r['prefill_s']:>9.2f}{r['kv_bytes_reserved'] / 2**30:>8.2f}")
  print("ms/step: pipelined driver steps (host and device overlap); device: "
        f"one step in {SAMPLE_EVERY} run alone; TB/s: the bytes a step must "
        "read (weights once, each attended KV byte once) over each time; "
        "of HBM: device TB/s over the datasheet's; step 0: prefill of every "
        "prompt and the compiles.")
  for impl in impls:
    a, b = by.get((impl, "shared")), by.get((impl, "repeated"))
    if a and b:
      keys = a["tokens"].keys()
      same = np.mean([a["tokens"][k] == b["tokens"][k] for k in keys])
      out[f"{impl}.prompt_once_speedup"] = b["decode_s"] / a["decode_s"]
      out[f"{impl}.same_samples_fraction"] = float(same)
      print(f"{impl}: prompt once {out[f'{impl}.prompt_once_speedup']:.2f}x "
            f"faster than repeated; {same:.0%} of samples identical (bf16 "
            f"sums in another order can flip a sampled token)")
  for r in rows:
    r.pop("tokens")
    out[f"{r['impl']}.{r['variant']}"] = r
  out["setting"] = dict(model=_MODEL.value if not _QUICK.value else "quick",
                        scan_layers=cfg.scan_layers,
                        params=cfg.num_params(), prompts=N, G=_G.value,
                        prompt_len=P, new_tokens=_M.value,
                        page_size=_PAGE.value)
  return out


# ------------------------------------------------------------------- train
def _train_batch(cfg, B, T, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
  prompt = T // 8
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, prompt - 1:T - 1] = 1.0  # Response tokens (targets).
  return dict(
      tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
      attn_mask=np.ones((B, T), bool),
      targets=np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], 1),
      loss_mask=loss_mask,
      old_logp=-rng.random((B, T)).astype(np.float32),
      ref_logp=-rng.random((B, T)).astype(np.float32),
      advantages=rng.normal(size=B).astype(np.float32))


def _timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def train_part() -> dict:
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.rl import objectives
  from rlhf_jax.rl.losses import KLConfig
  from rlhf_jax.rl.learner import OptimConfig, make_optimizer

  peak_tflops, _ = _peaks()
  B, T = ((2, 64) if _SMOKE.value else (4, 256) if _QUICK.value
          else (_B.value, _T.value))
  cfg = _model_cfg(param_dtype="float32", compute_dtype="bfloat16",
                   scan_layers=True, remat=_REMAT.value, attention="auto")
  layout = mesh_lib.train_layout(_one_device_mesh())
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  learner = objectives.policy_learner(
      graphdef, layout, objectives.PolicyLossConfig(kl=KLConfig(0.01)),
      make_optimizer(OptimConfig()), micro_batches=_MICRO.value)
  state = learner.init_state(params)
  batch = learner.put_batch(_train_batch(cfg, B, T))
  print(f"train: {cfg.num_params() / 1e9:.2f}B params, {B} x {T} tokens, "
        f"{_MICRO.value} micro-batches, remat={cfg.remat}", flush=True)
  t0 = time.perf_counter()
  state, metrics = learner.step(state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  holder = {"state": state}

  def one_step():
    holder["state"], m = learner.step(holder["state"], batch)
    return m["loss"]

  step_s, times = _timed(one_step, _REPEATS.value)
  peak = _peak_bytes()
  logp_fn = lambda: learner.logprobs(holder["state"].params, batch)  # noqa: E731
  jax.block_until_ready(logp_fn())  # Compile.
  logp_s, _ = _timed(logp_fn, _REPEATS.value)
  tokens = B * T
  attn = 6 * B * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T
  flops = 6 * cfg.num_params() * tokens + attn
  fwd_flops = flops / 3
  out = dict(
      params=cfg.num_params(), batch=B, seq_len=T, remat=cfg.remat,
      micro_batches=_MICRO.value, step_s=step_s, step_times=times,
      compile_s=compile_s, tokens_per_s=tokens / step_s,
      model_tflop_per_step=flops / 1e12,
      mfu=flops / step_s / (peak_tflops * 1e12) if peak_tflops else None,
      peak_bytes=peak, logprob_s=logp_s,
      logprob_tokens_per_s=tokens / logp_s,
      logprob_mfu=(fwd_flops / logp_s / (peak_tflops * 1e12)
                   if peak_tflops else None),
      loss=float(metrics["loss"]))
  mfu = f"{out['mfu']:.1%}" if out["mfu"] else "n/a"
  lmfu = f"{out['logprob_mfu']:.1%}" if out["logprob_mfu"] else "n/a"
  print(f"\n{'pass':<10}{'seconds':>9}{'tokens/s':>10}{'MFU':>7}")
  print(f"{'update':<10}{step_s:>9.3f}{out['tokens_per_s']:>10.0f}{mfu:>7}")
  print(f"{'log-prob':<10}{logp_s:>9.3f}{out['logprob_tokens_per_s']:>10.0f}"
        f"{lmfu:>7}")
  if peak:
    print(f"peak device memory {peak / 2**30:.1f} GiB; compile {compile_s:.0f}"
          " s")
  return out


# ------------------------------------------------------------- repartition
def repartition_part() -> dict:
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import colocate
  from rlhf_jax.parallel import mesh as mesh_lib

  cfg = _model_cfg(param_dtype="float32", compute_dtype="bfloat16")
  mesh = _one_device_mesh()
  train, rollout = mesh_lib.train_layout(mesh), mesh_lib.rollout_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, train)
  co = colocate.Colocation(train, rollout, params, offload=True,
                           rollout_dtype=jnp.bfloat16)
  if co.host_kind is None:
    raise RuntimeError("no host memory kind on this backend")
  nbytes = model_lib.param_bytes(params)

  holder = {"params": params}

  def ours_timed():
    t0 = time.perf_counter()
    rollout_params = co.to_rollout(holder["params"])
    t1 = time.perf_counter()
    holder["params"] = co.to_train(rollout_params)
    return t1 - t0, time.perf_counter() - t1

  dev = jax.tree.map(lambda x: x.sharding, params)
  host = jax.tree.map(lambda s: s.with_memory_kind(co.host_kind), dev)
  cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))

  def one_shot_timed():
    t0 = time.perf_counter()
    copy = jax.block_until_ready(cast(holder["params"]))
    parked = jax.block_until_ready(jax.device_put(holder["params"], host))
    colocate.delete(holder["params"])
    t1 = time.perf_counter()
    colocate.delete(copy)
    holder["params"] = jax.block_until_ready(jax.device_put(parked, dev))
    colocate.delete(parked)
    return t1 - t0, time.perf_counter() - t1

  ours_timed(), one_shot_timed()  # Compile and warm both.
  runs = {"ours": [], "one_shot": []}
  for _ in range(_REPEATS.value):  # Interleaved.
    runs["ours"].append(ours_timed())
    runs["one_shot"].append(one_shot_timed())
  med = {k: (statistics.median(a for a, _ in v),
             statistics.median(b for _, b in v)) for k, v in runs.items()}
  out = dict(param_bytes=nbytes, host_memory_kind=co.host_kind,
             to_rollout_s=med["ours"][0], to_train_s=med["ours"][1],
             one_shot_to_rollout_s=med["one_shot"][0],
             one_shot_to_train_s=med["one_shot"][1])
  out["round_trip_vs_one_shot"] = sum(med["one_shot"]) / sum(med["ours"])
  out["host_gb_s"] = nbytes / med["ours"][1] / 1e9
  print(f"\nrepartition of {nbytes / 2**30:.2f} GiB fp32 params "
        f"(bf16 rollout copy, master parked in {co.host_kind}):")
  print(f"{'method':<10}{'to rollout s':>13}{'to train s':>11}")
  for k, (a, b) in med.items():
    print(f"{k:<10}{a:>13.3f}{b:>11.3f}")
  return out


PARTS = {"decode": decode_part, "train": train_part,
         "repartition": repartition_part}


def main(argv):
  del argv
  if _SMOKE.value:
    flags.FLAGS.quick = True
  if _QUICK.value:
    sizes = dict(prompts=4, samples=4, prompt_len=128, new_tokens=32,
                 repeats=2)
    if _SMOKE.value:  # --quick's parts and impls, smaller.
      sizes.update(num_layers=1, prompt_len=32, new_tokens=16, repeats=1)
    for flag, value in sizes.items():
      if not flags.FLAGS[flag].present:
        flags.FLAGS[flag].value = value
  try:  # Threefry as one GPU kernel: XLA compiles inlined copies slowly.
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  except AttributeError:
    pass
  unknown = [p for p in _PARTS.value if p not in PARTS]
  if unknown:
    raise app.UsageError(f"unknown --parts {unknown}; known: {list(PARTS)}")
  t_start = time.perf_counter()
  dev = jax.devices()[0]
  out = dict(device=dev.device_kind, platform=dev.platform,
             jax=jax.__version__, quick=_QUICK.value)
  print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}",
        flush=True)
  for part in _PARTS.value:
    out[part] = PARTS[part]()
  first = lambda *ks: next((out["decode"][k] for k in ks  # noqa: E731
                            if k in out.get("decode", {})), None)
  impl = (_IMPLS.value or ["pallas" if dev.platform != "cpu" else "xla"])[0]
  out["prompt_once_decode_speedup"] = first(f"{impl}.prompt_once_speedup")
  shared = first(f"{impl}.shared")
  out["decode_hbm_fraction"] = shared and shared["device_hbm_fraction"]
  out["train_mfu"] = out.get("train", {}).get("mfu")
  out["repartition_vs_one_shot"] = out.get("repartition", {}).get(
      "round_trip_vs_one_shot")
  out["wall_s"] = time.perf_counter() - t_start
  report.emit(out)


if __name__ == "__main__":
  app.run(main)
