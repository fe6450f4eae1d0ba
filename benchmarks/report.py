"""A benchmark's result: its last stdout line, and with `--out` a record.

Every benchmark ends with `report.emit(summary)`: the summary (one JSON
object of figures and ratios against a baseline measured in the same run) is
the last stdout line. `--out=benchmarks/results/<name>.json` also writes it,
under `result`, with what it takes to reproduce and judge it: the commit (and
the tracked files that differed from it), the UTC date, the machine (CPU
model, cores, JAX's devices), the load average when the process started and
when it ended (the machines are shared: a figure taken beside other work says
so), the wall time and the exact command. The figures that README.md and
docs/results.md quote are read from these files by
tests/test_doc_figures.py.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

from absl import flags

_OUT = flags.DEFINE_string(
    "out", None, "Also write the result with its commit, date, machine, "
    "load average and command to this JSON file (benchmarks/results/).")

_LOAD_AT_START = os.getloadavg()
_T_START = time.time()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_path(spec: str) -> str:
  """A config spec `path[:arg]` with a repo-relative path that does not
  exist from the working directory made absolute (benchmarks run from
  anywhere, tests/test_benchmarks_smoke.py from an empty directory)."""
  path, sep, arg = spec.partition(":")
  if not os.path.exists(path) and os.path.exists(os.path.join(_ROOT, path)):
    path = os.path.join(_ROOT, path)
  return path + sep + arg


def _git(*args: str) -> str:
  try:
    return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True,
                          text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return ""


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _module() -> str:
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  return spec.name if spec is not None and spec.name else sys.argv[0]


def command_line() -> str:
  """The command as typed: `python -m benchmarks.<name> <flags>`."""
  return shlex.join(["python", "-m", _module(), *sys.argv[1:]])


def machine() -> dict:
  """Where the figures were taken."""
  info = {"cpu": _cpu_model(), "cores": os.cpu_count(),
          "python": platform.python_version()}
  if "jax" in sys.modules:  # a benchmark that never started JAX stays so
    jax = sys.modules["jax"]
    devices = jax.devices()
    info.update(jax=jax.__version__, platform=devices[0].platform,
                device_kind=devices[0].device_kind, devices=len(devices))
  return info


def record(summary: dict, detail: dict | None = None) -> dict:
  """The file `--out` writes: `result` is the printed last line."""
  rec = {"benchmark": _module(),
         "command": command_line(),
         "commit": _git("rev-parse", "HEAD").strip(),
         # Tracked files that differed from the commit (docs being edited
         # beside a run show here, and so would code).
         "uncommitted_changes": [line[3:] for line in _git(
             "status", "--porcelain", "--untracked-files=no").splitlines()],
         "date": datetime.datetime.now(datetime.timezone.utc).strftime(
             "%Y-%m-%dT%H:%M:%SZ"),
         "machine": machine(),
         "load_avg_1_5_15_start": [round(x, 2) for x in _LOAD_AT_START],
         "load_avg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
         "wall_s": round(time.time() - _T_START, 1),
         "result": summary}
  if detail is not None:
    rec["detail"] = detail
  return rec


def emit(summary: dict, detail: dict | None = None) -> None:
  """Prints `summary` as the last stdout line; with `--out`, writes
  `record(summary, detail)` there first."""
  if _OUT.value:
    path = os.path.abspath(_OUT.value)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(record(summary, detail), f, indent=1, default=float)
      f.write("\n")
    print(f"result written to {_OUT.value}")
  sys.stdout.flush()
  print(json.dumps(summary, default=float))
