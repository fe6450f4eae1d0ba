"""Which node each rollout actor runs on (RLHFless locality-aware placement).

After an update the new weights sit on the learner's node. An actor there
takes them over the node's own links; an actor on another node first waits
for its node's copy over the backend network. RLHFless puts "the
heaviest-loaded decode actors on nodes near the learner, so that weight
sync overlaps with compute" (seeds.md, [S]): the actor that decodes longest
starts first. A placement that ignores load spreads actors over the nodes
in the order it starts them (Ray's SPREAD strategy), the ablation baseline.
"""

from collections.abc import Sequence

PLACEMENTS = ("colocated", "locality", "spread")


def actor_nodes(work: Sequence[float], *, tp: int, devices_per_node: int,
                nodes: int, placement: str) -> list[int]:
  """Node of each actor; node 0 is the learner's.

  Args:
    work: each actor's predicted decode time, in actor order.
    tp: devices per actor.
    devices_per_node: devices of one node.
    nodes: nodes of the pool.
    placement: 'locality' (most work first onto the learner's node, then
      the next node, ...) or 'spread' (actor i on node i mod nodes).

  Raises:
    ValueError: an unknown placement, or more actors than the nodes hold.
  """
  per_node = max(1, devices_per_node // tp)
  if len(work) > per_node * nodes:
    raise ValueError(f"{len(work)} actors of {tp} devices do not fit on "
                     f"{nodes} nodes of {devices_per_node}")
  if placement == "spread":
    return [i % nodes for i in range(len(work))]
  if placement != "locality":
    raise ValueError(f"placement must be 'locality' or 'spread', got "
                     f"{placement!r}")
  ranked = sorted(range(len(work)), key=lambda i: (-work[i], i))
  out = [0] * len(work)
  for slot, i in enumerate(ranked):
    out[i] = slot // per_node
  return out
