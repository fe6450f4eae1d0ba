"""GRPO with a calculator tool: 2-digit multiplication, tiny model, CPU.

python -m rlhf_jax.main --config=configs/tiny_tool.py --workdir=workdirs/tiny_tool
python -m rlhf_jax.main --config=configs/tiny_tool.py:notools --workdir=workdirs/tiny_notools
python -m rlhf_jax.main --config=configs/tiny_tool.py:runlocal   # seconds, tests

The tiny model cannot learn 2-digit products in a short warm-start, but it
can copy a calculator's answer. The SFT warm-start answers directly, and
in `task.tool_demo_fraction` of its examples calls the calculator first
("37*48=[calc 37*48](1776)1776"; the reply is the environment's, not
trained). Greedy decoding after it answers directly (the call is rarer
than the likeliest first digit); sampling calls the tool now and then,
the calls earn the reward, and GRPO turns the tool into the habit.
`:notools` is the ablation: every call answers "error: tools are
disabled". Multi-turn rollouts (`config.agent`, rlhf_jax/envs/) run on the
paged engine, the conversation's KV kept across turns.
"""

import ml_collections

from configs import common
from rlhf_jax.data import sources
from rlhf_jax.data.tasks import AdditionTask
from rlhf_jax import typed_config
from rlhf_jax.config import sections


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, notools=False)
  c = ml_collections.ConfigDict()
  c.name = "tiny_tool"
  c.job = "grpo"
  c.seed = 0

  c.model = common.tiny_model_config()
  c.mesh = common.mesh_config()

  c.task = typed_config.config_dict(
      AdditionTask, max_digits=2, min_digits=2, operator="*",
      reverse_answer=False, zero_pad=False, tool_demo_fraction=0.1,
      num_eval=200, holdout_fraction=0.1, seed=0)
  c.data = typed_config.config_dict(sources.AdditionData)

  common.rl_sections(
      c,
      rollout=dict(num_rows=64, samples_per_row=8, prefill_buckets=(8,),
                   max_new_tokens=32, max_seq_len=64),
      rl=dict(advantage="grpo", policy_loss="ppo",
              clip_low=0.2, clip_high=0.28,
              kl_coef=0.01, kl_estimator="k3", kl_in_loss=True,
              aggregation="token-mean", ppo_epochs=1, num_minibatches=2,
              micro_batches=1, share_prompt=True,
              rewards=("arithmetic",), reward_weights=(1.0,)),
      optim=dict(learning_rate=3e-4, warmup_steps=5, decay_steps=0,
                 end_lr_ratio=0.1, b1=0.9, b2=0.99, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=60, prompts_per_step=64, checkpoint_every=10,
                 keep_checkpoints=2),
      eval=dict(every=20, num_rows=40, batch_size=200),
      sft=dict(steps=500, batch_size=64, learning_rate=3e-3, warmup_steps=20,
               grad_clip=1.0, log_every=50))
  c.agent = typed_config.config_dict(
      sections.Agent, enabled=True, tools=("calc",), format="tagged",
      max_turns=3, disable_tools=arg.notools)

  if arg.runlocal:
    common.shrink_addition_rl(c)
  return c
