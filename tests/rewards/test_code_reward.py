"""The `code` reward (`rewards/code.py`): correct, wrong, crashing,
looping, memory-hungry and escaping programs each get the right score
within their limits; the pool keeps the order and runs a repeated program
once. Skips (fails under CI=true) where the sandbox cannot be set up,
as tests/envs/test_sandbox.py."""

import os
import tempfile
import textwrap
import time

import pytest

from rlhf_jax.envs.sandbox import SandboxLimits, SandboxUnavailable
from rlhf_jax.rewards import code
from rlhf_jax.rl import registry

# f(x) = the odd values of x, tripled; 4 tests, one of which ([]) any
# program returning [] passes.
TESTS = [["f([1, 2, 3])", "[3, 9]"], ["f([])", "[]"], ["f([-1, 4])", "[-3]"],
         ["f([5])", "[15]"]]
META = {"tests": TESTS}
LAMBDA = {"tests": TESTS, "program_template": "f = lambda x: {program}"}


@pytest.fixture(scope="module")
def runner():
  r = code.CodeRunner(SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256,
                                    max_procs=4, max_output_bytes=1 << 16))
  try:
    r.check()
  except SandboxUnavailable as e:
    if os.environ.get("CI") == "true":
      pytest.fail(f"CI=true, and the code reward cannot run: {e}")
    pytest.skip(str(e))
  return r


def scores(runner, programs, meta=META):
  tests = tuple((e, x) for e, x in meta["tests"])
  template = meta.get("program_template", "{program}")
  passed = runner.passed(
      [template.replace("{program}", textwrap.dedent(p)) for p in programs],
      [tests] * len(programs))
  return [n / len(tests) for n in passed]


def test_correct_wrong_and_partly_right(runner):
  assert scores(runner, [
      "def f(x):\n  return [3 * v for v in x if v % 2]\n",   # correct
      "def f(x):\n  return [3 * v for v in x]\n",            # [] and [5] only
      "def f(x):\n  return 'no'\n",                          # wrong type
      "def f(x):\n  return [3.0 * v for v in x if v % 2]\n",  # 3.0 == 3
      "def f(x):\n  return object()\n",                     # no literal
  ]) == [1.0, 0.5, 0.0, 1.0, 0.0]


def test_the_lambda_template_and_fenced_completions():
  """Through the registered rewards: the program is the last ```python
  block of the completion, or all of it."""
  fn, partial = (registry.get("reward", n) for n in ("code", "code_partial"))
  completions = ["[v*3 for v in x if v%2]",
                 "sure:\n```python\n[v for v in x]\n```\nthen\n```python\n"
                 "[3*v for v in x if v % 2 == 1]\n```",
                 "[v*3 for v in x]", "", "```python\n```"]
  try:
    got = fn([""] * 5, completions, [LAMBDA] * 5)
  except SandboxUnavailable as e:
    pytest.skip(str(e))
  assert got == [1.0, 1.0, 0.0, 0.0, 0.0]
  assert partial([""] * 5, completions, [LAMBDA] * 5) == [1.0, 1.0, 0.5, 0.0,
                                                         0.0]
  assert code.extract_program(completions[1]) == (
      "[3*v for v in x if v % 2 == 1]\n")


def test_crashing_programs(runner):
  assert scores(runner, [
      "raise RuntimeError('at import')\ndef f(x): return []\n",
      "def f(x):\n  return [3 * v for v in x if v % 2] if x else 1 / 0\n",
      "def f(x):\n  import os; os.abort()\n",
      "this is not python",
  ]) == [0.0, 0.75, 0.0, 0.0]


def test_a_looping_program_is_stopped_at_its_time_limit(runner):
  """The tests finished before the loop count; the rest fail; the call
  ends within the wall-clock limit (+ the sandbox's start)."""
  start = time.monotonic()
  got = scores(runner, ["""
      def f(x):
        if len(x) == 1:
          while True:
            pass
        return [3 * v for v in x if v % 2]
      """])
  assert got == [0.75]  # [5] loops; the other three ran first.
  assert time.monotonic() - start < 2.0 + 3.0


def test_a_memory_hog_gets_nothing_from_the_test_it_kills(runner):
  assert scores(runner, ["""
      def f(x):
        if not x:
          return [bytearray(1 << 30)]
        return [3 * v for v in x if v % 2]
      """]) == [0.75]


def test_escaping_programs_gain_nothing(runner):
  """Forging the result lines (the mark read from the harness), exiting
  before the tests, emptying the harness's test list, writing outside
  the sandbox or opening a connection: none scores above what the
  program computes honestly (here: returning [] passes 1 of 4)."""
  outside = tempfile.mkdtemp(prefix="code-reward-test-")
  os.chmod(outside, 0o777)
  target = os.path.join(outside, "escaped")
  forge = """
      import json, re, sys
      source = open(sys.argv[0] if sys.argv[0] else "main.py").read()
      mark = re.search(r"rlhf-jax-result-[0-9a-f]+", source).group(0)
      for i in range(4):  # Claims every test returned [].
        print(mark, json.dumps([i, "[]"]))
      def f(x):
        return None
      """
  programs = [
      forge,
      "import sys\nsys.exit(0)\ndef f(x): return [3 * v for v in x if v % 2]",
      "import __main__\n__main__._TESTS = []\ndef f(x): return []\n",
      f"open({target!r}, 'w').write('out')\ndef f(x): return []\n",
      "import socket\nsocket.create_connection(('127.0.0.1', 9), 1)\n"
      "def f(x): return [3 * v for v in x if v % 2]\n",
  ]
  try:
    got = scores(runner, programs)
  finally:
    escaped = os.path.exists(target)
    os.remove(target) if escaped else None
    os.rmdir(outside)
  assert not escaped
  # The forger's claim of [] is what returning [] earns: 1 of 4.
  assert got == [0.25, 0.0, 0.0, 0.0, 0.0]


def test_the_pool_keeps_order_and_runs_a_repeated_program_once():
  runner = code.CodeRunner(workers=2)
  try:
    runner.check()
  except SandboxUnavailable as e:
    pytest.skip(str(e))
  calls = []
  sandbox = runner.sandbox.__call__

  class Counting:
    def __call__(self, source):
      calls.append(source)
      return sandbox(source)

  runner.sandbox = Counting()
  right = "def f(x):\n  return [3 * v for v in x if v % 2]\n"
  wrong = "def f(x):\n  return []\n"
  programs = [right, wrong, right, None, wrong, right]
  tests = tuple(map(tuple, TESTS))
  assert runner.passed(programs, [tests] * 6) == [4, 1, 4, 0, 1, 4]
  assert len(calls) == 2  # One sandbox run per distinct program.
  assert runner.passed([right], [tests]) == [4] and len(calls) == 2
