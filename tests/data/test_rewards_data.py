"""Tokenizer, addition task, prompt iterator and reward scoring (host only)."""

import itertools
import re

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from rlhf_jax.data import batching
from rlhf_jax.data import sums
from rlhf_jax.data import tasks
from rlhf_jax.data import tokenizer as tok_lib
from rlhf_jax.scoring import host_rewards as scoring
from rlhf_jax.rewards import gsm8k, verifiable
from rlhf_jax.rl import registry

TOK = tok_lib.CharTokenizer()


def reward_batch(examples, completions):
  return scoring.RewardBatch(
      prompt_ids=[ex.prompt_id for ex in examples],
      prompts=[ex.prompt for ex in examples],
      completions=completions,
      metadata=[ex.metadata() for ex in examples],
  )


class TokenizerTest(absltest.TestCase):

  def test_special_ids_and_vocab(self):
    self.assertEqual((TOK.pad_id, TOK.bos_id, TOK.eos_id), (0, 1, 2))
    self.assertEqual(TOK.vocab_size, 3 + 10 + 22 + 52)
    # Digit d is id 3 + d: the table is a checkpoint format, pin it.
    self.assertEqual(TOK.encode("0123456789"), list(range(3, 13)))
    self.assertEqual(TOK.encode("+="), [13, 17])

  def test_round_trip(self):
    text = tok_lib.CHARS + " 12+345=753 Hello, world!"
    ids = TOK.encode(text, add_bos=True, add_eos=True)
    self.assertEqual(ids[0], 1)
    self.assertEqual(ids[-1], 2)
    self.assertLess(max(ids), TOK.vocab_size)
    self.assertEqual(TOK.decode(ids), text)
    self.assertEqual(TOK.decode(np.asarray(ids, np.int32)), text)

  def test_decode_stops_at_eos_and_skips_pad(self):
    ids = [1] + TOK.encode("42") + [2] + TOK.encode("7") + [0, 0]
    self.assertEqual(TOK.decode(ids), "42")
    self.assertEqual(TOK.decode(ids, stop_at_eos=False), "427")

  def test_unknown_id(self):
    self.assertEqual(TOK.decode([3, TOK.vocab_size]), "0\ufffd")
    with self.assertRaisesRegex(ValueError, f"Token id {TOK.vocab_size}"):
      TOK.decode([3, TOK.vocab_size], strict=True)

  def test_out_of_vocabulary_character(self):
    with self.assertRaisesRegex(ValueError, r"'é' at index 2 of '12é'"):
      TOK.encode("12é")

  def test_encode_batch(self):
    ids, lengths = TOK.encode_batch(["1+2=", "10+20="], 8)
    self.assertEqual(ids.shape, (2, 8))
    np.testing.assert_array_equal(lengths, [5, 7])
    np.testing.assert_array_equal(ids[0], [1, 4, 13, 5, 17, 0, 0, 0])
    with self.assertRaisesRegex(ValueError, "more than the padded length 4"):
      TOK.encode_batch(["10+20="], 4)


class AdditionTaskTest(parameterized.TestCase):

  def test_deterministic_in_seed(self):
    t1, t2 = tasks.AdditionTask(seed=3), tasks.AdditionTask(seed=3)
    other = tasks.AdditionTask(seed=4)
    for i in range(50):
      self.assertEqual(t1.train_example(i), t2.train_example(i))
      self.assertEqual(t1.sft_example(i), t2.sft_example(i))
    self.assertEqual(t1.eval_examples(), t2.eval_examples())
    self.assertNotEqual(
        [t1.train_example(i) for i in range(20)],
        [other.train_example(i) for i in range(20)],
    )
    self.assertNotEqual(t1.eval_examples(), other.eval_examples())

  @parameterized.parameters(True, False)
  def test_answers(self, reverse):
    task = tasks.AdditionTask(max_digits=3, reverse_answer=reverse)
    ex = task._example(12, 345, 0, "train")  # pylint: disable=protected-access
    self.assertEqual(ex.prompt, "12+345=")
    self.assertEqual(ex.answer, "753" if reverse else "357")
    for i in range(100):
      ex = task.train_example(i)
      digits = ex.answer[::-1] if reverse else ex.answer
      self.assertEqual(int(digits), ex.a + ex.b)
      self.assertEqual(ex.prompt, f"{ex.a}+{ex.b}=")

  def test_eval_split_disjoint_and_train_covers_the_rest(self):
    # 1-digit operands: 55 unordered problems. A generator that forgot to
    # reject held-out pairs would hit them within 3000 draws.
    task = tasks.AdditionTask(
        max_digits=1, num_eval=8, holdout_fraction=0.4, seed=1
    )
    every = {(a, b) for a in range(10) for b in range(a, 10)}
    heldout = {(a, b) for a, b in every if task.is_heldout_pair(a, b)}
    self.assertTrue(all(task.is_heldout_pair(b, a) for a, b in heldout))
    self.assertBetween(len(heldout), 12, 32)  # ~0.4 * 55
    eval_keys = {(min(e.a, e.b), max(e.a, e.b)) for e in task.eval_examples()}
    self.assertLen(eval_keys, 8)
    self.assertLessEqual(eval_keys, heldout)
    train = [task.train_example(i) for i in range(1500)]
    train += [task.sft_example(i) for i in range(1500)]
    train_keys = {(min(e.a, e.b), max(e.a, e.b)) for e in train}
    self.assertEqual(train_keys, every - heldout)

  def test_prompt_ids_unique_across_splits(self):
    task = tasks.AdditionTask(num_eval=64)
    ids = [task.train_example(i).prompt_id for i in range(64)]
    ids += [e.prompt_id for e in task.eval_examples()]
    self.assertLen(set(ids), 128)
    self.assertEqual(task.eval_examples()[0].prompt_id, tasks.EVAL_ID_OFFSET)

  def test_lengths_bound_and_reached(self):
    task = tasks.AdditionTask(max_digits=2)
    self.assertEqual((task.max_prompt_len, task.max_response_len), (7, 4))
    exs = [task.train_example(i) for i in range(2000)]
    prompt_lens = [len(TOK.encode(e.prompt, add_bos=True)) for e in exs]
    resp_lens = [len(TOK.encode(e.answer, add_eos=True)) for e in exs]
    self.assertEqual(max(prompt_lens), task.max_prompt_len)
    self.assertEqual(max(resp_lens), task.max_response_len)
    # Digit count is drawn first, so 1-digit operands are common (~1/2).
    one_digit = np.mean([e.a < 10 for e in exs])
    self.assertBetween(one_digit, 0.4, 0.6)

  def test_invalid_configs(self):
    with self.assertRaisesRegex(ValueError, "min_digits <= max_digits"):
      tasks.AdditionTask(min_digits=3, max_digits=2)
    with self.assertRaisesRegex(ValueError, r"num_eval=20 must be in \[1, 2\]"):
      tasks.AdditionTask(max_digits=1, num_eval=20)
    with self.assertRaisesRegex(ValueError, "holdout_fraction must be"):
      tasks.AdditionTask(holdout_fraction=0.0)


class SumsTest(absltest.TestCase):

  def test_prompts_answers_and_carries_by_hand(self):
    task = sums.Sums()
    evals = task.eval_examples()
    self.assertLen(evals, 200)
    for text, meta in evals + task.train_examples(300):
      match = re.fullmatch(r"What is (\d+)\+(\d)\? Answer with only the "
                           r"number\.", text)
      self.assertIsNotNone(match, text)
      a, b = (int(x) for x in match.groups())
      self.assertTrue(1 <= a <= 99 and 1 <= b <= 9, text)
      self.assertEqual(meta["answer"], a + b, text)
      # The ones carry; then the tens carry too when the sum reaches 100.
      self.assertEqual(meta["carries"], int(a % 10 + b >= 10) +
                       int(a + b >= 100), text)
    # Another shape says its own expression; carries counted by hand:
    # 47 + 85 + 9: ones 7+5+9 = 21 (carry 2), tens 4+8+2 = 14 (carry 1).
    task = sums.Sums(ranges=((10, 99), (10, 99), (1, 9)),
                     prompt="Add {expression}.")
    text, meta = task._render((47, 85, 9), 3)  # pylint: disable=protected-access
    self.assertEqual((text, meta), ("Add 47+85+9.", {
        "answer": 141, "prompt_id": 3, "carries": 2}))
    self.assertEqual([sums.carries(x) for x in ((45, 9), (12, 3), (99, 9),
                                                 (5, 5), (999, 1))],
                     [1, 0, 2, 1, 3])

  def test_splits_are_disjoint_by_multiset_and_deterministic(self):
    task = sums.Sums()
    evals = task.eval_examples()
    self.assertEqual(evals, sums.Sums().eval_examples())
    self.assertEqual([m["prompt_id"] for _, m in evals],
                     [sums.EVAL_ID_OFFSET + i for i in range(200)])
    self.assertLen({p for p, _ in evals}, 200)

    def multiset(text):
      return tuple(sorted(int(x) for x in re.findall(r"\d+", text)))
    held = {multiset(p) for p, _ in evals}
    train = task.train_examples(5000)
    self.assertEqual(train[:5], task.train_examples(5))
    self.assertFalse(held & {multiset(p) for p, _ in train})
    # 5000 draws reach every training sum, and every one of the 99 * 9
    # ordered pairs is in exactly one split.
    all_pairs = set(itertools.product(range(1, 100), range(1, 10)))
    heldout = {x for x in all_pairs if task.is_heldout(x)}
    self.assertLen({multiset(p) for p, _ in train},
                   len({tuple(sorted(x)) for x in all_pairs - heldout}))
    self.assertBetween(len(heldout) / len(all_pairs), 0.3, 0.5)
    # Both orders of a multiset fall on the same side.
    self.assertTrue(all(task.is_heldout((b, a)) == task.is_heldout((a, b))
                        for a, b in all_pairs if a <= 9))

  def test_bad_knobs_are_one_clear_error(self):
    with self.assertRaisesRegex(Exception, "task.holdout_fraction=0"):
      sums.Sums(holdout_fraction=0.0)
    with self.assertRaisesRegex(Exception, "task.num_eval=5000: the split"):
      sums.Sums(num_eval=5000)
    with self.assertRaisesRegex(Exception, "has no {expression}"):
      sums.Sums(prompt="What is it?")
    with self.assertRaisesRegex(Exception, "need two or more"):
      sums.Sums(ranges=((1, 9),))
    with self.assertRaisesRegex(Exception, "need two or more"):
      sums.Sums(ranges=((9, 1), (1, 9)))


class BatchingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.task = tasks.AdditionTask(max_digits=2, num_eval=10, seed=7)

  def test_prompt_batch_contents(self):
    it = batching.PromptIterator(self.task, TOK, batch_size=4)
    batch = next(it)
    self.assertEqual(batch.tokens_NxP.shape, (4, self.task.max_prompt_len))
    self.assertEqual(batch.tokens_NxP.dtype, np.int32)
    np.testing.assert_array_equal(batch.prompt_ids, [0, 1, 2, 3])
    for n in range(4):
      ex = self.task.train_example(n)
      self.assertEqual(batch.tokens_NxP[n, 0], tok_lib.BOS_ID)
      row = batch.tokens_NxP[n, : batch.lengths_N[n]]
      self.assertEqual(TOK.decode(row), ex.prompt)
      self.assertTrue(np.all(batch.tokens_NxP[n, batch.lengths_N[n] :] == 0))
      self.assertEqual(batch.metadata[n]["answer"], ex.answer)
    np.testing.assert_array_equal(next(it).prompt_ids, [4, 5, 6, 7])

  def test_iterator_resume(self):
    it = batching.PromptIterator(self.task, TOK, batch_size=3)
    for _ in range(3):
      next(it)
    state = it.get_state()
    self.assertEqual(state, {"next_index": 9, "seed": 7, "batch_size": 3})
    self.assertTrue(all(type(v) is int for v in state.values()))
    want = [next(it) for _ in range(2)]
    resumed = batching.PromptIterator(self.task, TOK, batch_size=3)
    # Values come back from checkpoints as numpy scalars.
    resumed.set_state({k: np.int64(v) for k, v in state.items()})
    got = [next(resumed) for _ in range(2)]
    for w, g in zip(want, got):
      np.testing.assert_array_equal(w.tokens_NxP, g.tokens_NxP)
      np.testing.assert_array_equal(w.prompt_ids, g.prompt_ids)
      self.assertEqual(w.metadata, g.metadata)
    self.assertEqual(resumed.get_state()["next_index"], 15)

  def test_resume_refuses_other_data_order(self):
    state = batching.PromptIterator(self.task, TOK, 3).get_state()
    other_seed = tasks.AdditionTask(max_digits=2, num_eval=10, seed=8)
    with self.assertRaisesRegex(ValueError, "seed=7.*seed=8"):
      batching.PromptIterator(other_seed, TOK, 3).set_state(state)
    with self.assertRaisesRegex(ValueError, "batch_size"):
      batching.PromptIterator(self.task, TOK, 4).set_state(state)

  def test_eval_batches(self):
    batches = batching.eval_batches(self.task, TOK, batch_size=4)
    self.assertEqual([len(b.prompts) for b in batches], [4, 4, 2])
    prompts = [p for b in batches for p in b.prompts]
    self.assertEqual(prompts, [e.prompt for e in self.task.eval_examples()])

  def test_sft_batch(self):
    batch = batching.sft_batch(self.task, TOK, start=5, batch_size=6)
    length = batching.sft_length(self.task)
    self.assertEqual(batch.inputs_BxL.shape, (6, length))
    np.testing.assert_array_equal(
        batch.inputs_BxL[:, 1:], batch.targets_BxL[:, :-1]
    )
    for row in range(6):
      ex = self.task.sft_example(5 + row)
      self.assertEqual(TOK.decode(batch.inputs_BxL[row]), ex.prompt + ex.answer)
      trained = batch.targets_BxL[row][batch.mask_BxL[row] == 1]
      self.assertEqual(list(trained), TOK.encode(ex.answer, add_eos=True))
      # The first trained target is predicted from the "=".
      first = int(np.argmax(batch.mask_BxL[row]))
      self.assertEqual(TOK.decode(batch.inputs_BxL[row, first : first + 1]),
                       "=")
    again = batching.sft_batch(self.task, TOK, start=5, batch_size=6)
    np.testing.assert_array_equal(batch.inputs_BxL, again.inputs_BxL)


class RewardFunctionsTest(parameterized.TestCase):

  def test_registered_names(self):
    self.assertEqual(
        registry.names("reward"),
        ["addition", "answer_line", "arithmetic", "code", "code_partial",
         "digit_accuracy", "digits_format", "env", "even_tokens", "exact_match", "gsm8k", "gsm8k_format",
         "last_number", "number_only"],
    )
    with self.assertRaisesRegex(ValueError, "known reward names: .*'exact_m"):
      registry.get("reward", "accuracy")

  def test_hand_checked(self):
    prompts = ["12+345="] * 4
    completions = ["753", "357", "75", "7533"]
    meta = [{"answer": "753", "reverse_answer": True}] * 4
    args = (prompts, completions, meta)
    self.assertEqual(verifiable.exact_match(*args), [1, 0, 0, 0])
    self.assertEqual(verifiable.addition_correct(*args), [1, 0, 0, 0])
    self.assertEqual(verifiable.digits_format(*args), [1, 1, 1, 1])
    self.assertEqual(
        verifiable.digits_format(prompts[:3], ["", "7a", "75330"], meta[:3]),
        [0, 0, 0],
    )
    self.assertEqual(verifiable.digit_accuracy(*args), [1, 1 / 3, 2 / 3, 3 / 4])

  def test_last_number_and_number_only_hand_checked(self):
    completions = ["45 + 9 = 54.", "The answer is 54", "54", " 54.\n",
                   "54 apples, not 55", "1,054", "-54", "", "fifty-four",
                   "5 4"]
    meta = [{"answer": 54}] * 9 + [{"answer": "#### 4"}]
    prompts = [""] * len(completions)
    self.assertEqual(gsm8k.last_number_correct(prompts, completions, meta),
                     [1, 1, 1, 1, 0, 0, 0, 0, 0, 1])
    self.assertEqual(gsm8k.number_only(prompts, completions, meta),
                     [0, 0, 1, 1, 0, 1, 1, 0, 0, 0])

  def test_answer_line_hand_checked(self):
    completions = ["9 + 8 = 17, 17 - 7 = 10.\nAnswer: 10", "Answer: 10.",
                   "answer:10\n\n", "The answer is 10", "Answer: ten",
                   "Answer: 10\nThanks!", "", "Answer: -3"]
    prompts, meta = [""] * 8, [{}] * 8
    self.assertEqual(gsm8k.answer_line(prompts, completions, meta),
                     [1, 1, 1, 0, 0, 0, 0, 1])

  @parameterized.parameters(True, False)
  def test_addition_agrees_with_task_answers(self, reverse):
    task = tasks.AdditionTask(max_digits=3, reverse_answer=reverse)
    exs = [task.train_example(i) for i in range(50)]
    batch = reward_batch(exs, [e.answer for e in exs])
    args = (batch.prompts, batch.completions, batch.metadata)
    self.assertEqual(verifiable.addition_correct(*args), [1.0] * 50)
    wrong = [str(int(e.answer) + 1) for e in exs]
    self.assertEqual(
        verifiable.addition_correct(batch.prompts, wrong, batch.metadata),
        [0.0] * 50,
    )


class ScoreTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    task = tasks.AdditionTask(seed=0)
    self.exs = [task.train_example(i) for i in range(4)]
    self.completions = [self.exs[0].answer, "x", self.exs[2].answer, "1"]

  def test_weighted_sum_and_metrics(self):
    batch = reward_batch(self.exs, self.completions)
    total, metrics = scoring.score(
        ["exact_match", "digits_format"], [1.0, 0.5], batch
    )
    self.assertEqual(total.dtype, np.float32)
    format_ok = [float(c.isdigit()) for c in self.completions]
    np.testing.assert_allclose(
        total, np.array([1, 0, 1, 0]) + 0.5 * np.array(format_ok)
    )
    self.assertEqual(metrics["rewards/errors"], 0)
    self.assertEqual(metrics["rewards/exact_match"], 0.5)

  def _flaky(self, bad_id):
    def flaky(prompts, completions, metadata):
      del prompts, completions
      if any(m["prompt_id"] == bad_id for m in metadata):
        raise KeyError("boom")
      return [1.0] * len(metadata)

    return flaky

  def test_raise_names_prompt_and_function(self):
    batch = reward_batch(self.exs, self.completions)
    with self.assertRaisesRegex(
        scoring.RewardError,
        r"Reward function 'flaky' failed on prompt id 2 .*KeyError: 'boom'",
    ) as ctx:
      scoring.score([self._flaky(2)], None, batch, on_error="raise")
    self.assertEqual(ctx.exception.fn_name, "flaky")
    self.assertEqual(ctx.exception.prompt_id, 2)
    self.assertIsInstance(ctx.exception.__cause__, KeyError)

  def test_zero_scores_only_failed_samples_and_counts(self):
    batch = reward_batch(self.exs, self.completions)
    total, metrics = scoring.score(
        [self._flaky(2), "exact_match"], [1.0, 1.0], batch, on_error="zero"
    )
    np.testing.assert_allclose(total, [2, 1, 1, 1])
    self.assertEqual(metrics["rewards/errors"], 1)
    self.assertEqual(metrics["rewards/flaky"], 0.75)

  def test_missing_metadata_key_names_prompt(self):
    batch = scoring.RewardBatch([17], ["1+2="], ["3"], [{"prompt_id": 17}])
    with self.assertRaisesRegex(
        scoring.RewardError, r"'exact_match' failed on prompt id 17 .*answer"
    ):
      scoring.score(["exact_match"], None, batch)

  def test_bad_return_values_are_errors(self):
    batch = reward_batch(self.exs, self.completions)

    def nan_on_x(prompts, completions, metadata):
      del prompts, metadata
      return [float("nan") if c == "x" else 1.0 for c in completions]

    def one_short(prompts, completions, metadata):
      del prompts, metadata
      return [1.0] * (len(completions) - 1)

    _, metrics = scoring.score([nan_on_x], None, batch, on_error="zero")
    self.assertEqual(metrics["rewards/errors"], 1)
    with self.assertRaisesRegex(scoring.RewardError, "id 1 .*non-finite"):
      scoring.score([nan_on_x], None, batch)
    with self.assertRaisesRegex(
        scoring.RewardError, r"'one_short' failed on prompt id 0 .*0 values"
    ):
      scoring.score([one_short], None, batch)

  def test_argument_errors(self):
    batch = reward_batch(self.exs, self.completions)
    with self.assertRaisesRegex(ValueError, "on_error must be one of"):
      scoring.score(["exact_match"], None, batch, on_error="ignore")
    with self.assertRaisesRegex(ValueError, "2 reward weights for 1"):
      scoring.score(["exact_match"], [1.0, 2.0], batch)
    with self.assertRaisesRegex(ValueError, "differ in length"):
      scoring.RewardBatch([1, 2], ["a"], ["b"], [{}])


if __name__ == "__main__":
  absltest.main()


def test_a_new_reward_module_is_found_without_editing_another(tmp_path,
                                                              monkeypatch):
  """The reward category is a package: a new file in it registers its
  rewards on first lookup (here a stand-in package with one new module)."""
  import sys

  pkg = tmp_path / "my_rewards"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "length.py").write_text(
      "from rlhf_jax.rl import registry\n"
      "@registry.register('reward', 'test_length')\n"
      "def length(prompts, completions, metadata):\n"
      "  return [float(len(c)) for c in completions]\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(registry.CATEGORIES, "reward", "my_rewards")
  monkeypatch.setitem(registry._ENTRIES, "reward", {})
  assert "my_rewards.length" not in sys.modules
  assert registry.get("reward", "test_length")([], ["abc"], [{}]) == [3.0]
  # The built-in package works the same way: gsm8k.py is imported by the
  # scan, no other module imports it.
  monkeypatch.undo()
  assert "gsm8k" in registry.names("reward")
