"""Reward model: Bradley-Terry math, loss decrease on a toy set, the rm job."""

import json
import math
import os
import tempfile

from absl.testing import absltest
import pytest
import jax
import numpy as np

import resume

from configs import tiny_rm
from rlhf_jax import trainers
from rlhf_jax.data import preferences
from rlhf_jax.data.tasks import AdditionTask
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.models import reward_model
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import objectives
from rlhf_jax.rl import preference
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer


def _tempdir(test):
  """A fresh directory, removed when `test` ends, passed or failed.

  Not absltest's `create_tempdir`: under pytest absl's flags are unparsed
  (it raises UnparsedFlagAccessError), and it would leave its
  $TMPDIR/absl_testing parent behind."""
  tmp = tempfile.TemporaryDirectory(prefix="test_rm-")
  test.addCleanup(tmp.cleanup)
  return tmp.name


def _toy_arrays(tokenizer, n):
  """Separable pairs: chosen ends in 'a', rejected in 'b'."""
  rng = np.random.default_rng(0)
  pairs = [preferences.Pair(f"{rng.integers(100)}=", "a", "b")
           for _ in range(n)]
  return preferences.encode_pairs(pairs, tokenizer, 8)


class BradleyTerryTest(absltest.TestCase):

  def test_hand_checked(self):
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617; with margin 1: log 2.
    loss = preference.bradley_terry_loss(np.array([2.0, 0.0]),
                                         np.array([1.0, 0.0]))
    np.testing.assert_allclose(loss, [math.log1p(math.exp(-1)), math.log(2)],
                               rtol=1e-6)
    loss = preference.bradley_terry_loss(np.array([2.0]), np.array([1.0]),
                                         np.array([1.0]))
    np.testing.assert_allclose(loss, [math.log(2)], rtol=1e-6)
    np.testing.assert_array_equal(
        preference.pair_accuracy(np.array([2.0, 0.0]), np.array([1.0, 0.0])),
        [1.0, 0.0])

  def test_loss_decreases_on_separable_toy_set(self):
    tok = CharTokenizer()
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, num_layers=1,
                           embed_dim=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64)
    layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1))
    graphdef, params = reward_model.init_params(cfg, 0, layout)
    terms, weight = objectives.reward_model_terms()
    learner = Learner(graphdef, layout, make_optimizer(OptimConfig(
        learning_rate=3e-3)), terms_fn=terms, weight_fn=weight,
                      micro_batches=2)
    state = learner.init_state(params)
    batch = learner.put_batch(_toy_arrays(tok, 16))
    losses = []
    for _ in range(15):
      state, metrics = learner.step(state, batch)
      losses.append(metrics)
    losses = [float(m["loss"]) for m in jax.device_get(losses)]
    self.assertAlmostEqual(losses[0], math.log(2), places=5)  # Zero head.
    self.assertLess(losses[-1], 0.5 * losses[0])
    self.assertEqual(float(jax.device_get(metrics["pair_accuracy"])), 1.0)

  def test_score_reads_last_real_token(self):
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(reward_model.last_index(mask), [2, 0, 0])


class DataTest(absltest.TestCase):

  def test_synthetic_pairs(self):
    task = AdditionTask(num_eval=50)
    pairs = preferences.synthetic_train_pairs(task, 0, 200, max_offset=0,
                                              seed=0)
    for p in pairs:
      a, b = map(int, p.prompt[:-1].split("+"))
      self.assertEqual(int(p.chosen[::-1]), a + b)
      self.assertNotEqual(int(p.rejected[::-1]), a + b)
    near = preferences.synthetic_train_pairs(task, 0, 200, max_offset=2,
                                             seed=0)
    for p in near:
      self.assertBetween(abs(int(p.rejected[::-1]) - int(p.chosen[::-1])),
                         1, 2)
    one_digit = preferences.synthetic_train_pairs(task, 0, 200, max_offset=0,
                                                  seed=0, near_miss=1.0)
    for p in one_digit:
      right, wrong = str(int(p.chosen[::-1])), str(int(p.rejected[::-1]))
      self.assertEqual(len(right), len(wrong))  # No leading zero made.
      self.assertEqual(sum(x != y for x, y in zip(right, wrong)), 1)
    evals = preferences.synthetic_eval_pairs(task, max_offset=0, seed=0)
    self.assertLen(evals, 50)
    self.assertEmpty({p.prompt for p in evals} & {p.prompt for p in pairs})

  def test_jsonl(self):
    path = os.path.join(_tempdir(self), "p.jsonl")
    with open(path, "w") as f:
      for i in range(10):
        f.write(json.dumps({"prompt": f"{i}=", "chosen": "a",
                            "rejected": "b"}) + "\n")
    train, evals = preferences.split_holdout(preferences.load_jsonl(path),
                                             0.2, 0)
    self.assertLen(train, 8)
    self.assertLen(evals, 2)


@pytest.mark.slow
class RmJobTest(absltest.TestCase):

  def test_runlocal_trains_evaluates_and_resumes_after_sigterm(self):
    config = tiny_rm.get_config("runlocal")
    config.train.steps = 4  # Checkpoints at 3 and 4, evals at 0, 3, 4.
    reference = _tempdir(self)
    trainers.run(config, reference)
    records = resume.records(reference)
    evals = {step: r for (_, step), r in records.items()
             if "rm/pair_accuracy" in r}
    self.assertEqual(sorted(evals), [0, 3, 4])
    self.assertTrue(all(np.isfinite(r["rm/loss"]) for r in evals.values()))
    self.assertTrue(os.path.isdir(os.path.join(reference, "checkpoints",
                                               "4")))
    # SIGTERM after step 0's eval: the run checkpoints the step it is in
    # and stops; the rerun continues from there and writes the
    # uninterrupted run's metrics.
    workdir = _tempdir(self)
    with resume.SigtermWhen(lambda: resume.has_record(workdir, "rm", 0)
                            ) as sigterm:
      trainers.run(config, workdir)
    self.assertTrue(sigterm.sent)
    saved = [int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))]
    self.assertTrue(saved)
    self.assertLess(max(saved), 4)  # Stopped early, checkpointed.
    state = trainers.run(config, workdir)
    self.assertEqual(int(jax.device_get(state.step)), 4)
    resume.assert_same_records(resume.records(workdir), records)


if __name__ == "__main__":
  absltest.main()
