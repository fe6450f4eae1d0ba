"""The default job: GRPO on 2-digit addition with a tiny model, on CPU.

python -m rlhf_jax.main --config=configs/tiny_grpo.py --workdir=workdirs/tiny_grpo
python -m rlhf_jax.main --config=configs/tiny_grpo.py:runlocal   # seconds, tests

A short, deliberately limited SFT warm-start teaches the answer format and
part of the skill; GRPO (group-normalised advantages, clipped ratio, k3 KL to
the post-SFT reference) then raises held-out greedy accuracy.
"""

import ml_collections

from configs import common
from rlhf_jax.trainers import elastic, long_tail


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "tiny_grpo"
  c.job = "grpo"
  c.seed = 0

  c.model = common.tiny_model_config()
  c.mesh = common.mesh_config()

  c.task = ml_collections.ConfigDict(dict(
      max_digits=2, min_digits=1, reverse_answer=False, zero_pad=False,
      num_eval=200,
      holdout_fraction=0.1, seed=0))

  # Data source (rlhf_jax/trainers/sources.py): the addition task of c.task.
  c.data = ml_collections.ConfigDict(dict(kind="addition"))

  c.sft = ml_collections.ConfigDict(dict(
      steps=500, batch_size=64, learning_rate=3e-3, warmup_steps=20,
      grad_clip=1.0, log_every=25))

  c.rollout = ml_collections.ConfigDict(dict(
      num_rows=64, samples_per_row=8, prefill_buckets=(8,), max_new_tokens=4,
      max_seq_len=64, temperature=1.0, top_k=0, top_p=1.0,
      attention_impl="auto",
      # > 0: a token prefix all prompts of a batch share (system prompt,
      # chat template) is prefilled and stored once, up to this length.
      max_common_length=0,
      # Long-tail rollout (trainers/long_tail.py): length-aware rows, tail
      # consolidation, fused reward scoring, cost-aware replica count.
      long_tail=long_tail.default_config(),
      # Elastic rollout workers (trainers/elastic.py); 0 = trainer only.
      workers=elastic.default_config()))

  c.rl = ml_collections.ConfigDict(dict(
      advantage="grpo",          # grpo | drgrpo | rloo
      policy_loss="ppo",
      clip_low=0.2, clip_high=0.28,  # DAPO clip-higher.
      clip_c=0.0,                # Dual-clip constant; 0 = off.
      kl_coef=0.01, kl_estimator="k3", kl_in_loss=True,
      aggregation="token-mean",  # | seq-mean-token-mean | seq-mean-token-sum-norm
      ppo_epochs=1, num_minibatches=2, micro_batches=1,
      # Log-probs and training run each prompt once for its G responses
      # (rl/grouped.py); False repeats the prompt in every sequence.
      share_prompt=True,
      # DAPO: refill groups whose rewards are all equal from later prompt
      # batches (at most dynamic_max_rounds rollouts per step).
      dynamic_sampling=False, dynamic_max_rounds=3,
      # DAPO soft overlong penalty over the last overlong_buffer tokens of
      # rollout.max_new_tokens (0 = off).
      overlong_buffer=0, overlong_penalty=1.0,
      rewards=("addition", "digit_accuracy"), reward_weights=(1.0, 0.5),
      on_reward_error="raise",   # | "zero": score 0 and count rewards/errors.
  ))

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-4, warmup_steps=5, decay_steps=0, end_lr_ratio=0.1,
      b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1.0))

  c.train = ml_collections.ConfigDict(dict(
      steps=200, prompts_per_step=64, checkpoint_every=10, keep_checkpoints=2))
  c.eval = ml_collections.ConfigDict(dict(every=25, num_rows=40,
                                          batch_size=200))

  if arg.runlocal:
    common.shrink_addition_rl(c)
  return c
