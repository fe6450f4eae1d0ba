"""RLHF with PPO on a learned reward model: tiny model, addition prompts, CPU.

python -m rlhf_jax.main --config=configs/tiny_rm.py --workdir=workdirs/tiny_rm
python -m rlhf_jax.main --config=configs/tiny_ppo.py --workdir=workdirs/tiny_ppo
python -m rlhf_jax.main --config=configs/tiny_ppo.py:runlocal   # tests

The first command trains the reward model this job loads (from
`reward_model.workdir`). The policy is warm-started by a short SFT on the
same answer format the reward model learned (reversed digits); PPO then
maximises the reward-model score minus beta * KL to the post-SFT reference,
with a critic initialised from the reward model. The exact-match accuracy is
tracked, never trained on. The rollout layers compose as in GRPO:
`--config.rollout.long_tail.enabled=True`, `--config.rollout.workers.num=2`.
"""

import ml_collections

from configs import common
from rlhf_jax.data import sources
from rlhf_jax.data.tasks import AdditionTask
from rlhf_jax import typed_config
from rlhf_jax.config import sections


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, rm_workdir="workdirs/tiny_rm")
  c = ml_collections.ConfigDict()
  c.name = "tiny_ppo"
  c.job = "ppo"
  c.seed = 0

  c.model = common.tiny_model_config()
  c.mesh = common.mesh_config()
  c.reward_model = typed_config.config_dict(sections.RewardModel,
                                        workdir=arg.rm_workdir)

  # Must match configs/tiny_rm.py's answer format (checked at start).
  c.task = typed_config.config_dict(
      AdditionTask, max_digits=2, min_digits=1, reverse_answer=True,
      zero_pad=False, num_eval=200, holdout_fraction=0.1, seed=0)
  c.data = typed_config.config_dict(sources.AdditionData)

  common.rl_sections(
      c,
      rollout=dict(num_rows=32, samples_per_row=4, prefill_buckets=(8,),
                   max_new_tokens=4, max_seq_len=64),
      rl=dict(advantage="gae", policy_loss="ppo", clip_low=0.2,
              clip_high=0.2, kl_coef=0.1, kl_estimator="k1",
              kl_in_loss=False,          # InstructGPT: KL is a per-token reward.
              gamma=1.0, lam=0.95, whiten_advantages=True,
              value_clip=0.2,            # 0 = unclipped value loss.
              aggregation="token-mean", ppo_epochs=2, num_minibatches=2,
              micro_batches=1, share_prompt=False,
              tracked_rewards=("addition",)),  # Logged only.
      optim=dict(learning_rate=3e-4, warmup_steps=5, decay_steps=0,
                 end_lr_ratio=0.1, b1=0.9, b2=0.99, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=100, prompts_per_step=32, checkpoint_every=10,
                 keep_checkpoints=2),
      eval=dict(every=20, num_rows=40, batch_size=200),
      sft=dict(steps=500, batch_size=64, learning_rate=3e-3, warmup_steps=20,
               grad_clip=1.0, log_every=25))
  c.critic = typed_config.config_dict(
      sections.Critic, init="reward_model", optim=common.optim_config(
          learning_rate=1e-4, warmup_steps=5, decay_steps=0, end_lr_ratio=0.1,
          b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1.0))

  if arg.runlocal:
    common.shrink_addition_rl(c)
  return c
