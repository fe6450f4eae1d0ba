"""Engines of one model on prefix blocks of a rollout layout's replicas.

Each block (`parallel/submesh.split`; built on first use: the power-of-two
blocks consolidation picks, and every size down from the whole under
RLHFless's release) has the same slots, group entries and pages per
replica, so decode runs the same per-device program wherever a group is and
tokens equal the plain run's; weights are viewed on a block without a copy.
`engine/long_tail.py`'s controller moves a run between them.
"""

from __future__ import annotations

import jax

from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.multiturn import MultiTurnDriver
from rlhf_jax.parallel import submesh
from rlhf_jax.parallel.layout import Layout
from rlhf_jax.sched import tail as tail_rules


class EngineSet:
  """Engines of one model on prefix blocks of a rollout layout's replicas."""

  def __init__(self, cfg, graphdef, layout: Layout, *, rows_per_replica: int,
               paged: dict | None = None, **engine_args):
    """`engine_args`: samples_per_row (G), prefill_buckets, sampling,
    attention_impl, max_common_length, record_routes, top_logprobs.
    `paged`: the `Engine` arguments of
    its own (page_size, num_pages, num_slots, decode_window, ...; a 0 or
    missing num_pages / num_slots: sized to rows_per_replica x G slots a
    replica, every one at full length)."""
    self.cfg, self.graphdef, self.layout = cfg, graphdef, layout
    self.replicas = layout.mesh.shape["data"]
    self.rows_per_replica = rows_per_replica
    self.sizes = tail_rules.block_sizes(self.replicas)
    self._engine_args = engine_args
    self._paged_args = dict(paged or {})
    self._engines: dict[int, Engine] = {}

  def engine(self, m: int | None = None) -> Engine:
    """The engine on replicas [0, m) (default: all; built on first use).
    Every block's engine has the same slots, group entries and pages per
    replica, so a block's decode state is the first replicas' part of the
    whole one (`moves.adopt_state`)."""
    m = self.replicas if m is None else m
    if m not in self._engines:
      a, pa = self._engine_args, dict(self._paged_args)
      rows = self.rows_per_replica * self.replicas
      pa["num_pages"] = pa.get("num_pages") or None  # 0: sized to the slots.
      if m != self.replicas:
        full = self.engine()
        pa = dict(page_size=full.page_size,
                  decode_window=full.decode_window,
                  num_pages=full.num_pages // self.replicas * m,
                  num_slots=full.num_slots // self.replicas * m,
                  num_groups=full.num_groups // self.replicas * m)
      self._engines[m] = Engine(
          self.cfg, self.graphdef, self.parts(m)[0],
          num_slots=pa.pop("num_slots", 0) or rows * a["samples_per_row"],
          samples_per_group=a["samples_per_row"],
          prefill_buckets=a["prefill_buckets"], sampling=a["sampling"],
          attention_impl=a.get("attention_impl", "auto"),
          max_common_length=a.get("max_common_length", 0),
          record_routes=a.get("record_routes", False),
          top_logprobs=a.get("top_logprobs", 0), **pa)
    return self._engines[m]

  def kv_bytes_per_device(self) -> int:
    """Bytes of the whole engine's page pool on each device: what a
    replica frees when the tail leaves it."""
    return self.engine().pool_bytes // len(submesh.devices_of(self.layout))

  def driver(self, params, version: int, reply=None) -> Driver:
    """A plain driver (no long-tail policies) on the whole engine."""
    return self.make_driver(self.engine(), params, version, reply=reply)

  @staticmethod
  def make_driver(engine, params, version: int, reply=None) -> Driver:
    """The driver of `engine`: multi-turn with an environment's `reply`
    (`engine/multiturn.py`)."""
    if reply is not None:
      return MultiTurnDriver(engine, params, reply=reply,
                             weight_version=version)
    return Driver(engine, params, weight_version=version)

  @property
  def sampling(self):
    return self._engine_args["sampling"]

  def parts(self, m: int) -> tuple[Layout, Layout | None]:
    """(rollout layout of replicas [0, m), layout of the rest or None)."""
    if m == self.replicas:
      return self.layout, None
    return submesh.split(self.layout, [m, self.replicas - m])

  def params_for(self, params, m: int):
    """`params` (full rollout layout) viewed on replicas [0, m): no copy.

    Every replica holds the same shards, so the sub-layout's arrays are
    built from the buffers already on its devices.
    """
    if m == self.replicas:
      return params
    return jax.tree.map(submesh.view, params, self.engine(m).param_shardings)
