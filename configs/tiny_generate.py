"""Generation demo on a random tiny model: paged engine throughput.

python -m rlhf_jax.main --config=configs/tiny_generate.py
python -m rlhf_jax.main --config=configs/tiny_generate.py:runlocal
"""

import ml_collections

from configs import common
from rlhf_jax import typed_config
from rlhf_jax.config import sections


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "tiny_generate"
  c.job = "generate"
  c.seed = 0
  c.model = common.model_config("tiny")
  c.mesh = common.mesh_config()
  c.num_prompts = 32
  c.prompt_len = 48
  c.rollout = typed_config.config_dict(
      sections.Rollout, num_rows=8, samples_per_row=8, prefill_buckets=(64,),
      max_new_tokens=64, max_seq_len=128)
  if arg.runlocal:
    c.num_prompts = 4
    c.rollout.max_new_tokens = 8
  return c
