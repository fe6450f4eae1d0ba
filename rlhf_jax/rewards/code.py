"""Code rewards: the model's program runs in the sandbox against the task's
tests.

A task's metadata gives the tests and how the program is written:
  "tests": [[expression, expected], ...]: each expression (Python source)
    is evaluated after the program ran, in its namespace; `expected` is a
    Python literal (as text). The test passes iff the value's repr, read
    back with `ast.literal_eval`, == `expected` read the same way (as an
    assert in a unit test would compare: 3.0 == 3; a value whose repr is no
    literal fails).
  "program_template" (optional): the file the program goes in,
    "{program}" standing for it (e.g. "f = lambda x: {program}"); default
    the program alone.
The program is the last ```python fenced block of the completion, else the
whole completion (`extract_program`).

Isolation and honesty:
- Every program runs in a fresh `envs/sandbox.PythonSandbox` (its own
  namespaces, read-only mounts, no network, rlimits, seccomp), one per
  distinct (program, tests), with a wall-clock, CPU and memory limit
  (`LIMITS`); a program that crashes, loops or runs out of memory scores
  the tests it finished before (0 for "code" unless all pass).
- The expected values never enter the sandbox: the program's process
  prints only what the expressions evaluated to, and the comparison runs
  outside. A program that forges the printed results (it can read the
  harness, nonce included), exits early or patches builtins gains nothing
  it could not have computed, which is solving the task.
- Calls spread over a pool of `os.cpu_count()` sandbox processes at once
  (threads waiting on child processes); results are cached by (program,
  tests), so repeated programs (G samples of a prompt often agree, and
  prompts recur) run once. A program's score is therefore its first run's
  (programs that read the clock or random state are scored once).

Registered rewards: "code" (1.0 iff every test passes) and "code_partial"
(the share of tests passed).
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import functools
import json
import os
import re
import secrets
import threading
from typing import Mapping, Sequence

from rlhf_jax.envs.sandbox import PythonSandbox, SandboxLimits
from rlhf_jax.rl import registry

# Per program: 2 s of wall clock and CPU, 256 MB, its output capped (the
# results are a short line per test, printed last).
LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_procs=4,
                       max_output_bytes=1 << 16)
_CACHE_SIZE = 1 << 16
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

# The harness the sandbox runs: the program, then each test expression;
# one "<mark> [index, repr or null]" line per test on the real stdout.
_HARNESS = """import json as _json, os as _os, sys as _sys
_MARK, _TESTS, _SOURCE = {mark!r}, {tests!r}, {source!r}
_write = _os.write
_ns = {{"__name__": "__main__"}}
try:
  exec(compile(_SOURCE, "program.py", "exec"), _ns)
  _loaded = True
except BaseException:
  _loaded = False
for _i, _expr in enumerate(_TESTS):
  _out = None
  if _loaded:
    try:
      _out = repr(eval(_expr, _ns))
    except BaseException:
      pass
  _sys.stdout.flush()
  _write(1, ("\\n" + _MARK + " " + _json.dumps([_i, _out]) + "\\n").encode())
"""


def extract_program(completion: str) -> str | None:
  """The last ```python block of `completion`, else all of it (None when
  empty)."""
  blocks = _FENCE.findall(completion)
  program = blocks[-1] if blocks else completion
  return program if program.strip() else None


def _literal(text):
  try:
    return True, ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return False, None


class CodeRunner:
  """Runs programs against tests in the sandbox: `passed(programs, tests)`
  -> per program the number of its tests that passed. A pool of sandbox
  calls, a cache of results; thread-safe."""

  def __init__(self, limits: SandboxLimits = LIMITS,
               workers: int | None = None):
    self.sandbox = PythonSandbox(limits)
    self.workers = workers or os.cpu_count() or 1
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._checked = False

  def check(self) -> None:
    """Refuses (`SandboxUnavailable`, one line) where the isolation cannot
    be set up: programs never run unprotected."""
    if not self._checked:
      self.sandbox.check()
      self._checked = True

  def outputs(self, source: str, tests: Sequence[str]) -> list[str | None]:
    """Each test expression's repr after `source` ran (None: it raised, or
    the program never got there), from the sandbox."""
    mark = "rlhf-jax-result-" + secrets.token_hex(8)
    obs = self.sandbox(_HARNESS.format(mark=mark, tests=list(tests),
                                       source=source))
    out: list[str | None] = [None] * len(tests)
    for line in obs.splitlines():
      if not line.startswith(mark + " "):
        continue
      try:
        index, text = json.loads(line[len(mark) + 1:])
      except (ValueError, TypeError):
        continue
      if isinstance(index, int) and 0 <= index < len(out) and out[index] is None:
        out[index] = text if isinstance(text, str) else None
    return out

  def _passed_one(self, source: str, tests: tuple) -> int:
    key = (source, tests)
    with self._lock:
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
    outputs = self.outputs(source, [expr for expr, _ in tests])
    passed = 0
    for out, (_, expected) in zip(outputs, tests):
      got_ok, got = _literal(out) if out is not None else (False, None)
      want_ok, want = _literal(expected)
      passed += bool(got_ok and want_ok and got == want)
    with self._lock:
      self._cache[key] = passed
      while len(self._cache) > _CACHE_SIZE:
        self._cache.popitem(last=False)
    return passed

  def passed(self, sources: Sequence[str | None],
             tests: Sequence[tuple]) -> list[int]:
    """Tests passed by each program (None: no program, 0); each distinct
    (program, tests) runs once."""
    self.check()
    keys = [(s, t) for s, t in zip(sources, tests)]
    todo = [k for k in dict.fromkeys(keys) if k[0] is not None]
    with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
      done = dict(zip(todo, pool.map(lambda k: self._passed_one(*k), todo)))
    return [done.get(k, 0) for k in keys]


@functools.cache
def runner() -> CodeRunner:
  """The process's runner (one cache for every reward call)."""
  return CodeRunner()


def _scores(completions, metadata, partial: bool) -> list[float]:
  sources, tests = [], []
  for c, m in zip(completions, metadata):
    program = extract_program(c)
    template = m.get("program_template", "{program}")
    sources.append(None if program is None
                   else template.replace("{program}", program))
    tests.append(tuple((str(e), str(x)) for e, x in m["tests"]))
  passed = runner().passed(sources, tests)
  return [(n / max(len(t), 1) if partial else float(n == len(t) > 0))
          for n, t in zip(passed, tests)]


@registry.register("reward", "code", answer=extract_program)
def code_passes(prompts: Sequence[str], completions: Sequence[str],
                metadata: Sequence[Mapping]) -> list[float]:
  """1.0 where the program passes every test of metadata["tests"] in the
  sandbox (module doc), else 0.0."""
  del prompts
  return _scores(completions, metadata, partial=False)


@registry.register("reward", "code_partial", answer=extract_program)
def code_partial(prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[Mapping]) -> list[float]:
  """The share of metadata["tests"] the program passes (partial credit)."""
  del prompts
  return _scores(completions, metadata, partial=True)

