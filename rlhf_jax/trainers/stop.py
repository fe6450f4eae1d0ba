"""Preemption: SIGTERM/SIGINT ask the step loop to checkpoint and exit."""

from __future__ import annotations

import signal

from absl import logging


class StopFlag:
  """Set by SIGTERM/SIGINT (preemption): save and exit after this step."""

  def __init__(self):
    self.requested = False
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._set)

  def _set(self, signum, frame):
    del frame
    logging.warning("signal %d: checkpointing after this step", signum)
    self.requested = True
