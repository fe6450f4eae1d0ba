"""The tiny code task (`data/code_task.py`): each spec's program computes
what the spec says (checked by running it against an independent numpy
computation), held-out specs stay out of the train and SFT streams, and
every prompt, program and test is tokenizable and deterministic."""

import numpy as np
import pytest

from rlhf_jax.data import code_task
from rlhf_jax.data.code_task import SPECS, CodeTask
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import ConfigError


def numpy_value(spec, x):
  """The spec computed with numpy, apart from the task's code."""
  v = np.asarray(x, np.int64)
  keep = {"all": np.ones_like(v, bool), "pos": v > 0, "neg": v < 0,
          "big": v > 4, "small": v < -4}[spec.filt]
  mapped = {"+": v + spec.k, "-": v - spec.k, "*": v * spec.k}[spec.op][keep]
  return mapped.tolist() if spec.reduction == "list" else int(mapped.sum())


def test_every_program_computes_its_spec():
  rng = np.random.default_rng(0)
  lists = [[int(v) for v in rng.integers(-9, 10, n)] for n in (0, 1, 3, 5, 8)]
  assert len(SPECS) == 270 and len({s.prompt for s in SPECS}) == 270
  for spec in SPECS:
    f = eval("lambda x: " + spec.program)  # noqa: S307 (our own programs)
    for x in lists:
      assert f(x) == numpy_value(spec, x) == spec(x), (spec, x)


def test_held_out_specs_are_never_trained_on():
  task = CodeTask(seed=3)
  held = {s.prompt for s in task.heldout_specs}
  assert 0.05 < len(held) / len(SPECS) < 0.3
  seen = {task.train_example(i).prompt for i in range(2000)} | {
      task.sft_example(i).prompt for i in range(2000)}
  assert not seen & held
  assert len(seen) == len(SPECS) - len(held)  # Every other spec is trained.
  evals = task.eval_examples()
  assert [e.prompt for e in evals] == [s.prompt for s in task.heldout_specs]
  assert len({e.prompt_id for e in evals}) == task.num_eval


def test_examples_are_deterministic_tokenizable_and_tested_correctly():
  task = CodeTask()
  tok = CharTokenizer()
  a, b = task.train_example(17), CodeTask().train_example(17)
  assert a == b and a.prompt_id == 17
  for ex in [task.train_example(i) for i in range(50)] + task.eval_examples():
    assert len(tok.encode(ex.prompt, add_bos=True)) <= task.max_prompt_len
    assert len(tok.encode(ex.answer, add_eos=True)) <= task.max_response_len
    spec = next(s for s in SPECS if s.prompt == ex.prompt)
    assert len(ex.tests) == task.num_tests
    for expr, expected in ex.tests:
      x = eval(expr[2:-1])  # noqa: S307  "f([...])" -> the list.
      assert eval(expected) == numpy_value(spec, x)  # noqa: S307
    meta = ex.metadata()
    assert meta["program_template"] == code_task.TEMPLATE
    assert meta["answer"] == ex.answer == spec.program


def test_bad_knobs_are_one_line():
  with pytest.raises(ConfigError, match="holdout_fraction=0.9"):
    CodeTask(holdout_fraction=0.9)
