"""The composition table (`config/compose.py`) through the real checks.

Every row is exercised: a job with only one of its two features passes the
checks (so the row, not something else, is what refuses), a job with both
is refused in one line that names both, and an UNFUSED row turns fusion off
without an error. The feature switches below are written here from the
config keys, not read from the table.
"""

import pytest

import resume

from configs import tiny_grpo, tiny_ppo
from rlhf_jax import typed_config
from rlhf_jax.config import checks, compose, sections
from rlhf_jax.config.sections import ConfigError, RLJob

_WORKERS = {"rollout.workers.num": 2, "rollout.workers.seed": True}
_TAIL = {"rollout.long_tail.enabled": True, "rollout.long_tail.fusion": False}
# Config keys that turn each feature on (and leave the others as they are
# in the tiny GRPO job, or the tiny PPO job for "ppo").
ON = {
    "ppo": {},
    "async": {"asynchronous.enabled": True},
    "async_workers": {"asynchronous.enabled": True, "rollout.workers.num": 2,
                      "rollout.workers.seed": False},
    "agent": {"agent.enabled": True},
    "workers": _WORKERS,
    "workers_seed": _WORKERS,
    "workers_without_seed": {"rollout.workers.num": 2,
                             "rollout.workers.seed": False},
    "workers_scale_cost": {"rollout.workers.num": 2,
                           "rollout.workers.scale": "cost"},
    "long_tail": _TAIL,
    "long_tail_grouped": {**_TAIL, "rollout.long_tail.assignment": "grouped"},
    "long_tail_replicas_cost": {**_TAIL, "rollout.long_tail.replicas": "cost"},
    "fusion": {"rollout.long_tail.enabled": True,
               "rollout.long_tail.fusion": True},
    "common_prefix": {"rollout.max_common_length": 4},
    "quantize": {"rollout.quantize": "int8"},
    "lora": {"lora.rank": 4},
    "stream": {"rl.stream": True, "rl.stream_parts": 2},
    "dynamic_sampling": {"rl.dynamic_sampling": True},
    "grouped_layout": {"rl.share_prompt": True, "rl.pack_length": 0,
                       "rollout.samples_per_row": 4},
    "context": {"mesh.context": 2, "rl.pack_length": 64},
    "several_epochs": {"rl.ppo_epochs": 2},
    "batch_advantage": {"rl.advantage": "reinforce_pp"},
    "cast_copy_old_logprobs": {"model.compute_dtype": "bfloat16",
                               "rl.ppo_epochs": 2},
    "routing_replay": {"rl.routing_replay": True},
}


def _job(kind, *keys):
  """The tiny job of `kind` with the features `keys` on."""
  c = (tiny_ppo if kind == "ppo" else tiny_grpo).get_config("runlocal")
  c.agent = typed_config.config_dict(sections.Agent)
  c.asynchronous = typed_config.config_dict(sections.Async)
  for key in keys:
    resume.override(c, **ON[key])
  return c


def _check(c, kind):
  checks.check_rl_job(RLJob.from_config(c), job=kind, prompt_len=8,
                      num_devices=8)


def _kind(row):
  return "ppo" if "ppo" in (row.first, row.second) else "grpo"


def test_every_feature_has_a_switch():
  assert set(ON) == set(compose.FEATURES)
  for key in ON:
    kind = "ppo" if key == "ppo" else "grpo"
    c = RLJob.from_config(_job(kind, key))
    assert compose.FEATURES[key].on(c, kind), key


@pytest.mark.parametrize(
    "row", [r for r in compose.TABLE if r.allowed == compose.REFUSED],
    ids=lambda r: f"{r.first}+{r.second}")
def test_refused_row(row):
  kind = _kind(row)
  for alone in (row.first, row.second):
    if alone != "ppo":  # Alone: in a GRPO job.
      assert compose.refused(RLJob.from_config(_job("grpo", alone)),
                             "grpo") is None, alone
  with pytest.raises(ConfigError) as e:
    _check(_job(kind, row.first, row.second), kind)
  message = str(e.value)
  assert compose.FEATURES[row.first].says in message
  assert compose.FEATURES[row.second].says in message
  assert row.why in message
  assert "\n" not in message


@pytest.mark.parametrize(
    "row", [r for r in compose.TABLE if r.allowed == compose.UNFUSED],
    ids=lambda r: f"{r.first}+{r.second}")
def test_unfused_row(row):
  kind = _kind(row)
  fused = RLJob.from_config(_job(kind, "fusion"))
  assert compose.unfused_because(fused, kind) is None
  both = RLJob.from_config(_job(kind, row.first, row.second))
  assert compose.unfused_because(both, kind) == row.why
  assert compose.refused(both, kind) is None  # Falls back, no error.


def test_both_checks_agree_that_plain_jobs_compose():
  for kind in ("grpo", "ppo"):
    _check(_job(kind), kind)
