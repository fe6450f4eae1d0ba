"""Assignment of prompt groups to rollout actors before decoding starts.

Two policies: the verl-like even contiguous split, and RLHFless's
length-grouped split (rank groups by predicted length, give each actor a
contiguous run of similar lengths) so actors holding short groups finish
early and can be released.
"""

from collections.abc import Sequence


def contiguous_split(group_ids: list[int], n_actors: int) -> list[list[int]]:
  """Splits groups into n_actors contiguous chunks of near-equal size."""
  if n_actors <= 0:
    raise ValueError("n_actors must be positive")
  chunks = []
  start = 0
  for i in range(n_actors):
    size = len(group_ids) // n_actors + (1 if i < len(group_ids) % n_actors
                                          else 0)
    chunks.append(list(group_ids[start:start + size]))
    start += size
  return chunks


def length_grouped_split(predicted: dict[int, float], n_actors: int,
                         group_size: int = 1) -> list[list[int]]:
  """Ranks groups by predicted length and splits into contiguous runs.

  Runs are cut so each actor gets about the same predicted tokens, so the
  actor holding the longest groups holds fewer of them and decodes them in a
  smaller batch. The paper's exact packing rule is [U]; ties keep prompt
  order, so the result is deterministic.

  Args:
    predicted: prompt group id -> predicted response length.
    n_actors: number of decode actors.
    group_size: samples per group (scales tokens; kept for clarity).

  Returns:
    One list of group ids per actor (some may be empty when there are fewer
    groups than actors); actor 0 gets the longest groups.
  """
  ranked = longest_first_order(predicted)
  weights = [max(predicted[g], 1.0) * group_size for g in ranked]
  total = sum(weights)
  chunks, current, acc = [], [], 0.0
  for i, (g, w) in enumerate(zip(ranked, weights)):
    current.append(g)
    acc += w
    left_groups = len(ranked) - i - 1
    left_actors = n_actors - len(chunks) - 1
    if left_actors and (acc >= total * (len(chunks) + 1) / n_actors or
                        left_groups == left_actors):
      chunks.append(current)
      current = []
  chunks.append(current)
  chunks += [[] for _ in range(n_actors - len(chunks))]
  return chunks


def longest_first(predicted: Sequence[float],
                  keys: Sequence[int]) -> list[int]:
  """Indices in admission order: longest predicted first, ties by key
  (then by index: the order is stable for repeated keys)."""
  return sorted(range(len(predicted)), key=lambda i: (-predicted[i], keys[i]))


def longest_first_order(predicted: dict[int, float]) -> list[int]:
  """Dispatch order for a central queue: longest predicted groups first."""
  ids = list(predicted)
  return [ids[i] for i in longest_first([predicted[g] for g in ids], ids)]


def replica_of(predicted: Sequence[float], replicas: int) -> list[int]:
  """RLHFless's assignment: the replica of each prompt
  (by index), from `length_grouped_split` (replica 0 gets the longest,
  the last replicas the shortest, which finish and are released first)."""
  split = length_grouped_split(dict(enumerate(predicted)), replicas)
  out = [0] * len(predicted)
  for r, ids in enumerate(split):
    for i in ids:
      out[i] = r
  return out
