"""Scoring: what turns finished samples into the numbers an RL step trains
on, in one room.

  host_rewards  reward functions on the host, a group as it finishes
                (`RewardScorer`, a `GroupScorer`)
  heads         a reward model's scores and a critic's values on device
                (`ScalarHead`)
  passes        the step's forward passes over finished samples on any
                layout: old and reference log-probs, reward-model scores,
                critic values (`ScoringPasses`, the `DevicePasses`)
  fused         those passes on the replicas the long-tail rollout frees
                while the tail decodes (`FusedScoring`, the engine's
                `FreedReplicaWork`), or none: the passes then run after the
                rollout, in the ADVANTAGES stage (`rl/prepare.py`)
  protocols     `GroupScorer` and `DevicePasses`

The engine knows nothing of scoring: its tail controller reports the
replicas it frees and calls the work it is given.
"""
