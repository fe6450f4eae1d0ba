"""Held-out evaluation at the job's eval steps.

Greedy: one response a held-out prompt; the algorithm's per-sample values
(`eval_values`: eval/accuracy, each reward's mean), averaged over every
prompt. With `eval.num_samples` = n also n responses a prompt at
`eval.temperature`, scored by the accuracy reward (the job's first, as
the greedy accuracy), reported as pass@k and maj@k for k = 1, 2, 4, ...
and n (`scoring/pass_at_k.py`); a response is correct with full marks
(reward >= 1), and maj@k votes with the reward's answer extraction
(`answer=` where it is registered; else the whole completion).
"""

from __future__ import annotations

import collections

import numpy as np

from rlhf_jax.rl import registry
from rlhf_jax.rollout.base import generate
from rlhf_jax.scoring import pass_at_k


def _whole_completion(text: str) -> str | None:
  return text.strip() or None


def evaluate(job, states: dict) -> dict:
  """The eval metrics of the policy in `states` (`rl_job.Job`'s)."""
  algo = job.algorithm
  params = states[algo.policy_key].params
  weights = job.colocation.rollout_copy(params)
  job.eval_rollout.set_weights(weights, 0)
  sampler = job.policy.sampled_eval_rollout
  if sampler is not None:
    sampler.set_weights(weights, 0)
  values = collections.defaultdict(list)
  correct, answers = [], []
  for prompts in job.source.eval_batches:
    sampled = generate(job.eval_rollout, prompts, 1, seed=0,
                       scorer=algo.eval_scorer)
    for name, v in algo.eval_values(sampled, states).items():
      values[name].append(np.asarray(v, np.float64))
    if sampler is not None:
      batch_correct, batch_answers = _sampled(job, sampler, prompts)
      correct.append(batch_correct)
      answers += batch_answers
  out = {name: float(np.mean(np.concatenate(v)))
         for name, v in values.items()}
  if sampler is not None:
    out.update(pass_at_k.metrics(np.concatenate(correct), answers))
  return out


def _sampled(job, sampler, prompts):
  """(correct [N, n] bool, each prompt's n extracted answers) of n
  responses to each of the batch's N prompts."""
  n = job.c.eval.num_samples
  sampled = generate(sampler, prompts, n, seed=0,
                     scorer=job.algorithm.eval_scorer)
  answer_of = registry.property_of("reward", job.c.rl.rewards[0], "answer",
                                   _whole_completion)
  tokenizer = job.source.tokenizer
  texts = [tokenizer.decode(s.tokens, stop_at_eos=not s.env_mask)
           for s in sampled.samples]
  found = [answer_of(t) for t in texts]
  return (np.asarray(sampled.rewards).reshape(-1, n) >= 1.0,
          [found[i:i + n] for i in range(0, len(found), n)])
