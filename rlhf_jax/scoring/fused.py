"""Device passes fused into the long-tail rollout (RLHFuse's inter-stage
fusion): chunks of finished samples scored on the replicas the tail frees.

  with fused.during(passes, sampler, policy=..., ref=...) as scoring:
    for group in sampler.stream(..., freed=scoring): ...
  per_token = scoring.assemble(samples, packed)   # the training batch's

The engine's tail controller (`engine/long_tail.TailController`) frees
replicas when it consolidates and reports them; a `FusedScoring` is the
work it hands them (`engine/long_tail.FreedReplicaWork`): finished
samples are buffered, cut into chunks by `sched.tail.scoring_chunk`
(right after a decode step is dispatched: a chunk's host work takes longer
than a tail decode step, and the tail is the critical path), compiled on a
background thread while the tail decodes, dispatched on the freed replicas
(`ScoringPasses.score`) and read as they finish; what is left runs on
every replica once the decode is over. Without room for the scoring
weights on the freed replicas, samples wait for the decode's end.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from absl import logging

from rlhf_jax import distributed
from rlhf_jax.parallel import colocate
from rlhf_jax.sched import tail as tail_rules
from rlhf_jax.scoring.protocols import DevicePasses


class FusedScoring:
  """One rollout's chunks of `passes` on the freed replicas, and their
  scores by sample key (`scores`, complete once the rollout ends)."""

  def __init__(self, passes: DevicePasses, tail):
    """`tail`: the `rollout.long_tail` section (`score_chunk`, `fusion`)."""
    self.passes, self.tail = passes, tail
    self.buffer: list = []       # Finished, not cut into a chunk yet.
    # Chunks whose programs compile in the background: (chunk, layout,
    # replicas, futures), launched once the futures are done.
    self.compiling: list[tuple[list, Any, tuple, list]] = []
    self.pending: list[tuple[list, Any, float, tuple]] = []  # Dispatched.
    self._outputs: list[tuple[list, Any]] = []  # Read at `flush`.
    self.scores: dict = {}
    self.chunks = self.compile_waits = 0
    # The freed replicas cannot hold the scoring weights: finished samples
    # wait for the decode's end (`switched`).
    self.no_room = False
    self._free_at = None         # When the last chunk's passes ended.

  # ---------------------------------------- the tail controller's calls
  def finished(self, sample) -> None:
    self.buffer.append(sample)

  def after_step(self, tail, now: float) -> None:
    """After a decode step is dispatched: spans of the chunks done, then
    the chunks due."""
    self._poll(tail, now)
    self._dispatch_due(tail)

  def switched(self, tail) -> None:
    """After a consolidation: whether the freed replicas hold the scoring
    weights (the reference, reward model and critic; the policy is viewed
    in place) in the decode state the tail freed there. The budget is that
    alone: what else is free on a device is not known on every backend."""
    if self.no_room or not tail.freed:
      return
    need = self.passes.bytes_per_device(tail.free_layout())
    have = tail.kv_bytes_per_device()
    if need > have:
      self.no_room = True
      logging.warning(
          "fused scoring: the scoring weights take %.3g GiB a device on the "
          "freed replicas, the tail freed %.3g GiB there; finished samples "
          "wait for the decode's end (more tensor parallelism, or more rows "
          "per replica, gives them room)", need / 2**30, have / 2**30)

  def flush(self, tail) -> None:
    """The decode is over: scores what is buffered on every replica, waits
    for every chunk and reads them."""
    self._dispatch_due(tail)
    self._poll(tail, tail.timeline.now(), block=True)
    for chunk, out in self._outputs:  # Dispatch order on every process.
      self._read(chunk, out)
    self._outputs = []

  def stats(self) -> dict:
    return {"rollout/scoring_chunks": self.chunks,
            "rollout/scoring_compile_waits": self.compile_waits,
            "rollout/scoring_waited_for_room": float(self.no_room)}

  # ------------------------------------------------------------ the batch
  def assemble(self, samples, packed) -> dict:
    """The passes' outputs for the training batch `packed` of `samples`
    (`ScoringPasses.assemble`)."""
    return self.passes.assemble(samples, self.scores, packed)

  # -------------------------------------------------------------- chunks
  def _dispatch_due(self, tail) -> None:
    """Chunks of the buffer `sched.tail.scoring_chunk` releases, each on
    the replicas free when it is cut; a chunk whose programs are still
    compiling waits for them while the tail decodes (once the decode is
    over, it waits here)."""
    while True:
      replicas = tail.free_replicas()
      n = tail_rules.scoring_chunk(
          len(self.buffer), self.tail.score_chunk, len(replicas),
          fusion=self.tail.fusion, freed=tail.freed and not self.no_room,
          decoded=tail.decoded,
          in_flight=len(self.pending) + len(self.compiling))
      if not n:
        break
      chunk, layout = self.buffer[:n], tail.free_layout()
      del self.buffer[:n]
      futures = [] if tail.decoded else self.passes.compile(chunk, layout)
      self.compile_waits += bool(futures)
      self.compiling.append((chunk, layout, tuple(replicas), futures))
    waiting = []
    for chunk, layout, replicas, futures in self.compiling:
      if tail.decoded or all(f.done() for f in futures):
        self._dispatch(tail, chunk, layout, replicas)
      else:
        waiting.append((chunk, layout, replicas, futures))
    self.compiling = waiting

  def _dispatch(self, tail, chunk, layout, replicas) -> None:
    now = tail.timeline.now()
    start = now if self._free_at is None else max(now, self._free_at)
    out = self.passes.score(chunk, layout)
    self.pending.append((chunk, out, start, replicas))
    if not _held_whole(out):
      self._outputs.append((chunk, out))
    self.chunks += 1

  def _poll(self, tail, now: float, block: bool = False) -> None:
    """Spans of the chunks done (all, waiting, with `block`). A chunk's
    outputs are read as it is done when this process holds them whole;
    else at `flush`: reading them is then a collective, which every process
    must reach at the same point."""
    keep = []
    for chunk, out, start, replicas in self.pending:
      if block:
        jax.block_until_ready(out)
        now = tail.timeline.now()
      elif not all(getattr(x, "is_ready", lambda: True)()
                   for x in jax.tree.leaves(out)):
        keep.append((chunk, out, start, replicas))
        continue
      end = max(now, start)
      if _held_whole(out):  # Read now, while the tail decodes.
        self._read(chunk, out)
      tail.mark(replicas, "scoring", start, end)
      self._free_at = end
    self.pending = keep

  def _read(self, chunk, out) -> None:
    host = jax.tree.map(distributed.to_host, out)
    for i, s in enumerate(chunk):
      self.scores[s.key] = jax.tree.map(lambda a, i=i: a[i], host)


def _held_whole(out) -> bool:
  """Whether this process holds every leaf of `out` (one process)."""
  return all(x.is_fully_addressable for x in jax.tree.leaves(out))


@contextlib.contextmanager
def during(passes: DevicePasses | None, sampler, **weights):
  """The fused scoring of one rollout on `sampler` with the step's
  `weights` (`ScoringPasses.begin`), or None without passes or when the
  sampler frees no replicas (`Rollout.frees_replicas`): the passes then
  run after the rollout."""
  if passes is None or sampler is None or not sampler.frees_replicas:
    yield None
    return
  passes.begin(**weights)
  try:
    yield FusedScoring(passes, sampler.tail)
  finally:
    passes.end()


def reference(co: colocate.Colocation, ref_params, fused):
  """The reference on device for the scoring phase (`colocate.transient`),
  or None when its pass ran fused."""
  if fused is not None:
    return contextlib.nullcontext(None)
  return colocate.transient(co, ref_params)
