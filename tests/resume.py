"""Helpers of the kill-and-resume tests: records, digests, a real SIGTERM."""

import glob
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlhf_jax.metrics import MetricWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(workdir) -> dict:
  """{(phase, step): metrics without timings} of a workdir."""
  return {(r["phase"], r["step"]): {k: v for k, v in r.items()
                                    if not k.startswith("perf/")
                                    and k != "phase"}
          for r in MetricWriter(workdir, enabled=False).read()}


def rl_records(workdir) -> dict:
  """{step: the RL step's whole record} of a workdir."""
  return {r["step"]: r for r in MetricWriter(workdir, enabled=False).read()
          if r["phase"] == "rl"}


def override(config, **extra):
  """`config` with "section.key" (or "section.sub.key") overrides; returns
  it."""
  for key, value in extra.items():
    *path, name = key.split(".")
    node = config
    for part in path:
      node = node[part]
    node[name] = value
  return config


def assert_same_records(resumed: dict, reference: dict) -> None:
  assert sorted(resumed) == sorted(reference)
  for key, record in reference.items():
    assert resumed[key] == pytest.approx(record, rel=1e-6), key


def has_record(workdir, phase: str, step: int) -> bool:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return any(f'"phase": "{phase}", "step": {step},' in line for line in f)


def tree_digest(directory) -> dict:
  """{relative path: sha1} of every file under `directory`."""
  out = {}
  for path in glob.glob(os.path.join(directory, "**"), recursive=True):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha1(
            f.read()).hexdigest()
  return out


class SigtermWhen:
  """Sends this process SIGTERM (the jobs' preemption signal) once
  `predicate()` holds, from a watcher thread; the jobs' handler runs in the
  main thread and stops after the current step."""

  def __init__(self, predicate):
    self._done = threading.Event()
    self.sent = False

    def watch():
      while not self._done.wait(0.02):
        if predicate():
          self.sent = True
          os.kill(os.getpid(), signal.SIGTERM)
          return

    self._thread = threading.Thread(target=watch, daemon=True)
    self._thread.start()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join()


def sigkill_at_checkpoint(cmd, workdir, step, env, timeout=300) -> None:
  """Runs `cmd` until `<workdir>/checkpoints/<step>` exists, then SIGKILLs
  it (no chance to save: what a preempted machine does)."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  ckpt = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.time() + timeout
  while not os.path.isdir(ckpt) and proc.poll() is None:
    assert time.time() < deadline, f"no checkpoint at step {step}"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()


def run_main(args, timeout=600) -> subprocess.CompletedProcess:
  """`python -m rlhf_jax.main ARGS` on 8 CPU devices, output captured."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "rlhf_jax.main", *args],
                        cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)
