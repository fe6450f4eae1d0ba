"""Colocated rollout and training on one mesh: step-level plumbing.

A `Colocation` switches the policy between the training layout (FSDP) and the
rollout layout (replicas x tensor) of the same devices, one weight copy at a
time (`parallel/repartition.py`), parks optimizer state and the reference
policy in host memory while the decode loop runs and counts weight versions
(when each phase ran is the job's `StepClock`, `step_clock.py`). With a `rollout_dtype` narrower than
the params (bf16 compute on fp32 master weights), the rollout copy is cast
on the way and the master weights wait in host memory like the optimizer
state: the decode reads half the bytes, and the values are those the
compute dtype would have used anyway. A LoRA policy's rollout copy is
derived the same way (`rollout_weights`: adapters merged into the base,
projections quantized), its master (base + adapters) parked. The colocated
rollout (`rollout/step_rollouts.Colocated`) calls:

  rollout_params = co.to_rollout(params)   # donates params; version += 1
  ... decode, stamping samples with co.version ...
  params = co.to_train(rollout_params)     # donates rollout_params

Weight versions: version v names the weights published by the v-th
training->rollout repartition; a run resumed after step s starts at v = s.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from rlhf_jax.parallel import repartition as rp
from rlhf_jax.parallel.layout import Layout

class Colocation:
  """Training <-> rollout switching of one mesh, with offload and timeline."""

  def __init__(self, train_layout: Layout, rollout_layout: Layout,
               params_like: Any, *, offload: bool = True,
               layers_per_group: int = 1, max_in_flight: int = 2,
               version: int = 0, on_stale: str = "raise", rollout_dtype=None,
               rollout_weights=None):
    """Builds the two target sharding trees once.

    Args:
      train_layout, rollout_layout: layouts over the same devices.
      params_like: the param pytree (arrays or ShapeDtypeStructs with
        logical_axes metadata) whose layouts are switched.
      offload: park optimizer state / reference params in host memory
        during rollout (`pinned_host`, else `unpinned_host`).
      layers_per_group: layers resharded by one jitted call.
      max_in_flight: groups dispatched before waiting for the oldest.
      version: the weight version before the first `to_rollout`.
      on_stale: "raise" or "drop": what a synchronous step does with
        samples of other weight versions (`rollout/step_rollouts.py`).
      rollout_dtype: dtype of the rollout copy's floating params (the
        model's compute dtype); None or the params' own: no cast, the
        params themselves switch layouts.
      rollout_weights: params -> the rollout copy's weights, cast
        included, maybe in another structure (`models/rollout_copy.py`:
        LoRA merged, quantized), jitted into the copy; None: the params
        themselves (cast to `rollout_dtype`).
    """
    if (set(train_layout.mesh.devices.flat)
        != set(rollout_layout.mesh.devices.flat)):
      raise ValueError("training and rollout layouts must share devices")
    self.train_layout, self.rollout_layout = train_layout, rollout_layout
    self.train_shardings = train_layout.param_shardings(params_like)
    rollout_like = (params_like if rollout_weights is None
                    else jax.eval_shape(rollout_weights, params_like))
    self.rollout_shardings = rollout_layout.param_shardings(rollout_like)
    self.groups = rp.layer_groups(params_like, layers_per_group)
    self.max_in_flight = max_in_flight
    self.host_kind = rp.host_memory_kind() if offload else None
    self.version = version
    self.on_stale = on_stale
    self._train_back = None
    floats = {x.dtype for x in jax.tree.leaves(rollout_like)
              if jnp.issubdtype(x.dtype, jnp.floating)}
    self.rollout_dtype = (None if rollout_dtype is None
                          or floats <= {jnp.dtype(rollout_dtype)}
                          else jnp.dtype(rollout_dtype))
    self._derived = None if rollout_weights is None else jax.jit(
        rollout_weights, out_shardings=self.rollout_shardings)
    self._master = None  # The master weights during a cast/derived rollout.

  @classmethod
  def from_section(cls, mesh, train_layout: Layout, rollout_layout: Layout,
                   params_like, rollout_dtype=None, rollout_weights=None):
    """The switch a `config.sections.Mesh` asks for."""
    return cls(train_layout, rollout_layout, params_like,
               offload=mesh.offload, layers_per_group=mesh.layers_per_group,
               on_stale=mesh.stale_samples, rollout_dtype=rollout_dtype,
               rollout_weights=rollout_weights)

  # --------------------------------------------------------- repartition
  def to_rollout(self, params) -> Any:
    """Training -> rollout layout (donating `params`); bumps the version.

    Returns once the arrays are ready: a phase boundary of the timeline.
    """
    # `to_train` returns to exactly these shardings: the train step's own
    # outputs may shard small leaves differently from the layout rules, and
    # feeding it anything else would compile it again.
    self._train_back = jax.tree.map(lambda x: x.sharding, params)
    if self.rollout_dtype is None and self._derived is None:
      out = rp.repartition(params, self.rollout_shardings, groups=self.groups,
                           max_in_flight=self.max_in_flight)
    else:  # A cast copy; the master weights wait (in host memory).
      out = self.rollout_copy(params)
      self._master = self.park(params)
    self.version += 1
    return jax.block_until_ready(out)

  def to_train(self, params) -> Any:
    """Rollout -> training layout (donating `params`).

    The shardings are those the params had before the last `to_rollout`
    (the training layout's before the first). Returns once ready.
    """
    if self._master is not None:  # The cast copy goes; the master returns.
      delete(params)
      master, self._master = self._master, None
      return jax.block_until_ready(self.unpark(master))
    dst = self._train_back or self.train_shardings
    return jax.block_until_ready(rp.repartition(
        params, dst, groups=self.groups, max_in_flight=self.max_in_flight))

  @property
  def rollout_is_master(self) -> bool:
    """Whether the rollout copy is the training params themselves (no
    cast, nothing derived): a forward on it is the trainer's forward."""
    return self.rollout_dtype is None and self._derived is None

  @property
  def master(self) -> Any:
    """The training params a cast or derived rollout copy came from
    (parked while it decodes), else None."""
    return self._master

  def rollout_copy(self, params) -> Any:
    """A rollout-layout copy (in `rollout_dtype`, derived by
    `rollout_weights`) that keeps `params` (evaluation, a cast rollout); no
    version."""
    if self._derived is not None:
      return self._derived(params)
    return rp.repartition(params, self.rollout_shardings, groups=self.groups,
                          donate=False, max_in_flight=self.max_in_flight,
                          dtype=self.rollout_dtype)

  # -------------------------------------------------------------- offload
  def park(self, tree) -> Any:
    """Moves `tree` to host memory when offload is on (donating it)."""
    if self.host_kind is None:
      return tree
    return rp.offload(tree, self.host_kind)

  def unpark(self, tree, *, donate: bool = True) -> Any:
    """Brings a parked `tree` back to device memory (a copy if not donating)."""
    return rp.reload(tree, donate=donate)


def delete(tree) -> None:
  """Frees a transient device copy (once pending reads of it complete)."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


@contextlib.contextmanager
def transient(co: Colocation, tree):
  """A device copy of a (possibly parked) `tree` for the `with` body."""
  if rp.on_device(tree):
    yield tree
    return
  copy = co.unpark(tree, donate=False)
  try:
    yield copy
  finally:
    delete(copy)
