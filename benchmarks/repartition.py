"""Layer-group repartition vs one-shot `jax.device_put`, time and peak memory.

  python -m benchmarks.repartition [--quick] [--layouts=8x1:1,4x2:2]
      [--num_layers=8 --embed_dim=512 ...]

The claim (DESIGN.md invariant 1): switching the policy between the training
layout (FSDP, optionally x TP) and the rollout layout (replicas x tensor) of
the same devices needs about one copy of the weights plus one layer group,
and is no slower than resharding the whole pytree with one `device_put`.

Both methods run in the same process on the same params, interleaved repeat
by repeat (the machine is shared): ours is `Colocation.to_rollout` /
`to_train` (`parallel/repartition.py`: one jitted identity per layer group,
sources donated or deleted), the baseline `jax.device_put(params,
target_shardings)`, what `mesh.to_layout` did before. Times are medians over
repeats with `block_until_ready`; compilation is excluded (one warm-up round
trip each).

Memory: live-buffer accounting over `jax.live_arrays()` (device memory kind,
summed over devices, replicas counted). For ours, live bytes are polled
between groups and the peak is max over groups of (live before the group +
the group's target bytes), i.e. its sources and targets both alive. For
device_put the peak is the live bytes right after it returns (source and
target copies). `peak_bytes_over_one_copy` divides the peak above the
baseline (other live arrays) by one copy of the params in the larger of the
two layouts (the rollout copy: replicated over replicas). `bytes_moved` is
what devices receive (target shard minus what they already hold), the same
for both methods.

Allocator: on CPU both methods run with glibc keeping freed memory in the
process (`benchmarks/cpu_allocator.py`, the command re-executes itself once
with the MALLOC_* settings), as an accelerator's BFC allocator keeps freed
device memory; with the default allocator every repartition page-faults
~2 GB of fresh buffers again (ours 0.82 s vs 0.17 s).

Model (default): ModelConfig.tiny with 8 layers, embed 512, 8 heads / 4 kv
heads of 64, MLP 2048, vocab 32000, untied head: 64.2M params (245 MiB
fp32). Runs on 8 host CPU devices (forced), the machine's real memory.
`--quick` took 28-96 s on a shared 2-core CPU (depending on its load).
`--smoke` (tests/test_benchmarks_smoke.py): a 2-layer 64-wide model and one
repeat, both layouts, every key below; its numbers mean nothing.

Prints a table, then one JSON line (last stdout line) with `repartition_s`,
`device_put_s`, `speedup_vs_device_put`, `peak_bytes_over_one_copy` (the
first layout, training->rollout, the switch before every decode phase).
"""

from __future__ import annotations

import platform
import statistics
import time

from absl import app
from absl import flags
import jax

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats (< 3 minutes).")
_SMOKE = flags.DEFINE_bool("smoke", False, "A 2-layer 64-wide model, one "
                           "repeat: that it runs (tests), not a measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "0 means 3 (--quick) or 7.")
_LAYOUTS = flags.DEFINE_string(
    "layouts", "8x1:1,4x2:2",
    "Comma list of fsdp x tensor : rollout tensor; the first is the headline.")
_GROUP = flags.DEFINE_integer("layers_per_group", 1, "Layers per reshard.")
_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", 2,
                                  "Groups dispatched before waiting.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 8, "Model override.")
_EMBED_DIM = flags.DEFINE_integer("embed_dim", 512, "Model override.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 8, "Model override.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 4, "Model override.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Model override.")
_MLP_DIM = flags.DEFINE_integer("mlp_dim", 2048, "Model override.")
_VOCAB = flags.DEFINE_integer("vocab_size", 32000, "Model override.")


def _ptr(x):
  return x.addressable_shards[0].data.unsafe_buffer_pointer()


def _free(old, new):
  """Deletes the leaves of `old` whose buffers `new` does not reuse."""
  keep = {_ptr(x) for x in jax.tree.leaves(new)}
  for x in jax.tree.leaves(old):
    if not x.is_deleted() and _ptr(x) not in keep:
      x.delete()


class _HostFetches:
  """Counts whole-array device->host fetches (`ArrayImpl._value`) in a block.

  `jax.device_put` between two meshes with the same device order takes
  `shard_sharded_device_array_slow_path`, which fetches the array to host
  numpy and re-uploads the shards; the transfer guard does not see it.
  """

  def __enter__(self):
    from jax._src import array
    self.count, self._orig = 0, array.ArrayImpl._value
    self._cls = array.ArrayImpl

    def counted(arr):
      self.count += 1
      return self._orig.fget(arr)

    array.ArrayImpl._value = property(counted)
    return self

  def __exit__(self, *exc):
    self._cls._value = self._orig


def _measure(layout_spec, cfg, repeats):
  from rlhf_jax.models import model as model_lib
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.parallel import repartition as rp
  from rlhf_jax.parallel.colocate import Colocation

  train_part, rollout_tensor = layout_spec.split(":")
  fsdp, tensor = map(int, train_part.split("x"))
  mesh = mesh_lib.make_mesh(fsdp=fsdp, tensor=tensor)
  train = mesh_lib.train_layout(mesh)
  rollout = mesh_lib.rollout_layout(mesh, int(rollout_tensor))
  base = rp.live_device_bytes()  # Arrays of nobody here (should be 0).
  _, params = model_lib.init_params(cfg, 0, train)
  co = Colocation(train, rollout, params, offload=False,
                  layers_per_group=_GROUP.value,
                  max_in_flight=_IN_FLIGHT.value)
  src_bytes = rp.tree_device_bytes(params)
  dst_bytes = rp.tree_device_bytes(params, co.rollout_shardings)
  one_copy = max(src_bytes, dst_bytes)
  plans = rp.plan(params, co.rollout_shardings)
  moved = sum(p.bytes_moved for p in plans)
  rollout_like = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                  for x, s in zip(jax.tree.leaves(params),
                                  jax.tree.leaves(co.rollout_shardings))]
  back_moved = sum(p.bytes_moved for p in rp.plan(
      rollout_like, jax.tree.leaves(co.train_shardings)))
  params = jax.block_until_ready(co.to_train(co.to_rollout(params)))  # Compile.

  def ours_peak(tree, dst):
    leaves, dsts = jax.tree.leaves(tree), jax.tree.leaves(dst)
    out = [rp.tree_device_bytes([leaves[i] for i in g], [dsts[i] for i in g])
           for g in co.groups]
    before = [rp.live_device_bytes()]
    result = rp.repartition(
        tree, dst, groups=co.groups, max_in_flight=co.max_in_flight,
        on_group=lambda _: before.append(rp.live_device_bytes()))
    # With k groups in flight, up to k groups' targets are alive at once.
    k = co.max_in_flight
    return max(b + sum(out[i:i + k]) for i, b in enumerate(before[:len(out)])
               ), result

  # Memory first, before device_put runs at all: its host path leaves
  # single-device arrays behind that would blur the accounting.
  assert abs(rp.live_device_bytes() - base - src_bytes) < 2**20
  peak_to, r = ours_peak(params, co.rollout_shardings)
  peak_back, params = ours_peak(r, co.train_shardings)
  ours_peak_bytes = max(peak_to, peak_back) - base

  r = jax.device_put(params, co.rollout_shardings)  # Compile device_put.
  b = jax.block_until_ready(jax.device_put(r, co.train_shardings))
  _free((params, r), b)
  params = b
  times = {k: [] for k in ("ours", "ours_back", "put", "put_back")}
  for _ in range(repeats):  # Interleaved: drift on the machine hits both.
    t0 = time.perf_counter()
    r = jax.block_until_ready(co.to_rollout(params))
    t1 = time.perf_counter()
    params = jax.block_until_ready(co.to_train(r))
    t2 = time.perf_counter()
    times["ours"].append(t1 - t0)
    times["ours_back"].append(t2 - t1)
    t0 = time.perf_counter()
    r = jax.block_until_ready(jax.device_put(params, co.rollout_shardings))
    t1 = time.perf_counter()
    b = jax.block_until_ready(jax.device_put(r, co.train_shardings))
    t2 = time.perf_counter()
    times["put"].append(t1 - t0)
    times["put_back"].append(t2 - t1)
    _free((params, r), b)
    params = b

  with _HostFetches() as ours_fetches:
    params = jax.block_until_ready(co.to_train(co.to_rollout(params)))
  # device_put: the increase of live bytes over the source copy alone.
  live0 = rp.live_device_bytes()
  with _HostFetches() as put_fetches:
    r = jax.block_until_ready(jax.device_put(params, co.rollout_shardings))
  put_to = rp.live_device_bytes() - live0 + src_bytes
  _free(params, r)
  live0 = rp.live_device_bytes()
  b = jax.block_until_ready(jax.device_put(r, co.train_shardings))
  put_back = rp.live_device_bytes() - live0 + dst_bytes
  _free(r, b)
  med = {k: statistics.median(v) for k, v in times.items()}
  return dict(
      layout=f"fsdp{fsdp}xtp{tensor} -> {8 // int(rollout_tensor)}x"
      f"tp{rollout_tensor}",
      superset=all(p.superset for p in plans),
      params_bytes_train=src_bytes, params_bytes_rollout=dst_bytes,
      bytes_moved=moved, bytes_moved_back=back_moved,
      ours_s=med["ours"], ours_back_s=med["ours_back"],
      put_s=med["put"], put_back_s=med["put_back"],
      ours_peak=ours_peak_bytes, put_peak=max(put_to, put_back),
      one_copy=one_copy, ours_host_fetches=ours_fetches.count,
      put_host_fetches=put_fetches.count,
      groups=len(co.groups))


def cpu_allocator_retained() -> bool:
  from benchmarks import cpu_allocator
  return cpu_allocator.retained()


def _table(rows):
  head = (f"{'layout':<22}{'method':<12}{'to rollout s':>13}{'to train s':>12}"
          f"{'peak/copy':>10}{'moved MB':>10}{'superset':>9}"
          f"{'host fetches':>13}")
  lines = [head, "-" * len(head)]
  for r in rows:
    for name, a, b, peak, host in (
        ("groups", r["ours_s"], r["ours_back_s"], r["ours_peak"],
         r["ours_host_fetches"]),
        ("device_put", r["put_s"], r["put_back_s"], r["put_peak"],
         r["put_host_fetches"])):
      lines.append(f"{r['layout']:<22}{name:<12}{a:>13.3f}{b:>12.3f}"
                   f"{peak / r['one_copy']:>10.3f}"
                   f"{r['bytes_moved'] / 2**20:>10.0f}"
                   f"{str(r['superset']):>9}{host:>13}")
  return "\n".join(lines)


def main(argv):
  del argv
  from benchmarks import cpu_allocator

  cpu_allocator.reexec_with_retained_memory()
  if _SMOKE.value:
    timing.smoke_defaults(
        repeats=1, num_layers=2, embed_dim=64, num_heads=2, num_kv_heads=1,
        head_dim=32, mlp_dim=128, vocab_size=256)
  timing.fake_cpu_devices(8)
  jax.config.update("jax_platforms", "cpu")
  from rlhf_jax.models.config import ModelConfig

  cfg = ModelConfig.tiny(
      num_layers=_NUM_LAYERS.value, embed_dim=_EMBED_DIM.value,
      num_heads=_NUM_HEADS.value, num_kv_heads=_NUM_KV_HEADS.value,
      head_dim=_HEAD_DIM.value, mlp_dim=_MLP_DIM.value,
      vocab_size=_VOCAB.value)
  repeats = _REPEATS.value or (3 if _QUICK.value else 7)
  t_start = time.perf_counter()
  rows = []
  for spec in _LAYOUTS.value.split(","):
    rows.append(_measure(spec, cfg, repeats))
    print(f"  {rows[-1]['layout']}: done ({time.perf_counter() - t_start:.0f}"
          "s)", flush=True)
  print(f"\nmodel: {cfg.num_params() / 1e6:.1f}M params "
        f"({cfg.num_params() * 4 / 2**20:.0f} MB fp32), {jax.device_count()} "
        f"CPU devices, median of {repeats} repeats, "
        f"{rows[0]['groups']} groups")
  print(_table(rows))
  head = rows[0]
  wall = time.perf_counter() - t_start
  print(f"wall time: {wall:.0f}s")
  report.emit(dict(
      repartition_s=round(head["ours_s"], 4),
      device_put_s=round(head["put_s"], 4),
      speedup_vs_device_put=round(head["put_s"] / head["ours_s"], 3),
      peak_bytes_over_one_copy=round(head["ours_peak"] / head["one_copy"], 4),
      device_put_peak_bytes_over_one_copy=round(
          head["put_peak"] / head["one_copy"], 4),
      repartition_back_s=round(head["ours_back_s"], 4),
      device_put_back_s=round(head["put_back_s"], 4),
      bytes_moved=head["bytes_moved"],
      bytes_moved_back=head["bytes_moved_back"],
      one_copy_bytes=head["one_copy"], layout=head["layout"],
      host_fetches=head["ours_host_fetches"],
      device_put_host_fetches=head["put_host_fetches"],
      superset=head["superset"],
      by_layout={r["layout"]: dict(
          repartition_s=round(r["ours_s"], 4),
          device_put_s=round(r["put_s"], 4),
          repartition_back_s=round(r["ours_back_s"], 4),
          device_put_back_s=round(r["put_back_s"], 4),
          peak_bytes_over_one_copy=round(r["ours_peak"] / r["one_copy"], 4),
          device_put_peak=round(r["put_peak"] / r["one_copy"], 4),
          bytes_moved=r["bytes_moved"], superset=r["superset"])
                 for r in rows},
      params_m=round(cfg.num_params() / 1e6, 2), repeats=repeats,
      quick=_QUICK.value, machine=platform.machine(),
      retained_allocator=cpu_allocator_retained(),
      wall_s=round(wall, 1)))


if __name__ == "__main__":
  app.run(main)
