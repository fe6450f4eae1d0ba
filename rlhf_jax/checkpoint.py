"""Atomic, resumable checkpoints (Orbax) of the train state plus JSON metadata.

Orbax writes each step to a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoint intact. Saves are
async; `wait()` finishes them (called before exit and before the next save).
A checkpoint damaged later (truncated or lost files) is moved aside to
`<directory>.damaged/` and the next older one is used (`restore_latest`).
"""

from __future__ import annotations

import collections
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from rlhf_jax.errors import CheckpointError


def _shape_counts(tree) -> collections.Counter:
  """How many leaves of each (shape, dtype) a pytree of arrays or of Orbax
  array metadata has (their tree types differ; the leaves compare)."""
  return collections.Counter((tuple(x.shape), np.dtype(x.dtype).name)
                             for x in jax.tree.leaves(tree))


class Checkpointer:
  """Keeps the last `keep` (None: all) checkpoints of a pytree + a JSON dict."""

  def __init__(self, directory: str, *, keep: int | None = 2):
    self.directory = os.path.abspath(directory)  # Orbax needs absolute paths.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._manager.wait_until_finished()
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True)

  def _mismatch(self, step: int, like: Any) -> str | None:
    """Why step `step` cannot hold `like` (other shapes: another model or
    job), or None when it could (so a failed restore means damage)."""
    try:
      stored = _shape_counts(self._manager.item_metadata(step)["state"])
    except Exception:  # pylint: disable=broad-except
      return None  # Unreadable metadata: damaged.
    wanted = _shape_counts(like)
    if not stored or stored == wanted:  # No leaves: unreadable, damaged.
      return None
    return (f"checkpoint {self.directory}/{step} does not match this "
            "config's state (wrong model shape or different job?): it has "
            f"(shape, dtype) leaves {sorted((stored - wanted).items())[:3]} "
            f"where this job has {sorted((wanted - stored).items())[:3]}")

  def restore(self, step: int, like: Any) -> tuple[Any, dict]:
    """Restores into the shapes, dtypes and shardings of the pytree `like`;
    CheckpointError if the checkpoint holds other shapes (checked on the
    metadata first: a failed Orbax read leaves a trail of asyncio errors)."""
    if (why := self._mismatch(step, like)) is not None:
      raise CheckpointError(why)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        like)
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def restore_latest(self, like: Any) -> tuple[int, Any, dict] | None:
    """(step, state, meta) of the newest intact checkpoint, or None if there
    is none. A damaged one is moved to `<directory>.damaged/` with a
    warning; one of another shape raises CheckpointError."""
    while (step := self.latest_step()) is not None:
      try:
        return (step,) + self.restore(step, like)
      except CheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, e)
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    aside = os.path.join(f"{self.directory}.damaged",
                         f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    logging.warning(
        "checkpoint %s/%d is damaged (%s: %s); moved to %s, resuming from "
        "the previous one", self.directory, step, type(error).__name__,
        str(error).splitlines()[0][:200] if str(error) else "", aside)
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(aside), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_aside_{step}")
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
