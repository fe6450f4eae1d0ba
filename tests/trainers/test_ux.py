"""[ux] Bad input is one line and a non-zero exit: a mistyped key or
value, empty data, NaN in the warm-start (no checkpoint of it is kept).
The kill-and-resume, damaged- and wrong-shape-checkpoint tests of each job
are in test_grpo.py, test_ppo_trainer.py and test_rm.py."""

import os

import ml_collections
import pytest

from configs import tiny_grpo, tiny_rm
import resume
from resume import run_main
from rlhf_jax import cli
from rlhf_jax.data import jsonl, preferences
from rlhf_jax.errors import ConfigError, DataError, NonFiniteError
from rlhf_jax.trainers import rl_job, rm


# --------------------------------------------------------------- config keys
def test_unknown_key_names_the_full_path_and_the_closest_keys():
  c = tiny_grpo.get_config("runlocal")
  assert cli.unknown_key(c, "rollout.num_rows") is None
  assert cli.unknown_key(c, "rollout.num_row") == (
      "unknown config key config.rollout.num_row; did you mean "
      "config.rollout.num_rows or config.rollout.num_slots?")
  # A key of another section: where it lives.
  assert cli.unknown_key(c, "max_new_tokens") == (
      "unknown config key config.max_new_tokens; did you mean "
      "config.rollout.max_new_tokens?")
  nothing_close = cli.unknown_key(c, "rollout.nonexistent")
  assert nothing_close.startswith("unknown config key config.rollout."
                                  "nonexistent; keys of config.rollout: ")
  assert "num_rows" in nothing_close and "max_new_tokens" in nothing_close
  assert cli.unknown_key(c, "train.steps.every") == (
      "unknown config key config.train.steps.every: config.train.steps is "
      "a int value, not a section")


def test_typo_on_the_command_line_is_one_line_and_exit_2(tmp_path):
  workdir = tmp_path / "run"
  out = run_main(["--config=configs/tiny_grpo.py:runlocal",
               "--config.rollout.nonexistent=3", f"--workdir={workdir}"])
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr[-2000:]
  assert lines[0].startswith("error: unknown config key "
                             "config.rollout.nonexistent; keys of "
                             "config.rollout: ")
  assert not workdir.exists()  # Nothing ran.
  # A bad value is one line too.
  out = run_main(["--config=configs/tiny_grpo.py:runlocal",
               "--config.train.steps=many", f"--workdir={workdir}"])
  assert out.returncode == 2
  assert out.stderr.strip().startswith("error: ")
  assert "config.train.steps" in out.stderr
  assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- sampling
# (override, the one stderr line): each names the key and its allowed range.
BAD_SAMPLING = [
    ("temperature=-1", "config.rollout.temperature=-1.0: must be a finite "
     "number >= 0 (0: greedy)"),
    ("temperature=nan", "config.rollout.temperature=nan: must be a finite "
     "number >= 0 (0: greedy)"),
    ("temperature=inf", "config.rollout.temperature=inf: must be a finite "
     "number >= 0 (0: greedy)"),
    ("top_p=0", "config.rollout.top_p=0.0: must be in (0, 1] (1: off)"),
    ("top_p=1.5", "config.rollout.top_p=1.5: must be in (0, 1] (1: off)"),
    ("top_k=-1", "config.rollout.top_k=-1: must be an int in [0, "
     "vocab_size] (0: off)"),
    ("max_new_tokens=0", "config.rollout.max_new_tokens=0: must be an int "
     ">= 1"),
    ("samples_per_row=0", "config.rollout.samples_per_row=0: must be a "
     "positive int"),
]


def test_bad_sampling_on_the_command_line_is_one_line_and_exit_2(tmp_path):
  """The real CLI once (an import and a backend start, ~6 s); the other
  values go through the same error path in-process (below)."""
  workdir = tmp_path / "run"
  out = run_main(["--config=configs/tiny_grpo.py:runlocal",
                  "--config.rollout.temperature=-1", f"--workdir={workdir}"])
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  # absl's INFO lines (the devices) may come first; the error is the one
  # line of its own, last.
  lines = out.stderr.strip().splitlines()
  assert [x for x in lines if x.startswith("error:")] == lines[-1:] == [
      "error: " + BAD_SAMPLING[0][1]], out.stderr[-2000:]
  assert not workdir.exists()  # Stopped before the job wrote anything.


@pytest.mark.parametrize("override,message", BAD_SAMPLING + [
    # Above the vocabulary: known from the model's config, before its
    # weights are built (`trainers/policy.build`).
    ("top_k=1000000", "config.rollout.top_k=1000000: must be an int in "
     "[0, vocab_size={vocab}] (0: off)"),
])
def test_bad_sampling_is_one_line_and_exit_2(override, message, tmp_path,
                                             capsys):
  """`main`'s error path in-process: the job under `cli.user_errors`."""
  from rlhf_jax import trainers
  from rlhf_jax.data.tokenizer import CharTokenizer

  key, value = override.split("=")
  c = tiny_grpo.get_config("runlocal")
  c.rollout[key] = type(c.rollout[key])(value)
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as exit_, cli.user_errors(verbose=False):
    trainers.run(c, str(workdir))
  assert exit_.value.code == 2
  vocab = CharTokenizer().vocab_size  # tiny_grpo's addition task.
  assert capsys.readouterr().err == (
      "error: " + message.format(vocab=vocab) + "\n")
  assert not workdir.exists()


def test_top_k_above_the_vocabulary_stops_the_generation_demo():
  # The demo builds its engine from the section (no job's policy build):
  # the check runs there too, before any engine exists.
  from rlhf_jax.config import sections
  from rlhf_jax.errors import ConfigError
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.rollout import build as rollout_build

  with pytest.raises(ConfigError, match=r"^config\.rollout\.top_k=65: "
                     r"must be an int in \[0, vocab_size=64\] \(0: off\)$"):
    rollout_build.engines(sections.Rollout(top_k=65),
                          ModelConfig.tiny(vocab_size=64), None, None)


@pytest.mark.parametrize("override", [
    "top_p=1", "top_p=1e-6", "top_k=0", "temperature=0"])
def test_sampling_bounds_are_allowed(override):
  # top_p in (0, 1] (1: off), top_k = 0: off, temperature = 0: greedy.
  from rlhf_jax.config import sections

  key, value = override.split("=")
  ro = sections.Rollout(**{key: type(getattr(sections.Rollout, key))(
      value)})
  ro.check_sampling(vocab_size=64)


# ------------------------------------------------------------------ data
def test_empty_dataset_is_one_clear_error(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(DataError, match=f"^{empty} has no records$"):
    jsonl.load_examples(str(empty), {"prompt": "question"})
  with pytest.raises(DataError, match="has no records"):
    preferences.load_jsonl(str(empty))
  # The reward-model job with it: stops in its build, before any output.
  c = tiny_rm.get_config("runlocal")
  c.data.kind, c.data.train_path = "jsonl", str(empty)
  with pytest.raises(DataError, match="has no records"):
    rm.run(c, str(tmp_path / "rm"))
  assert not (tmp_path / "rm" / "checkpoints").exists()


def test_data_and_task_sections_are_typed_by_kind():
  """`config.data` and `config.task` become the kind's sections: a key the
  kind does not know is one line naming it, an unknown kind lists the
  known ones, a key left out takes its default."""
  from rlhf_jax.config.sections import RLJob
  from rlhf_jax.data import sources
  from rlhf_jax.data.tasks import AdditionTask

  c = tiny_grpo.get_config("runlocal")
  job = RLJob.from_config(c)
  assert isinstance(job.data, sources.AdditionData)
  assert job.task == AdditionTask(**c.task)
  with c.unlocked():
    c.task.colour = "red"
  with pytest.raises(ConfigError, match=r"^config\.task\.colour is not a "
                     r"known key; known: \['max_digits'"):
    RLJob.from_config(c)
  c = tiny_grpo.get_config("runlocal")
  c.data.kind = "csv"
  with pytest.raises(ConfigError, match=r"^config\.data\.kind='csv' is "
                     r"unknown; known: \['addition', 'code', 'jsonl', "
                     r"'random_tokens', 'sums'\]$"):
    RLJob.from_config(c)
  # A hand-written section of a few keys: the rest at their defaults.
  from rlhf_jax.data.preferences import PreferenceData, sections_of
  data, task = sections_of(ml_collections.ConfigDict(
      {"data": {"kind": "jsonl", "train_path": "pairs.jsonl"}}))
  assert data == PreferenceData(kind="jsonl", train_path="pairs.jsonl")
  assert task is None
  with pytest.raises(ConfigError, match=r"^config\.data\.train_path='': is "
                     "empty"):
    sections_of(ml_collections.ConfigDict({"data": {"kind": "jsonl"}}))
  # A reward model trained before the "synthetic" kind was named
  # "addition" still loads into PPO; a new config may not use the old name.
  old = ml_collections.ConfigDict({"data": {"kind": "synthetic"}})
  assert sections_of(old, saved=True)[0].kind == "addition"
  with pytest.raises(ConfigError, match="kind='synthetic': must be one of"):
    sections_of(old)


# ------------------------------------------------------------------ NaN
def test_nan_in_sft_stops_before_saving_it(tmp_path):
  workdir = str(tmp_path / "run")
  config = resume.override(tiny_grpo.get_config("runlocal"), **{
      "sft.steps": 3, "sft.log_every": 1, "sft.checkpoint_every": 1,
      "sft.learning_rate": float("inf")})
  with pytest.raises(NonFiniteError, match="non-finite SFT loss at step 2"):
    rl_job.run(config, workdir)
  # Step 1 (finite: computed before the first update) is the one kept.
  assert os.listdir(os.path.join(workdir, "checkpoints_sft")) == ["1"]
