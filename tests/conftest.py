"""Test setup: 8 fake CPU devices, set before JAX initialises its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

from rlhf_jax.parallel import mesh as mesh_lib  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
  """The 8-device training mesh (FSDP 8)."""
  assert jax.device_count() == 8, "tests need 8 fake CPU devices"
  return mesh_lib.make_mesh(fsdp=-1)


@pytest.fixture(scope="session")
def mesh1():
  """A one-device mesh, the reference for sharded results."""
  return mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])


class RoundClock:
  """Seconds = poll rounds: a seed window's clock, made deterministic
  (`tick` is the manager's `on_poll` hook)."""

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def tick(self, _mgr):
    self.t += 1.0


@pytest.fixture
def round_clock():
  return RoundClock()


def first_step_pair(job, config):
  """Step 1 of a built GRPO `job` run twice from its initial params on the
  same prompts: trainer-only, then on `job.workers`. Returns
  ((state, metrics) trainer-only, (state, metrics) on the workers)."""
  import jax.numpy as jnp
  from rlhf_jax.trainers import grpo

  prompts = next(job.iterator)
  ref = jax.tree.map(lambda x: x * 1.05, job.params)

  def step(workers):
    state = job.learner.init_state(
        jax.tree.map(lambda x: jnp.array(x, copy=True), job.params))
    return grpo.rl_step(
        1, state, ref, prompts, config=config, learner=job.learner,
        engine=job.engine, rollout_layout=job.rollout_layout,
        tokenizer=job.tokenizer, prompt_len=job.prompt_len,
        workers=workers)

  return step(None), step(job.workers)


@pytest.fixture
def grpo_step_pair():
  """`first_step_pair`, for the elastic trainer tests."""
  return first_step_pair
