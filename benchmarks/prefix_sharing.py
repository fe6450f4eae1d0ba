"""Prompt sharing vs repeating the prompt G times: rollout and one train step.

  python -m benchmarks.prefix_sharing [--quick] [--repeats=N]

In one run, on one CPU device, the same model and the same code, two ways:

Rollout (the paged engine, `Engine` + `Driver` as jobs run it:
admission, prefill and decode until every sample has M tokens):
  shared:   one request of G samples per prompt: each prompt is prefilled
            ONCE and its G samples decode against one copy of its KV pages
            (one group, its prompt pages read once per step for all G).
  repeated: G requests of 1 sample per prompt (sample indices 0..G-1): G
            prefills and G copies of its KV pages.
  Settings (G, P, M): (16, 512, 64) and (4, 128, 64), 16 samples each
  (1 resp. 4 prompts). Engines: 16 slots, one prompt bucket P, pages of 16
  tokens, the default page pool (nothing waits for a slot or a page),
  `num_groups` = the run's requests (all admitted at once), prefills of
  up to 4 prompts a call (the default), the default decode window (8 steps
  a `generate` call). Both variants draw the same tokens (same keys;
  `rollout_same_tokens` in the JSON). Timed: one `Driver.run`,
  split where its first `generate` call waits for the decode state: prefill
  = admission (every prompt copy's prefill, insert, the samples' starts),
  decode = the rest (every decode call and the driver's host work,
  pipelined as in a job). Temperature 1, no stop tokens.

Common prefix (the engine's two-level sharing, `benchmarks/common_prefix.py`,
also run here): 16 prompts = a 256-token prefix common to all + 8..32 own
tokens, G=4; baseline prefills every whole prompt into its group's pages,
ours prefills and stores the 256 tokens once.

Train step (Learner.step, GRPO policy loss with k3 KL, token-mean):
  shared:   the grouped layout (rl/grouped.py): prompt tokens [N, P] run once,
            the G responses attend to the prompt's K/V (prefix part) + their
            own tokens, merged by log-sum-exp; autodiff sums the G responses'
            gradients into the prompt.
  repeated: [prompt; response] per sequence, [N*G, P+R].
  Setting: G=8, P=256, R=64, N=2 prompts (16 sequences; --quick: N=1).

Compile runs are excluded; variants alternate repeat by repeat (the machine
is shared); the speedup is the median over repeats of the paired time ratio
repeated / shared. Next to each measured ratio is the theoretical one:
  rollout: KV tokens read per decode step, repeated / shared, as the
    engine's jnp attention reads them (`common_prefix.kv_tokens_read`: each
    group's prompt pages once, each sample's own pages, up to the step's
    page-rounded bounds; averaged over the decode steps), and prefill
    FLOPs, G;
  train: tokens through the weights, G (P+R) / (P + G R) (matmul FLOPs;
    attention FLOPs favour sharing a bit more).
Decode-state bytes are those of the two engines
(`common_prefix.decode_state_bytes`: the default page pool, sized for the
run's prompts and samples, and the tables).

Model: `ModelConfig.tiny` widened as in benchmarks/engine.py (4 layers, embed
256, 8 query / 2 kv heads of dim 64, MLP 768, vocab 1024: 4.2M params, fp32),
bigger than the tests' tiny model so that attention and prompt work are not
lost in per-op dispatch overhead on CPU.

`--smoke` (tests/test_benchmarks_smoke.py): the same settings on a 1-layer
64-wide model with 3 new tokens (8 response tokens in training) and one
repeat, and the common prefix's smoke; the numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with
`rollout_speedup` and `theoretical_kv_read_ratio` (G=16, P=512),
`train_step_speedup`, `kv_bytes_ratio` (repeated / shared decode-state
bytes, G=16, P=512) and the per-setting numbers.
"""

from __future__ import annotations

import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlhf_jax.samples import Request, Sample
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives
from rlhf_jax.rl.losses import KLConfig
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer

from benchmarks import common_prefix
from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats (< 3 minutes).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 0, "Timed repeats per setting; 0 means 2 (--quick) or 5.")
_SMOKE = flags.DEFINE_bool("smoke", False, "A 1-layer 64-wide model, 3 new "
                           "tokens, one repeat: that it runs (tests).")

SAMPLES = 16                                # Live samples per rollout.
PAGE_SIZE = 16                              # Tokens per KV page.
ROLLOUT_CASES = ((16, 512, 64), (4, 128, 64))  # (G, P, M); headline first.
TRAIN_CASE = (8, 256, 64)                   # (G, P, R).


def _model_config() -> ModelConfig:
  if _SMOKE.value:  # common_prefix's smoke model.
    return common_prefix._model_config(  # pylint: disable=protected-access
        smoke=True)
  return ModelConfig.tiny(num_layers=4, embed_dim=256, num_heads=8,
                          num_kv_heads=2, head_dim=64, mlp_dim=768,
                          vocab_size=1024)


# ----------------------------------------------------------------- rollout
class _Rollout:
  """One paged engine plus its request list; `run` times one rollout."""

  def __init__(self, cfg, graphdef, params, layout, G, P, M, prompts_NxP,
               shared: bool):
    N = prompts_NxP.shape[0]
    n = N if shared else N * G  # Requests = groups.
    self.engine = Engine(
        cfg, graphdef, layout, num_slots=N * G,
        samples_per_group=G if shared else 1, prefill_buckets=(P,),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=M),
        page_size=PAGE_SIZE, num_groups=n, prefill_batch=min(n, 4))
    self.params, self.M = params, M
    self.requests = ([Request(i, prompts_NxP[i], G, seed=0)
                      for i in range(N)] if shared
                     else [Request(i, prompts_NxP[i], 1, seed=0,
                                   first_sample_index=j)
                           for i in range(N) for j in range(G)])
    self.times = []  # (prefill_s, decode_s) per timed run.
    self.kv_read = 0.0
    self.tokens = None

  def run(self, timed=True):
    """One rollout; untimed = the compile run."""
    res = common_prefix.timed_run(Driver(self.engine, self.params),
                                  self.requests)
    if len(res.tokens) != SAMPLES or any(
        len(t) != self.M for t in res.tokens.values()):
      raise AssertionError(f"expected {SAMPLES} samples of {self.M} tokens")
    # The first token comes with the prefill: M - 1 decode steps.
    self.kv_read, self.tokens = res.kv_read(self.M - 1), res.tokens
    if timed:
      self.times.append((res.admit_s, res.decode_s))


def _rollout_case(cfg, graphdef, params, layout, G, P, M, repeats, rng):
  N = SAMPLES // G
  prompts = rng.integers(0, cfg.vocab_size, (N, P)).astype(np.int32)
  shared = _Rollout(cfg, graphdef, params, layout, G, P, M, prompts, True)
  repeated = _Rollout(cfg, graphdef, params, layout, G, P, M, prompts, False)
  shared.run(timed=False)  # Compiles prefill, insert, start, generate.
  repeated.run(timed=False)
  for _ in range(repeats):
    shared.run()
    repeated.run()
  def tot(v):
    return np.array([a + b for a, b in v.times])

  def med(v, i):
    return float(np.median([t[i] for t in v.times]))

  # Decode split, as in benchmarks/engine.py: step = rest + c * (KV tokens
  # read per step), solved from the two variants (same projections, MLP,
  # logits and sampling; they differ only in prompt KV reads).
  step_sh, step_rep = (1e3 * med(v, 1) / (M - 1) for v in (shared, repeated))
  kv_sh, kv_rep = shared.kv_read, repeated.kv_read
  c = (step_rep - step_sh) / (kv_rep - kv_sh)
  rest = step_rep - c * kv_rep
  return dict(
      step_ms_shared=step_sh, step_ms_repeated=step_rep, rest_ms=rest,
      kv_ms_shared=c * kv_sh, kv_ms_repeated=c * kv_rep,
      kv_tokens_shared=kv_sh, kv_tokens_repeated=kv_rep,
      same_tokens=shared.tokens == repeated.tokens, G=G, P=P, M=M, N=N,
      speedup=float(np.median(tot(repeated) / tot(shared))),
      shared_s=float(np.median(tot(shared))),
      repeated_s=float(np.median(tot(repeated))),
      shared_prefill_s=med(shared, 0), repeated_prefill_s=med(repeated, 0),
      shared_decode_s=med(shared, 1), repeated_decode_s=med(repeated, 1),
      decode_speedup=med(repeated, 1) / med(shared, 1),
      prefill_speedup=med(repeated, 0) / med(shared, 0),
      theory_kv_read=kv_rep / kv_sh, theory_prefill=float(G),
      shared_state_bytes=common_prefix.decode_state_bytes(shared.engine),
      repeated_state_bytes=common_prefix.decode_state_bytes(
          repeated.engine))


# -------------------------------------------------------------- train step
def _train_samples(cfg, G, P, R, N, rng):
  """N prompts of exactly P tokens, G responses of exactly R tokens each."""
  out = []
  for n in range(N):
    prompt = rng.integers(1, cfg.vocab_size, P).astype(np.int32)
    for g in range(G):
      out.append(Sample(
          prompt_id=n, sample_idx=g, prompt_tokens=prompt,
          tokens=rng.integers(1, cfg.vocab_size, R).tolist(),
          logp=[0.0] * R, logp_raw=[0.0] * R, finish_reason="length",
          weight_version=0))
  return out


def _train_case(cfg, layout, repeats, rng, N, case=TRAIN_CASE):
  G, P, R = case
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
      clip_high=0.28, kl=KLConfig(0.01), aggregation="token-mean", max_len=R))
  learner = Learner(graphdef, layout, make_optimizer(OptimConfig()),
                    terms_fn=terms, weight_fn=weight, micro_batches=1)
  samples = _train_samples(cfg, G, P, R, N, rng)
  adv = rng.standard_normal(N * G).astype(np.float32)
  batches = {}
  for name, group_size in (("shared", G), ("repeated", 0)):
    arrays = batch_lib.pack(samples, P, R, group_size=group_size).arrays
    # Old/ref log-probs near a uniform policy's (timing does not depend on
    # them; recomputing them would cost two more compiles).
    logp = np.full(arrays["loss_mask"].shape, -np.log(cfg.vocab_size),
                   np.float32)
    batches[name] = learner.put_batch({
        **arrays, "old_logp": logp, "ref_logp": logp - 0.01,
        "advantages": adv.reshape(arrays["loss_mask"].shape[:-1])})
  # One state per variant (steps donate it), both from the same params.
  states = {name: learner.init_state(
      jax.tree.map(lambda x: jnp.array(x, copy=True), params))
            for name in batches}
  times = {"shared": [], "repeated": []}
  losses = {}
  for i in range(repeats + 1):  # Run 0 compiles.
    for name in ("shared", "repeated"):
      t0 = time.perf_counter()
      states[name], m = learner.step(states[name], batches[name])
      jax.block_until_ready(m)
      if i:
        times[name].append(time.perf_counter() - t0)
      losses.setdefault(name, float(m["loss"]))
  ratios = np.array(times["repeated"]) / np.array(times["shared"])
  tokens_shared, tokens_repeated = N * P + N * G * R, N * G * (P + R)
  return dict(
      G=G, P=P, R=R, N=N, speedup=float(np.median(ratios)),
      shared_s=float(np.median(times["shared"])),
      repeated_s=float(np.median(times["repeated"])),
      theory_tokens=tokens_repeated / tokens_shared,
      tokens_shared=tokens_shared, tokens_repeated=tokens_repeated,
      # Same params, same data: the first step's losses must agree.
      loss_shared=losses["shared"], loss_repeated=losses["repeated"])


def _table(rollouts, train) -> str:
  head = (f"{'rollout':<9}{'G':>3}{'P':>5}{'M':>4} | {'shared s':>8} "
          f"{'repeat s':>8} | {'speedup':>7} | {'prefill':>7} {'theory':>6} |"
          f" {'decode':>6} {'KV-read theory':>14} | {'state MB shared':>15} "
          f"{'repeat':>6}")
  lines = [head, "-" * len(head)]
  for r in rollouts:
    lines.append(
        f"{'':<9}{r['G']:>3}{r['P']:>5}{r['M']:>4} | {r['shared_s']:>8.3f} "
        f"{r['repeated_s']:>8.3f} | {r['speedup']:>6.2f}x | "
        f"{r['prefill_speedup']:>6.2f}x {r['theory_prefill']:>5.1f}x | "
        f"{r['decode_speedup']:>5.2f}x {r['theory_kv_read']:>13.2f}x | "
        f"{r['shared_state_bytes'] / 2**20:>15.2f} "
        f"{r['repeated_state_bytes'] / 2**20:>6.2f}")
  lines += [
      f"{SAMPLES} samples per rollout on the paged engine (pages of "
      f"{PAGE_SIZE}); prefill = admission of every prompt copy (prefill, "
      f"insert, start), decode = the rest of the run (M-1 decode steps, "
      f"8 a call); speedup = median paired ratio repeated/shared of the "
      f"whole rollout, prefill/decode columns = ratio of medians. KV-read "
      f"theory = repeated / shared KV tokens a decode step reads (the "
      f"attention's page-rounded reads); prefill theory = G.", ""]
  head = (f"{'decode':<9}{'G':>3}{'P':>5} | {'KV tok/step shared':>18} "
          f"{'repeat':>6} | {'step ms shared':>14} "
          f"{'repeat':>6} | {'KV-read ms shared':>17} {'repeat':>6} | "
          f"{'rest ms':>7} | {'bound':>6}")
  lines += [head, "-" * len(head)]
  for r in rollouts:
    # rest within noise of 0: decode time is all KV reads.
    bound = (f"{r['step_ms_repeated'] / r['rest_ms']:>5.1f}x"
             if r["rest_ms"] > 0.05 * r["step_ms_repeated"] else "KV-bnd")
    lines.append(
        f"{'':<9}{r['G']:>3}{r['P']:>5} | {r['kv_tokens_shared']:>18.0f} "
        f"{r['kv_tokens_repeated']:>6.0f} | {r['step_ms_shared']:>14.2f} "
        f"{r['step_ms_repeated']:>6.2f} | {r['kv_ms_shared']:>17.2f} "
        f"{r['kv_ms_repeated']:>6.2f} | {r['rest_ms']:>7.2f} | {bound}")
  lines += [
      "Decode time split (estimate): step = rest + c * KV tokens read per "
      "step (the KV tok/step columns), solved from the two variants; step "
      "= decode time / (M-1), the driver's host work included; rest = "
      "weight-bound work both do alike. bound = repeated "
      "step / rest, the decode speedup if KV reads were free (KV-bnd: rest "
      "< 5% of the step, i.e. decode is bound by KV reads and the decode "
      "speedup can reach the KV-read theory).", ""]
  t = train
  head = (f"{'train':<9}{'G':>3}{'P':>5}{'R':>4}{'N':>3} | {'shared s':>8} "
          f"{'repeat s':>8} | {'speedup':>7} | {'token theory':>12}")
  lines += [head, "-" * len(head),
            f"{'':<9}{t['G']:>3}{t['P']:>5}{t['R']:>4}{t['N']:>3} | "
            f"{t['shared_s']:>8.3f} {t['repeated_s']:>8.3f} | "
            f"{t['speedup']:>6.2f}x | {t['theory_tokens']:>11.2f}x",
            f"One Learner.step (forward + backward + AdamW); token theory = "
            f"G(P+R)/(P+GR) = {t['tokens_repeated']}/{t['tokens_shared']} "
            f"tokens through the weights. First-step loss shared "
            f"{t['loss_shared']:.6f} vs repeated {t['loss_repeated']:.6f}."]
  return "\n".join(lines)


def main(argv):
  del argv
  t_start = time.perf_counter()
  if _SMOKE.value:
    timing.smoke_defaults(quick=True, repeats=1)
  quick = _QUICK.value
  repeats = _REPEATS.value or (2 if quick else 5)
  # --smoke: the same settings with 3 new tokens (8 in training).
  cases = tuple((G, P, 3 if _SMOKE.value else M) for G, P, M in ROLLOUT_CASES)
  train_case = TRAIN_CASE[:2] + (8,) if _SMOKE.value else TRAIN_CASE
  cfg = _model_config()
  mesh = mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])
  rollout_layout = mesh_lib.rollout_layout(mesh)
  train_layout = mesh_lib.train_layout(mesh)
  graphdef, params = model_lib.init_params(cfg, 0, rollout_layout)
  print(f"model: {cfg.num_params() / 1e6:.2f}M params, L={cfg.num_layers} "
        f"D={cfg.embed_dim} H={cfg.num_heads} N={cfg.num_kv_heads} "
        f"K={cfg.head_dim} F={cfg.mlp_dim} V={cfg.vocab_size}; 1 of "
        f"{jax.device_count()} {jax.default_backend()} devices; "
        f"repeats={repeats}", flush=True)
  rng = np.random.default_rng(0)
  rollouts = []
  for G, P, M in cases:
    rollouts.append(_rollout_case(cfg, graphdef, params, rollout_layout, G, P,
                                  M, repeats, rng))
    r = rollouts[-1]
    print(f"  rollout G={G} P={P}: shared {r['shared_s']:.2f}s, repeated "
          f"{r['repeated_s']:.2f}s, {r['speedup']:.2f}x "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
  del params
  train = _train_case(cfg, train_layout, repeats, rng, N=1 if quick else 2,
                      case=train_case)
  print(f"  train G={train['G']} P={train['P']}: shared "
        f"{train['shared_s']:.2f}s, repeated {train['repeated_s']:.2f}s, "
        f"{train['speedup']:.2f}x ({time.perf_counter() - t_start:.0f}s)",
        flush=True)
  common = common_prefix.measure(quick, log=lambda m: print(m, flush=True),
                                 smoke=_SMOKE.value)
  print()
  print(_table(rollouts, train))
  print()
  print(common_prefix.table(common))
  head = rollouts[0]
  wall = time.perf_counter() - t_start
  print(f"wall time: {wall:.0f}s")
  report.emit(dict(
      rollout_speedup=round(head["speedup"], 3),
      train_step_speedup=round(train["speedup"], 3),
      kv_bytes_ratio=round(head["repeated_state_bytes"] /
                           head["shared_state_bytes"], 3),
      theoretical_kv_read_ratio=round(head["theory_kv_read"], 3),
      rollout_setting=f"G={head['G']}, P={head['P']}, M={head['M']}, "
      f"{SAMPLES} samples",
      rollout_prefill_speedup=round(head["prefill_speedup"], 3),
      rollout_decode_speedup=round(head["decode_speedup"], 3),
      rollout_prefill_s={k: round(head[f"{k}_prefill_s"], 4)
                         for k in ("shared", "repeated")},
      rollout_decode_s={k: round(head[f"{k}_decode_s"], 4)
                        for k in ("shared", "repeated")},
      rollout_by_g_p={f"g{r['G']}_p{r['P']}": round(r["speedup"], 3)
                      for r in rollouts},
      train_setting=f"G={train['G']}, P={train['P']}, R={train['R']}, "
      f"N={train['N']}",
      theoretical_train_token_ratio=round(train["theory_tokens"], 3),
      train_shared_s=round(train["shared_s"], 4),
      train_repeated_s=round(train["repeated_s"], 4),
      decode_state_bytes_shared=head["shared_state_bytes"],
      decode_state_bytes_repeated=head["repeated_state_bytes"],
      rollout_same_tokens=all(r["same_tokens"] for r in rollouts),
      engine="paged", page_size=PAGE_SIZE,
      common256_rollout_speedup=common["rollout_speedup_common256"],
      common256_prefill_speedup=common["prefill_speedup_common256"],
      common256_prefill_tokens_ratio=common["prefill_tokens_ratio"],
      common256_kv_bytes_ratio=common["kv_bytes_ratio"],
      common256_identical_fraction=common["tokens_identical_fraction"],
      repeats=repeats, quick=quick, params_m=round(cfg.num_params() / 1e6, 2),
      machine=platform.machine(), wall_s=round(wall, 1)))


if __name__ == "__main__":
  app.run(main)
