"""Response-length workloads: a generator with the structure the seeds rely on.

Lengths are log-normal with a cap, and the log-length of sample j of prompt p
in epoch e at step s is
  log(median * (1 + drift) ** s)
    + sigma * (sqrt(g) * u[p, e] + sqrt(1 - g) * eps[p, e, j]),
  u[p, e] = sqrt(a) * z[p] + sqrt(1 - a) * nu[p, e],
so `g` is the share of variance common to a GRPO group (group correlation),
`a` the per-prompt autocorrelation across epochs (what EWMA ranking needs),
and `drift` the upward growth of the mean over training. The same prompts are
replayed every epoch. A CSV trace of real lengths can replace the generator.
"""

import csv
import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
  """Length-generator parameters.

  Attributes:
    prompts_per_step: prompts (groups) per RL step.
    group_size: responses per prompt (GRPO G; 1 for PPO).
    dataset_prompts: distinct prompts replayed every epoch.
    prompt_len: mean prompt length (tokens).
    median_len: median response length at step 0.
    sigma: log-normal shape (tail heaviness).
    max_len: response cap.
    group_corr: g, variance share common to a group.
    epoch_corr: a, per-prompt autocorrelation across epochs.
    drift: relative growth of the median per step.
    seed: random seed.
    trace_csv: optional CSV (step,prompt_id,sample_index,prompt_len,
      response_len) replacing the generator.
  """

  prompts_per_step: int = 128
  group_size: int = 8
  dataset_prompts: int = 512
  prompt_len: int = 256
  median_len: float = 1000.0
  sigma: float = 0.8
  max_len: int = 4096
  group_corr: float = 0.5
  epoch_corr: float = 0.8
  drift: float = 0.0
  seed: int = 0
  trace_csv: str = ""


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """One step's prompts: per-sample (prompt id, index, prompt len, length)."""

  prompt_ids: list[int]
  samples: list[tuple[int, int, int, int]]


class Workload:
  """Deterministic per-step batches (same seed -> same lengths)."""

  def __init__(self, spec: WorkloadSpec):
    self.spec = spec
    rng = np.random.default_rng(spec.seed)
    n = spec.dataset_prompts
    self._z = rng.standard_normal(n)
    self._prompt_len = np.maximum(
        8, rng.normal(spec.prompt_len, 0.25 * spec.prompt_len, n)).astype(int)
    self._trace = _read_trace(spec.trace_csv) if spec.trace_csv else None

  def batch(self, step: int) -> StepBatch:
    """The prompts and response lengths of RL step `step`."""
    if self._trace is not None:
      rows = self._trace.get(step % len(self._trace), [])
      return StepBatch(sorted({r[0] for r in rows}), rows)
    spec = self.spec
    first = step * spec.prompts_per_step
    epoch = first // spec.dataset_prompts
    ids = [(first + i) % spec.dataset_prompts
           for i in range(spec.prompts_per_step)]
    a, g = spec.epoch_corr, spec.group_corr
    log_median = math.log(spec.median_len * (1 + spec.drift) ** step)
    samples = []
    for p in ids:
      rng = np.random.default_rng((spec.seed, epoch, p))
      u = math.sqrt(a) * self._z[p] + math.sqrt(1 - a) * rng.standard_normal()
      eps = rng.standard_normal(spec.group_size)
      logs = log_median + spec.sigma * (math.sqrt(g) * u +
                                        math.sqrt(1 - g) * eps)
      lengths = np.clip(np.exp(logs), 1, spec.max_len).astype(int)
      for j, length in enumerate(lengths):
        samples.append((p, j, int(self._prompt_len[p]), int(length)))
    return StepBatch(ids, samples)


def _read_trace(path: str) -> dict[int, list[tuple[int, int, int, int]]]:
  steps = {}
  with open(path) as f:
    for row in csv.DictReader(f):
      steps.setdefault(int(row["step"]), []).append(
          (int(row["prompt_id"]), int(row["sample_index"]),
           int(row["prompt_len"]), int(row["response_len"])))
  return {i: steps[k] for i, k in enumerate(sorted(steps))}


def write_trace(path: str, batches: list[StepBatch]):
  """Writes batches in the CSV trace format `Workload` reads."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["step", "prompt_id", "sample_index", "prompt_len",
                     "response_len"])
    for step, batch in enumerate(batches):
      for p, j, prompt_len, length in batch.samples:
        writer.writerow([step, p, j, prompt_len, length])


def long_tailed_lengths(n_prompts: int, G: int, max_new: int, median: float,
                        seed: int) -> np.ndarray:
  """[n_prompts, G] lengths for one live batch (the live benchmarks' trace).

  Per-prompt means are lognormal (sigma 0.9) around `median` and each
  sample lognormal (sigma 0.5) around its prompt's mean, clipped to
  [1, max_new]: long-tailed, and a prompt's length is predictable from its
  history.
  """
  rng = np.random.default_rng(seed)
  means = median * rng.lognormal(0.0, 0.9, n_prompts)
  lengths = means[:, None] * rng.lognormal(0.0, 0.5, (n_prompts, G))
  return np.clip(np.rint(lengths), 1, max_new).astype(int)
