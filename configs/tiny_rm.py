"""Reward model on synthetic addition preferences, a tiny model, on CPU.

python -m rlhf_jax.main --config=configs/tiny_rm.py --workdir=workdirs/tiny_rm
python -m rlhf_jax.main --config=configs/tiny_rm.py:runlocal --workdir=/tmp/rm

Pairs are "a+b=" with chosen = the correct sum and rejected = a wrong one
(reversed digits, as configs/tiny_grpo.py's task); held-out pairs use the
task's disjoint eval problems. The Bradley-Terry loss trains the decoder
trunk plus a scalar head read at <eos>. For your own data set
`--config.data.kind=jsonl --config.data.train_path=pairs.jsonl` (lines of
{"prompt", "chosen", "rejected"}; char tokenizer). The final checkpoint in
<workdir>/checkpoints is the reward model a PPO job loads.
"""

import ml_collections

from configs import common
from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.data import preferences
from rlhf_jax.data.tasks import AdditionTask


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "tiny_rm"
  c.job = "rm"
  c.seed = 0

  c.model = common.tiny_model_config()
  c.mesh = common.mesh_config()
  c.logging = typed_config.config_dict(sections.Logging)

  # The addition task behind the pairs (rlhf_jax/data/tasks.py).
  c.task = typed_config.config_dict(
      AdditionTask, max_digits=2, min_digits=1, reverse_answer=True,
      zero_pad=False, num_eval=250, holdout_fraction=0.1, seed=0)

  # Pairs (rlhf_jax/data/preferences.PreferenceData): "addition" (the right
  # sum against a wrong one), or "jsonl" with data.train_path.
  c.data = typed_config.config_dict(
      preferences.PreferenceData, kind="addition", max_offset=0,
      near_miss=0.0, holdout_fraction=0.1, seq_len=16)

  c.optim = common.optim_config(
      learning_rate=1e-3, warmup_steps=20, decay_steps=1200, end_lr_ratio=0.1,
      b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1.0)

  c.train = ml_collections.ConfigDict(dict(
      steps=1200, batch_size=64, micro_batches=1,
      margin=0.0,           # Added to every pair's margin (BT with margin).
      log_every=25, checkpoint_every=200, keep_checkpoints=2))
  c.eval = ml_collections.ConfigDict(dict(every=100, batch_size=250))

  if arg.runlocal:
    c.task.num_eval = 40
    c.optim.warmup_steps = 2
    c.optim.decay_steps = 0
    c.train.steps = 6
    c.train.batch_size = 16
    c.train.log_every = 2
    c.train.checkpoint_every = 3
    c.eval.every = 3
    c.eval.batch_size = 40
  return c
