"""RLHFless's locality-aware placement: the rule and its weight sync."""

import pytest

from rlhf_jax.errors import ConfigError
from rlhf_jax.sched import placement
from rlhf_jax.sched import named_policies as policy_lib
from rlhf_jax.sim import runner
from rlhf_jax.sched.cost_model import costs, hardware, profiles as models
from rlhf_jax.sched.cost_model.setting import Setting
from rlhf_jax.sim.workload import Workload, WorkloadSpec


def test_locality_fills_the_learners_node_with_the_most_work():
  work = [5.0, 90.0, 10.0, 90.0, 70.0, 1.0]
  # Two actors of 2 devices per node of 4: the two 90s (ties: lower index
  # first) on node 0, then 70 and 10, then 5 and 1.
  got = placement.actor_nodes(work, tp=2, devices_per_node=4, nodes=3,
                              placement="locality")
  assert got == [2, 0, 1, 0, 1, 2]


def test_spread_ignores_the_work():
  got = placement.actor_nodes([1.0, 9.0, 3.0, 7.0, 5.0], tp=1,
                              devices_per_node=8, nodes=2, placement="spread")
  assert got == [0, 1, 0, 1, 0]


def test_placement_rejects_what_does_not_fit():
  with pytest.raises(ValueError, match="5 actors of 4 devices"):
    placement.actor_nodes([1.0] * 5, tp=4, devices_per_node=8, nodes=2,
                          placement="locality")
  with pytest.raises(ValueError, match="placement must be"):
    placement.actor_nodes([1.0], tp=1, devices_per_node=8, nodes=1,
                          placement="packed")


def test_weight_sync_by_hand():
  model, hw = models.get_model("qwen2.5-3b"), hardware.get_hardware("l40s")
  weights = 3.09e9 * 2                     # BF16 bytes.
  near = weights / 2 / (32e9 * 0.8)        # Half each, over PCIe.
  node_copy = weights / (8 * 50e9 / 8 * 0.8)  # One copy over 8 x 50 Gbit.
  assert costs.weight_sync_time(model, hw, 2, 0) == pytest.approx(near)
  assert costs.weight_sync_time(model, hw, 2, 3) == pytest.approx(
      near + node_copy)


def test_policy_knobs_are_checked():
  with pytest.raises(ConfigError, match="placement must be one of"):
    policy_lib.get_policy("rlhfless", placement="packed")
  with pytest.raises(ConfigError, match="places static-dispatch actors"):
    policy_lib.get_policy("rlboost", placement="locality")
  with pytest.raises(ConfigError, match="unexpected keyword"):
    policy_lib.get_policy("rlhfless", placment="spread")
  with pytest.raises(ConfigError, match="unknown policy 'rlhfles'"):
    policy_lib.get_policy("rlhfles")


@pytest.mark.parametrize("where", ["locality", "spread"])
def test_each_actor_waits_for_its_nodes_copy(where):
  """In the simulated steps every RLHFless actor with work starts with a
  weight transfer of the near or the far duration (by hand above), at most
  a node's worth of them near; spread puts the even actors near."""
  setting = Setting(model="qwen2.5-3b", hardware="l40s", reserved_devices=16,
                    rollout_tp=1, scoring_models=("qwen2.5-3b",) * 2,
                    max_response=1024, optimizer_steps=1)
  spec = WorkloadSpec(prompts_per_step=32, group_size=4, dataset_prompts=32,
                      median_len=200.0, sigma=0.8, max_len=1024)
  policy = policy_lib.get_policy("rlhfless", placement=where,
                                 actor_lambda=None)  # All 16 actors.
  model, hw = models.get_model("qwen2.5-3b"), hardware.get_hardware("l40s")
  near = 3.09e9 * 2 / (32e9 * 0.8)
  far = near + 3.09e9 * 2 / (50e9 * 0.8)
  assert costs.weight_sync_time(model, hw, 1, 1) == pytest.approx(far)
  for r in runner.run(setting, policy, Workload(spec), 2):
    spans = {e["tid"]: e for e in r.timeline
             if e["pid"] == "local" and e["name"] == "weights"}
    assert len(spans) == 16
    for tid, e in spans.items():
      assert e["ts"] == pytest.approx(r.t0 * 1e6)
      assert e["dur"] / 1e6 == pytest.approx(near) or (
          e["dur"] / 1e6 == pytest.approx(far)), (tid, e["dur"])
    got_near = {tid for tid, e in spans.items()
                if e["dur"] / 1e6 == pytest.approx(near)}
    assert len(got_near) == 8
    if where == "spread":
      assert got_near == {f"local{i}" for i in range(0, 16, 2)}
