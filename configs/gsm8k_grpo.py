"""GRPO on GSM8K from a local Qwen2.5-0.5B-Instruct checkpoint.

python -m rlhf_jax.main --config=configs/gsm8k_grpo.py \
    --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct \
    --config.data.path=/data/gsm8k/train.jsonl \
    --workdir=workdirs/gsm8k_grpo
python -m rlhf_jax.main --config=configs/gsm8k_grpo.py:runlocal \
    --workdir=/tmp/gsm8k_runlocal   # CPU, tiny random Qwen2, ~1 minute

Both paths are local (nothing is downloaded): an HF checkpoint directory
(config.json, *.safetensors, tokenizer.json, tokenizer_config.json) and a
JSONL / Parquet file with GSM8K's "question" / "answer" fields (see
docs/checkpoints.md). Optional `--config.data.eval_path=/data/gsm8k/test.jsonl`
evaluates on its first `eval.num_prompts` records; without it those records
of the train file are held out. Rewards: "gsm8k" (final answer after "####"
or in \\boxed{}) and a small "gsm8k_format" bonus; eval/accuracy is greedy
"gsm8k" accuracy. No SFT warm-start: the instruct model already follows the
format instruction.

`runlocal` writes a tiny random Qwen2 checkpoint (QKV bias, tied
embeddings, BPE tokenizer with a ChatML template) and a synthetic
GSM8K-format JSONL to <workdir>/runlocal_assets, then runs 2 GRPO steps
through the same code path.
"""

import ml_collections

from configs import common
from rlhf_jax import typed_config
from rlhf_jax.data import sources
from rlhf_jax.data import synthetic_gsm8k


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "gsm8k_grpo"
  c.job = "grpo"
  c.seed = 0

  c.model = common.model_config("qwen2.5-0.5b")  # preset unused with path.
  c.model.path = ""              # Required: local HF checkpoint directory.
  c.model.param_dtype = "float32"   # fp32 master weights for the optimizer.
  c.model.compute_dtype = "bfloat16"
  c.mesh = common.mesh_config()

  c.data = typed_config.config_dict(
      sources.JsonlData,
      path="",                   # Required: GSM8K-format .jsonl / .parquet.
      eval_path="",              # Optional; "" = hold out eval.num_prompts.
      fields=dict(prompt="question", answer="answer"),
      template="{prompt}\n" + synthetic_gsm8k.INSTRUCTION,
      system_prompt="",          # "" = the chat template's default.
      use_chat_template=True,
      max_prompt_len=256,        # Padded prompt length; longer ones dropped.
      seed=0, shuffle=True,
      synthetic=False)           # runlocal: build tiny assets in workdir.

  common.rl_sections(
      c,
      # max_common_length > 0: the prefix every prompt of a batch shares
      # (the chat template's system turn) is prefilled and stored once.
      # Long responses of uneven lengths: the paged engine reuses a finished
      # sample's slot and pages at once.
      rollout=dict(num_rows=64, samples_per_row=8, prefill_buckets=(128, 256),
                   max_new_tokens=384, max_seq_len=640, max_common_length=64),
      rl=dict(advantage="grpo", policy_loss="ppo",
              clip_low=0.2, clip_high=0.28, kl_coef=0.001,
              kl_estimator="k3", kl_in_loss=True, aggregation="token-mean",
              ppo_epochs=1, num_minibatches=4, micro_batches=4,
              share_prompt=True, rewards=("gsm8k", "gsm8k_format"),
              reward_weights=(1.0, 0.1), on_reward_error="zero"),
      optim=dict(learning_rate=1e-6, warmup_steps=10, decay_steps=0,
                 end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0,
                 grad_clip=1.0),
      train=dict(steps=200, prompts_per_step=64, checkpoint_every=20,
                 keep_checkpoints=2),
      eval=dict(every=20, num_rows=64, batch_size=256, num_prompts=256),
      # No SFT warm-start: the instruct model follows the format already.
      sft=dict(steps=0, batch_size=64, learning_rate=1e-5, warmup_steps=0,
               grad_clip=1.0, log_every=25))

  if arg.runlocal:
    c.data.synthetic = True
    c.data.max_prompt_len = 64
    c.model.compute_dtype = "float32"
    c.rollout.update(num_rows=8, samples_per_row=4, prefill_buckets=(64,),
                     max_new_tokens=16, max_seq_len=80)
    c.rl.update(num_minibatches=1, micro_batches=1)
    c.optim.update(learning_rate=1e-4, warmup_steps=0)
    c.train.update(steps=2, prompts_per_step=8, checkpoint_every=2)
    c.eval.update(every=2, num_rows=8, batch_size=8, num_prompts=8)
  return c
