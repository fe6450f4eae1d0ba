"""Atomic, resumable checkpoints (Orbax) of the train state plus JSON metadata.

Orbax writes each step to a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoint intact. Saves are
async; `wait()` finishes them (called before exit and before the next save).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` (None: all) checkpoints of a pytree + a JSON dict."""

  def __init__(self, directory: str, *, keep: int | None = 2):
    self.directory = os.path.abspath(directory)  # Orbax needs absolute paths.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._manager.wait_until_finished()
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True)

  def restore(self, step: int, like: Any) -> tuple[Any, dict]:
    """Restores into the shapes, dtypes and shardings of the pytree `like`."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        like)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError) as e:
      raise ValueError(
          f"checkpoint {self.directory}/{step} does not match this config's "
          f"state (wrong model shape or different job?): {e}") from e
    return out.state, out.meta

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
