"""GRPO on a tiny code task: a spec in, a Python expression out, run in the
sandbox against tests (the `code` reward), tiny model, CPU.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m rlhf_jax.main --config=configs/tiny_code.py --workdir=workdirs/tiny_code
python -m rlhf_jax.main --config=configs/tiny_code.py:runlocal   # tests

The task (`rlhf_jax/data/code_task.py`): "sum v*3 pos:" asks for
"sum(v*3 for v in x if v>0)"; held-out prompts are combinations of a
reduction, a map and a filter never trained on. A deliberately short
warm-start (30 steps) teaches part of the form: at 40 steps held-out
greedy accuracy was 0.70 and at 60 it was 1.0 before any RL, leaving RL
nothing to show; at 30 it is 0.16 (seed 0;
benchmarks/results/tiny_code_warmstart_trials_cpu.json). The reward is
"code" (every test passes) plus half of "code_partial" (the share of
tests passed), each program run once in the
sandbox (`rlhf_jax/rewards/code.py`); eval/accuracy is the held-out pass
rate at greedy, with pass@k and maj@k of 8 samples at temperature 1.
"""

import ml_collections

from configs import common
from rlhf_jax import typed_config
from rlhf_jax.data import sources
from rlhf_jax.data.code_task import CodeTask


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "tiny_code"
  c.job = "grpo"
  c.seed = 0

  c.model = common.tiny_model_config()
  c.mesh = common.mesh_config()
  c.task = typed_config.config_dict(CodeTask, seed=0, holdout_fraction=0.15,
                                    num_tests=4, max_list_len=5)
  c.data = typed_config.config_dict(sources.CodeData)

  common.rl_sections(
      c,
      rollout=dict(num_rows=32, samples_per_row=8, prefill_buckets=(16,),
                   max_new_tokens=28, max_seq_len=64),
      rl=dict(advantage="grpo", policy_loss="ppo",
              clip_low=0.2, clip_high=0.28,
              kl_coef=0.01, kl_estimator="k3", kl_in_loss=True,
              aggregation="token-mean", ppo_epochs=1, num_minibatches=2,
              micro_batches=1, share_prompt=True,
              rewards=("code", "code_partial"), reward_weights=(1.0, 0.5)),
      optim=dict(learning_rate=3e-4, warmup_steps=5, decay_steps=0,
                 end_lr_ratio=0.1, b1=0.9, b2=0.99, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=50, prompts_per_step=32, checkpoint_every=25,
                 keep_checkpoints=2),
      eval=dict(every=25, num_rows=43, batch_size=43, num_samples=8,
                temperature=1.0),
      sft=dict(steps=30, batch_size=64, learning_rate=1e-3, warmup_steps=20,
               grad_clip=1.0, log_every=25))

  if arg.runlocal:
    common.shrink_addition_rl(c)
    c.rollout.num_rows = 8
    c.eval.update(batch_size=43, num_rows=43)
  return c
