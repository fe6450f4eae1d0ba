"""A spot availability trace's event: the simulator's traces
(`sim/availability.py`) and the live replay (`workers/replay.py`) share it."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SpotEvent:
  time: float
  iid: str
  kind: str  # 'add' | 'remove'
