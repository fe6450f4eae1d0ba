"""The default GRPO job with its rollouts on 3 Ray workers (local cluster).

python -m rlhf_jax.main --config=configs/tiny_grpo_elastic.py --workdir=workdirs/tiny_grpo_elastic
python -m rlhf_jax.main --config=configs/tiny_grpo_elastic.py:runlocal   # seconds

Needs `pip install .[ray]`. Each worker is a Ray actor with its own JAX
process and one CPU device; the trainer publishes each step's weights to
Ray's object store and the workers pull them (docs/elastic.md). On a Ray
cluster with spot nodes, set RAY_ADDRESS and raise `rollout.workers.num`.
`--config.rollout.workers.num=0` is the trainer-only job.
"""

from configs import tiny_grpo


def get_config(arg=None):
  c = tiny_grpo.get_config(arg)
  c.name = "tiny_grpo_elastic"
  c.rollout.workers.update(num=3, kind="ray", theta=2)
  return c
