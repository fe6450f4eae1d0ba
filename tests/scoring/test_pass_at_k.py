"""pass@k and maj@k (`scoring/pass_at_k.py`) against a brute-force count
over every draw of k responses and hand-checked votes."""

import itertools

import numpy as np
import pytest

from rlhf_jax.rl import registry
from rlhf_jax.scoring import pass_at_k


def brute_pass_at_k(correct, k):
  """The share of the k-subsets of `correct` holding a correct one."""
  draws = list(itertools.combinations(correct, k))
  return sum(any(d) for d in draws) / len(draws)


@pytest.mark.parametrize("n,c", [(8, 0), (8, 1), (8, 3), (8, 7), (8, 8),
                                 (5, 2), (1, 1), (1, 0)])
def test_pass_at_k_equals_the_count_over_every_draw(n, c):
  correct = [True] * c + [False] * (n - c)
  for k in range(1, n + 1):
    assert pass_at_k.pass_at_k(n, c, k) == pytest.approx(
        brute_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_by_hand_and_bad_arguments():
  # n = 4, c = 1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6.
  assert pass_at_k.pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert pass_at_k.pass_at_k(4, 1, 2) == pytest.approx(0.5)
  for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
    with pytest.raises(ValueError, match="pass@k needs"):
      pass_at_k.pass_at_k(n, c, k)


def test_majority_vote_ties_go_to_the_answer_seen_first():
  # 2 votes each: "3" came first, and is wrong.
  assert not pass_at_k.majority_correct(["3", "5", "5", "3"],
                                        [False, True, True, False])
  assert pass_at_k.majority_correct(["5", "3", "3", "5"],
                                    [True, False, False, True])
  # A majority beats the first answer; no answer does not vote.
  assert pass_at_k.majority_correct(["3", None, "5", None, "5"],
                                    [False, False, True, False, True])
  assert not pass_at_k.majority_correct([None, None], [True, True])


def test_metrics_per_k_on_a_fixed_set():
  """Three prompts, four responses each, by hand."""
  correct = np.array([[1, 0, 0, 0],    # c = 1
                      [0, 0, 0, 0],    # c = 0
                      [1, 1, 0, 1]],   # c = 3
                     bool)
  answers = [["12", "21", "21", "7"],  # maj "21" (wrong); maj@1 "12" right.
             ["1", None, "1", "2"],    # maj "1" (wrong).
             ["9", "9", "8", "9"]]     # maj "9" (right).
  m = pass_at_k.metrics(correct, answers)
  assert sorted(m) == sorted(f"eval/{kind}_at_{k}" for kind in ("pass", "maj")
                             for k in (1, 2, 4))
  # pass@1 = mean c / n; pass@2 = mean of 1 - C(n-c,2)/C(4,2).
  assert m["eval/pass_at_1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
  assert m["eval/pass_at_2"] == pytest.approx((1 - 3 / 6 + 0 + 1) / 3)
  assert m["eval/pass_at_4"] == pytest.approx(2 / 3)
  # maj@1: the first response; maj@2: a tie, the first; maj@4: the vote.
  assert m["eval/maj_at_1"] == pytest.approx(2 / 3)
  assert m["eval/maj_at_2"] == pytest.approx(2 / 3)
  assert m["eval/maj_at_4"] == pytest.approx(1 / 3)


def test_the_ks_reported():
  assert [pass_at_k.ks_up_to(n) for n in (1, 2, 5, 8, 12)] == [
      [1], [1, 2], [1, 2, 4, 5], [1, 2, 4, 8], [1, 2, 4, 8, 12]]


def test_rewards_name_their_answer_extraction():
  gsm8k = registry.property_of("reward", "gsm8k", "answer")
  assert gsm8k("so 6 * 7 = 42 #### 42") == 42.0
  assert gsm8k("no answer") is None
  final = registry.property_of("reward", "arithmetic", "answer")
  assert final("[3+4](7)7") == "7"
  assert final("[3+4](7)") is None  # A call and no answer.
  assert registry.property_of("reward", "addition", "answer") is None
