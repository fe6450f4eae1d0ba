"""tools/compile_profile.py: JAX's duration events charged to the test
running, merged over xdist workers, against sums done by hand."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "compile_profile", os.path.join(ROOT, "tools", "compile_profile.py"))
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)

_EVENT = "/jax/core/compile/"


def _worker(events):
  """A worker's record: `events` are (test or None, event, seconds, fun)."""
  rec = cp.Recorder()
  for test, event, seconds, fun in events:
    rec.test = test
    rec.on_duration(_EVENT + event, seconds, fun_name=fun)
    if test is not None:
      rec.add_wall(test, 1.0)
  rec.on_event("/jax/compilation_cache/cache_hits")
  rec.on_event("/jax/compilation_cache/tasks_using_cache")  # Not counted.
  return rec.record()


def test_events_are_charged_to_their_test_and_program_and_merge():
  a, b = "tests/x/test_a.py::t1", "tests/y/test_b.py::t2"
  gw0 = _worker([
      (a, "jaxpr_trace_duration", 0.5, "step"),
      (a, "jaxpr_to_mlir_module_duration", 0.25, "jit(step)"),
      (a, "backend_compile_duration", 2.0, "jit(step)"),
      (a, "backend_compile_duration", 1.0, "jit(step)"),
      (a, "some_other_duration", 9.0, "jit(step)"),  # Ignored.
  ])
  gw1 = _worker([
      (b, "backend_compile_duration", 4.0, "jit(step)"),
      (b, "backend_compile_duration", 0.5, "jit(init)"),
      (None, "backend_compile_duration", 0.125, "jit(init)"),
  ])
  merged = cp.merge([gw0, gw1])
  # By hand: test a traced 0.5, lowered 0.25, compiled 2 + 1 (2 compiles);
  # each test's wall is the 1.0 per event added above (5 for a).
  assert merged["tests"][a] == {"wall": 5.0, "trace": 0.5, "lower": 0.25,
                                "compile": 3.0, "compiles": 2}
  assert merged["tests"][b]["compile"] == 4.5
  assert merged["tests"]["(outside a test)"]["compile"] == 0.125
  assert merged["cache"] == {"cache_hits": 2}
  modules = cp.by_module(merged["tests"])
  assert modules["tests/x/test_a.py"]["compiles"] == 2
  assert modules["tests/y/test_b.py"]["wall"] == 2.0
  programs = {name: (counts, n) for name, counts, n
              in cp.by_program(merged["programs"])}
  # "step" (traced) and "jit(step)" (compiled) are one program, made in
  # two modules: 0.5 + 0.25 + 3 + 4 seconds, 3 compiles.
  assert programs["step"] == ({"compiles": 3, "trace": 0.5, "lower": 0.25,
                               "compile": 7.0}, 2)
  assert programs["init"][0]["compile"] == 0.625
  assert [name for name, _, _ in cp.by_program(merged["programs"])] == [
      "step", "init"]
  text = cp.report(merged)
  assert text.splitlines()[0].startswith("3 tests, 7.0 test-seconds")


def test_the_report_of_an_empty_directory_is_one_line(tmp_path, capsys):
  assert cp.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "no compile_profile_" in err
