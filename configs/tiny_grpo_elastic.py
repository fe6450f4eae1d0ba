"""The default GRPO job with its rollouts on 3 Ray workers (local cluster).

python -m rlhf_jax.main --config=configs/tiny_grpo_elastic.py --workdir=workdirs/tiny_grpo_elastic
python -m rlhf_jax.main --config=configs/tiny_grpo_elastic.py:runlocal   # seconds

Needs `pip install .[ray]`. Each worker is a Ray actor with its own JAX
process and one CPU device; the trainer publishes each step's weights to
Ray's object store and the workers pull them (docs/elastic.md). Each step
the trainer's own engine seeds the rollout for T_seed, hands its
unfinished samples to the workers, and trains on finished groups while
they finish the rest (`rl.stream`: one update a step, as the trainer-only
job with `rl.num_minibatches=1`). On a Ray cluster with spot nodes, set
RAY_ADDRESS and raise `rollout.workers.num`.
`--config.rollout.workers.num=0` is the trainer-only job.
"""

from configs import tiny_grpo


def get_config(arg=None):
  c = tiny_grpo.get_config(arg)
  c.name = "tiny_grpo_elastic"
  c.rollout.workers.update(num=3, kind="ray", theta=2, seed=True)
  c.rl.update(stream=True, stream_parts=2,
              num_minibatches=1)  # Streaming makes one update a step.
  return c
