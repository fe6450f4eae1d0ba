"""One metric writer (process 0): metrics.jsonl, TensorBoard events, log
lines, and with `logging.wandb="offline"` a Weights & Biases run.

Keys are namespaced (`train/`, `rollout/`, `eval/`, `perf/`, `sft/`). Values
arrive as device arrays or floats; they are fetched only at write time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import jax
import numpy as np
from absl import logging

from rlhf_jax.rl import off_policy


def _to_float(v):
  return float(np.asarray(jax.device_get(v)))


class WandbRun:
  """An offline W&B run under <workdir>/wandb: every record as one `log`
  call (its values, and "<phase>/step": the job's step, since W&B's own
  step counts calls and the SFT and RL phases both count from 0), the
  config as the run's config, once. W&B's files all stay in the workdir
  (WANDB_DIR, its cache, config and data directories) and it talks to no
  server: offline mode, no error reporting, no git or code capture; its
  local service (wandb-core) talks to this process over a unix socket
  (tests/test_loopback_only.py traces it)."""

  def __init__(self, workdir: str, config: dict, project: str, name: str):
    root = os.path.join(os.path.abspath(workdir), "wandb")
    os.makedirs(root, exist_ok=True)
    for key, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data")):
      os.environ[key] = os.path.join(root, sub)
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    os.environ["WANDB_SILENT"] = "true"
    try:
      import wandb  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      from rlhf_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
      raise ConfigError("config.logging.wandb='offline' needs the wandb "
                        "package: pip install -e '.[wandb]'") from e
    self._wandb = wandb
    self.run = wandb.init(
        dir=root, project=project, name=name, config=config, mode="offline",
        settings=wandb.Settings(disable_git=True, save_code=False,
                                x_disable_stats=True, x_disable_meta=True,
                                console="off"))
    self.dir = self.run.dir

  def log(self, phase: str, step: int, record: dict) -> None:
    self.run.log({**record, f"{phase}/step": step})

  def close(self) -> None:
    self.run.finish()


class MetricWriter:
  """Appends {"step": s, key: value, ...} records; TensorBoard via
  tensorboardX; with `wandb` (`WandbRun`'s (config, project, name)) also
  a W&B run."""

  def __init__(self, workdir: str, *, enabled: bool = True,
               wandb: tuple[dict, str, str] | None = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = self.wandb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      from tensorboardX import SummaryWriter  # No TensorFlow needed.
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      if wandb is not None:
        self.wandb = WandbRun(workdir, *wandb)

  def truncate_after(self, phase: str, step: int) -> None:
    """Drops records of `phase` past `step` (written before a crash/resume)."""
    if not (self.enabled and os.path.exists(self.path)):
      return
    kept = [r for r in self.read()
            if not (r.get("phase") == phase and r["step"] > step)]
    with open(self.path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def write(self, phase: str, step: int, metrics: dict) -> dict:
    record = {k: _to_float(v) for k, v in metrics.items()}
    if self.enabled:
      with open(self.path, "a") as f:
        f.write(json.dumps({"phase": phase, "step": step, **record}) + "\n")
      for k, v in record.items():
        self._tb.add_scalar(k, v, step if phase != "sft" else step)
      self._tb.flush()
      if self.wandb is not None:
        self.wandb.log(phase, step, record)
    return record

  def close(self):
    if self._tb is not None:
      self._tb.close()
    if self.wandb is not None:
      self.wandb.close()
      self.wandb = None


class Progress:
  """Step/total, elapsed, ETA and key metrics: a bar redrawn in place when
  stderr is a terminal, else one log line per update."""

  def __init__(self, total: int, first: int = 0, *, name: str = "step",
               enabled: bool = True):
    self.total, self.first, self.name = total, first, name
    self.enabled = enabled
    self._start = time.perf_counter()
    self._tty = sys.stderr.isatty()

  def update(self, step: int, summary: str = "") -> None:
    if not self.enabled:
      return
    done = step - self.first
    elapsed = time.perf_counter() - self._start
    eta = elapsed / max(done, 1) * (self.total - step)
    where = f"{step}/{self.total} [{elapsed:.0f}s elapsed, ETA {eta:.0f}s]"
    if not self._tty:
      logging.info("%s %s %s", self.name, where, summary)
      return
    filled = int(20 * step / max(self.total, 1))
    width = shutil.get_terminal_size().columns - 1
    line = f"{self.name} [{'#' * filled:<20}] {where} {summary}"
    print("\r" + line[:width].ljust(width), end="", file=sys.stderr,
          flush=True)
    if step >= self.total:
      print(file=sys.stderr, flush=True)


def _over_updates(key: str):
  """How one metric of a step's updates is logged."""
  if key.endswith("_max"):
    return np.max
  return np.min if key.endswith("_min") else np.mean


def rl_step_metrics(info: dict, trained: dict[str, list[dict]], perf: dict,
                    *extra: dict, version: int, stale: int, step: int,
                    alarm_kl: float) -> dict:
  """The host metrics of one RL step.

  Args:
    info: host values of the step's batch: "rewards" [B] (before any KL
      penalty), "kl" [B] (sequence KL to the reference), "response_len"
      [B], "positions" / "real_positions" (what the train step computes
      on, and how much of it is not padding), "gap_max" / "gap_mean" /
      "mismatch_kl" (trainer vs sampler log-probs; with routing replay
      also "mismatch_kl_without_replay", the trainer's own routing,
      `rl/off_policy.mismatch`, and "moe_flip_rate", the share of the
      sampler's (token, layer) choices that routing makes differently); on the on-policy path the policy's
      updates measured them instead (`off_policy.on_policy`).
    trained: prefix -> metrics of every update ("train": the policy,
      "critic": PPO's value function); means are logged, but of "*_max"
      the max and of "*_min" the min.
    perf: the timeline's perf/ metrics of the step.
    extra: further metric dicts (rollout, rewards, workers).
    version: the weight version the samples came from.
    stale: samples of other versions left out of the loss.
    step: the RL step (for the alarm's line).
    alarm_kl: `rl.mismatch_alarm_kl` (`off_policy.alarm`; 0 = off).
  """
  if "gap_max" not in info:
    measured, policy = off_policy.measured_in_updates(trained["train"])
    info, trained = {**info, **measured}, {**trained, "train": policy}
  tokens = float(np.sum(info["response_len"]))
  out = {"rollout/reward_mean": float(np.mean(info["rewards"])),
         "rollout/kl": float(np.mean(info["kl"])),
         "rollout/response_len_mean": float(np.mean(info["response_len"])),
         "rollout/response_len_max": float(np.max(info["response_len"])),
         "rollout/logprob_gap": float(info["gap_max"]),
         "rollout/logprob_gap_mean": float(info["gap_mean"]),
         "rollout/mismatch_kl": float(info["mismatch_kl"]),
         "rollout/weight_version": float(version),
         "rollout/stale_dropped": float(stale),
         "train/positions": float(info["positions"]),
         "train/padding_fraction":
             1.0 - info["real_positions"] / max(info["positions"], 1)}
  if "mismatch_kl_without_replay" in info:  # MoE routing replay.
    out["rollout/mismatch_kl_without_replay"] = float(
        info["mismatch_kl_without_replay"])
    out["rollout/moe_flip_rate"] = float(info["moe_flip_rate"])
  for metrics in extra:
    out.update({k: float(v) for k, v in metrics.items()})
  for prefix, updates in trained.items():
    out.update({f"{prefix}/{k}": float(_over_updates(k)(
        [m[k] for m in updates])) for k in updates[0]})
  out.update(perf)
  out["perf/tokens_per_s"] = tokens / perf["perf/step_s"]
  return off_policy.alarm(out, alarm_kl, step=step)
