"""GRPO at real shapes on random tokens: a model preset, random weights.

python -m rlhf_jax.main --config=configs/synthetic_grpo.py --workdir=workdirs/synthetic
python -m rlhf_jax.main --config=configs/synthetic_grpo.py:preset=qwen2.5-7b,prompt_len=2048,new_tokens=4096 --workdir=...
python -m benchmarks.grpo_step --config=configs/synthetic_grpo.py   # per-phase seconds
python -m rlhf_jax.main --config=configs/synthetic_grpo.py:runlocal   # CPU, seconds

What a step costs at a size, with nothing to download: Qwen2.5-1.5B shapes
by default (fp32 master, bf16 compute, scanned layers, remat "dots"), 16
prompts of 1k-2k random tokens x G=16 samples decoded to 1024 tokens on the
paged engine, then the policy update. Prompts and the "even_tokens" reward
come from `data/random_tokens.py`: a random model rarely samples <eos>, so
responses run to the cap. Arguments: preset, prompt_len (the longest
prompt; the shortest is half), new_tokens, samples (G), prompts (per step),
steps, attention_block (the chunked attention's block, `ModelConfig`; 512,
what ran the whole step on an H200, docs/results.md), runlocal (the tiny
model, a few tokens: tests).
"""

import ml_collections

from configs import common
from rlhf_jax import typed_config
from rlhf_jax.data.random_tokens import RandomTokensData
from rlhf_jax.models.config import ModelConfig


def get_config(arg=None):
  small = "runlocal" in (arg or "").split(",")  # Its defaults, then args.
  arg = common.parse_arg(
      arg, runlocal=False, preset="qwen2.5-1.5b",
      prompt_len=16 if small else 2048, new_tokens=24 if small else 1024,
      samples=4 if small else 16, prompts=8 if small else 16,
      steps=2 if small else 10, attention_block=512)
  c = ml_collections.ConfigDict()
  c.name = "synthetic_grpo"
  c.job = "grpo"
  c.seed = 0
  if arg.runlocal:
    c.model = common.tiny_model_config()
    vocab = 512
  else:
    c.model = common.model_config(arg.preset, param_dtype="float32",
                                  compute_dtype="bfloat16", remat="dots",
                                  attention_block=arg.attention_block)
    vocab = ModelConfig.preset(arg.preset).vocab_size
  c.mesh = common.mesh_config()
  c.data = typed_config.config_dict(
      RandomTokensData, vocab_size=vocab,
      min_prompt_len=arg.prompt_len // 2, max_prompt_len=arg.prompt_len,
      seed=0)
  seqs = arg.prompts * arg.samples
  common.rl_sections(
      c,
      rollout=dict(num_rows=arg.prompts, samples_per_row=arg.samples,
                   prefill_buckets=(arg.prompt_len,),
                   max_new_tokens=arg.new_tokens,
                   max_seq_len=arg.prompt_len + arg.new_tokens),
      # A micro-batch of ~16 sequences: 32k tokens at the default lengths.
      rl=dict(advantage="grpo", policy_loss="ppo", clip_low=0.2,
              clip_high=0.28, kl_coef=0.001, kl_estimator="k3",
              kl_in_loss=True, aggregation="token-mean", ppo_epochs=1,
              num_minibatches=1, micro_batches=max(1, seqs // 16),
              share_prompt=True, rewards=("even_tokens",),
              reward_weights=(1.0,)),
      optim=dict(learning_rate=1e-2 if arg.runlocal else 1e-6,
                 warmup_steps=0, decay_steps=0, end_lr_ratio=1.0, b1=0.9,
                 b2=0.999, weight_decay=0.0, grad_clip=1.0),
      # Checkpoints and eval only at the end of the run.
      train=dict(steps=arg.steps, prompts_per_step=arg.prompts,
                 checkpoint_every=arg.steps, keep_checkpoints=1),
      eval=dict(every=arg.steps, num_rows=arg.prompts,
                batch_size=arg.prompts),
      sft=dict(steps=0))
  if arg.runlocal:
    c.model.compute_dtype = "float32"
    c.rl.micro_batches = 1
  return c
