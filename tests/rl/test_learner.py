"""The learner (`rl/learner.py`): one built from the same configs as a live
one runs that one's programs (`shared_programs.py`)."""

import types

import jax
import jax.numpy as jnp
import numpy as np

import fakes
from rlhf_jax.models import model as model_lib
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import objectives
from rlhf_jax.rl.learner import OptimConfig, make_optimizer
from rlhf_jax.rl.prepare import AdvantageConfig, Preparer

CFG = fakes.TINY_CFG
P, R, N, G = 6, 5, 2, 2


def _samples():
  rng = np.random.default_rng(0)
  out = []
  for n in range(N):
    prompt = rng.integers(1, CFG.vocab_size, P)
    for _ in range(G):
      out.append(types.SimpleNamespace(
          prompt_id=n, prompt_tokens=prompt.tolist(),
          tokens=rng.integers(1, CFG.vocab_size, R).tolist(),
          logp_raw=-rng.random(R).astype(np.float32)))
  return out


def _learner(graphdef, layout, clip=0.2, learning_rate=1e-3):
  return objectives.policy_learner(
      graphdef, layout, objectives.PolicyLossConfig(clip_low=clip,
                                                    clip_high=clip),
      make_optimizer(OptimConfig(learning_rate=learning_rate)),
      micro_batches=1)


def test_an_equal_learner_reuses_the_programs_of_a_live_one(mesh8):
  """A learner built from configs equal to a live one's (new but equal
  config objects) runs its programs: the same update to the bit, nothing
  traced again; other configs trace their own."""
  layout = mesh_lib.train_layout(mesh8)
  graphdef, params = model_lib.init_params(CFG, 0, layout)
  first = _learner(graphdef, layout)
  preparer = Preparer(first, AdvantageConfig("grpo", G))
  rewards = np.array([1.0, 0.0, 0.5, 2.0], np.float32)
  batch, _ = preparer(params, params, preparer.put(
      batch_lib.pack(_samples(), P, R), rewards))

  def update(learner):
    state = learner.init_state(jax.tree.map(jnp.copy, params))
    state, metrics = learner.step(state, batch)
    return jax.device_get((state.params, metrics))

  want = update(first)
  traced = dict(first.trace_counts)
  assert traced["train"] >= 1
  again = _learner(graphdef, layout)
  assert dict(again.trace_counts) == traced  # first's counts, ...
  got = update(again)
  assert dict(again.trace_counts) == traced  # ... and nothing traced again.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  other = _learner(graphdef, layout, learning_rate=2e-3)
  assert other.trace_counts["train"] == 0
  moved = update(other)
  assert other.trace_counts["train"] == 1
  assert not np.array_equal(jax.tree.leaves(moved[0])[0],
                            jax.tree.leaves(want[0])[0])
