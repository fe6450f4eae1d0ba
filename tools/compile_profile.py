"""Where a pytest run's time goes: tracing, lowering and XLA compiling, per
test and per program.

  PYTHONPATH=tools python -m pytest -n 2 -p compile_profile \\
      --compile-profile-dir=/tmp/cprof -m "not slow" tests
  python tools/compile_profile.py /tmp/cprof [--top=25]

As a pytest plugin (`-p compile_profile`, with tools/ on the path) it
listens to JAX's own duration events (`jax.monitoring`: a function's
trace, its lowering to MLIR, the backend compile, which also times a load
from the persistent compilation cache) and to its cache hit and miss
events, charges each to the test running, and writes one JSON per process
(each xdist worker its own) into the directory given. As a script it
merges those files and prints three tables: the totals, the test modules
by wall time with the compile shares of it, and the programs by the
seconds spent making them, with how many modules made each. The tests'
own time is what `wall` leaves after the three phases: running programs,
Python, subprocesses.

The numbers are what the run measured on its machine (two xdist workers
on two cores each see the other's load). A test's setup counts as its
own: a session fixture's compiles go to the first test that asks for it.
On the fast tier it showed ([test-rooms]) that compiling is about two
thirds of the test-seconds, and that the engine's decode window, the
learner's step and the model's init are the costliest programs.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import time

_PHASES = {  # jax.monitoring event suffix -> phase
    "jaxpr_trace_duration": "trace",
    "jaxpr_to_mlir_module_duration": "lower",
    "backend_compile_duration": "compile",
}
_TEST_FIELDS = ("wall", "trace", "lower", "compile", "compiles")


def _program_counts() -> dict:
  return {"compiles": 0, "trace": 0.0, "lower": 0.0, "compile": 0.0}


def program_name(fun_name: str) -> str:
  """One name per program across phases: the backend compile reports
  'jit(f)', tracing 'f'."""
  if fun_name.startswith("jit(") and fun_name.endswith(")"):
    return fun_name[4:-1]
  return fun_name


class Recorder:
  """Seconds by (test, phase) and by (program, module, phase)."""

  def __init__(self):
    self.active = False  # Listening (in a process that runs tests).
    self.test: str | None = None  # The test running, and since when.
    self.started = 0.0
    self.tests: dict[str, dict[str, float]] = {}
    self.programs: dict = collections.defaultdict(_program_counts)
    self.cache = collections.Counter()

  def _row(self, test: str) -> dict[str, float]:
    return self.tests.setdefault(test, dict.fromkeys(_TEST_FIELDS, 0.0))

  def on_duration(self, event: str, seconds: float, **kwargs) -> None:
    phase = _PHASES.get(event.rsplit("/", 1)[-1])
    if phase is None:
      return
    test = self.test or "(outside a test)"
    module = test.split("::")[0]
    row = self._row(test)
    row[phase] += seconds
    program = self.programs[program_name(kwargs.get("fun_name", "?")),
                            module]
    program[phase] += seconds
    if phase == "compile":
      row["compiles"] += 1
      program["compiles"] += 1

  def start(self, test: str) -> None:
    self.test, self.started = test, time.perf_counter()

  def finish(self) -> None:
    if self.test is not None:
      self.add_wall(self.test, time.perf_counter() - self.started)
    self.test = None

  def add_wall(self, test: str, seconds: float) -> None:
    self._row(test)["wall"] += seconds

  def on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event.endswith(("cache_hits", "cache_misses")):
      self.cache[event.rsplit("/", 1)[-1]] += 1

  def record(self) -> dict:
    return {"tests": self.tests,
            "programs": [[name, module, counts] for (name, module), counts
                         in self.programs.items()],
            "cache": dict(self.cache)}


_RECORDER = Recorder()


# ------------------------------------------------------------ pytest plugin
def pytest_addoption(parser):
  parser.addoption("--compile-profile-dir", default="compile_profile",
                   help="where compile_profile writes a JSON per process")


def _runs_tests(config) -> bool:
  """False in an xdist controller: its workers run the tests (and its
  logstart / logfinish hooks only see their reports)."""
  return (hasattr(config, "workerinput")
          or not getattr(config.option, "numprocesses", None))


def pytest_configure(config):
  if not _runs_tests(config):
    return
  import jax.monitoring  # pylint: disable=g-import-not-at-top
  jax.monitoring.register_event_duration_secs_listener(
      _RECORDER.on_duration)
  jax.monitoring.register_event_listener(_RECORDER.on_event)
  _RECORDER.active = True


def pytest_runtest_logstart(nodeid, location):
  """Before a test's setup: what compiles from here is the test's."""
  del location
  if _RECORDER.active:
    _RECORDER.start(nodeid)


def pytest_runtest_logfinish(nodeid, location):
  """After its teardown."""
  del nodeid, location
  if _RECORDER.active:
    _RECORDER.finish()


def pytest_unconfigure(config):
  if not _RECORDER.active:
    return
  directory = config.getoption("--compile-profile-dir")
  os.makedirs(directory, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(os.path.join(directory, f"compile_profile_{worker}.json"), "w",
            encoding="utf-8") as f:
    json.dump(_RECORDER.record(), f)


# ------------------------------------------------------------------ report
def merge(records: list[dict]) -> dict:
  """One record from the processes' records (tests are disjoint; programs
  and cache counts add)."""
  tests, cache = {}, collections.Counter()
  programs = collections.defaultdict(_program_counts)
  for rec in records:
    tests.update(rec["tests"])
    cache.update(rec.get("cache", {}))
    for name, module, counts in rec["programs"]:
      for key, value in counts.items():
        programs[name, module][key] += value
  return {"tests": tests, "programs": programs, "cache": dict(cache)}


def by_module(tests: dict) -> dict[str, dict[str, float]]:
  """Each field summed over a module's tests."""
  out = collections.defaultdict(lambda: dict.fromkeys(_TEST_FIELDS, 0.0))
  for test, row in tests.items():
    for key in _TEST_FIELDS:
      out[test.split("::")[0]][key] += row[key]
  return dict(out)


def by_program(programs: dict) -> list[tuple[str, dict, int]]:
  """(program, its counts summed over modules, how many modules made it),
  most seconds first."""
  out = collections.defaultdict(_program_counts)
  modules = collections.defaultdict(set)
  for (name, module), counts in programs.items():
    for key, value in counts.items():
      out[name][key] += value
    modules[name].add(module)
  rows = [(name, counts, len(modules[name])) for name, counts in out.items()]
  return sorted(rows, key=lambda r: -(r[1]["trace"] + r[1]["lower"]
                                      + r[1]["compile"]))


def report(merged: dict, top: int = 25) -> str:
  tests = merged["tests"]
  total = dict.fromkeys(_TEST_FIELDS, 0.0)
  for row in tests.values():
    for key in _TEST_FIELDS:
      total[key] += row[key]
  rest = total["wall"] - total["trace"] - total["lower"] - total["compile"]
  lines = [
      f"{len(tests)} tests, {total['wall']:.1f} test-seconds: trace "
      f"{total['trace']:.1f}, lower {total['lower']:.1f}, compile "
      f"{total['compile']:.1f} ({int(total['compiles'])} compiles; cache "
      f"{merged['cache']}), the rest {rest:.1f}", "",
      f"{'module':60s} {'wall':>7s} {'trace':>6s} {'lower':>6s} "
      f"{'compile':>7s} {'n':>5s}"]
  modules = sorted(by_module(tests).items(), key=lambda kv: -kv[1]["wall"])
  for module, row in modules[:top]:
    lines.append(f"{module[:60]:60s} {row['wall']:7.1f} {row['trace']:6.1f} "
                 f"{row['lower']:6.1f} {row['compile']:7.1f} "
                 f"{int(row['compiles']):5d}")
  lines += ["", f"{'program':40s} {'compiles':>8s} {'trace':>6s} "
            f"{'lower':>6s} {'compile':>7s} {'modules':>7s}"]
  for name, counts, n_modules in by_program(merged["programs"])[:top]:
    lines.append(f"{name[:40]:40s} {counts['compiles']:8d} "
                 f"{counts['trace']:6.1f} {counts['lower']:6.1f} "
                 f"{counts['compile']:7.1f} {n_modules:7d}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("directory")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args(argv)
  paths = sorted(glob.glob(os.path.join(args.directory,
                                        "compile_profile_*.json")))
  if not paths:
    print(f"no compile_profile_*.json in {args.directory}: run pytest with "
          "-p compile_profile --compile-profile-dir there first",
          file=sys.stderr)
    return 2
  records = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      records.append(json.load(f))
  print(report(merge(records), args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
