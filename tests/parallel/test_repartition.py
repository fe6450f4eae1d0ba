"""Repartition between training and rollout layouts on 8 CPU devices.

Logits agree in both layouts, the round trip is bitwise, no parameter goes
through the host (transfer guard), memory stays near one copy, offload is
bitwise, and weight versions reject stale samples.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.samples import Request
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel import repartition as rp
from rlhf_jax.parallel import submesh
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl.learner import Learner, make_optimizer, OptimConfig
from rlhf_jax.parallel import colocate

CFG = ModelConfig.tiny(num_layers=3)
_HOST = {}


def _init(layout, cfg=CFG, seed=0):
  """Params of `cfg` on `layout`: one jitted init per config, then placed."""
  if (cfg, seed) not in _HOST:
    _HOST[cfg, seed] = jax.device_get(model_lib.init_params(cfg, seed)[1])
  host = _HOST[cfg, seed]
  graphdef, _ = model_lib.abstract_params(cfg)
  return graphdef, jax.device_put(host, layout.param_shardings(host))


def _layouts(fsdp, tensor, rollout_tensor):
  mesh = mesh_lib.make_mesh(fsdp=fsdp, tensor=tensor)
  return (mesh_lib.train_layout(mesh),
          mesh_lib.rollout_layout(mesh, rollout_tensor))


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _logits(params, layout, tokens):
  graphdef, _ = model_lib.abstract_params(CFG)

  def f(p, t):
    with use_layout(layout):
      pos = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
      return model_lib.forward(graphdef, p, t, pos, jnp.ones(t.shape, bool))

  return np.asarray(jax.jit(f)(params, tokens))


# (training fsdp, training tensor, rollout tensor): FSDP 8 -> 8 replicas,
# FSDP 4 x TP 2 -> 4 replicas x TP 2 (both supersets), FSDP 8 -> 4 x TP 2.
LAYOUTS = [(8, 1, 1), (4, 2, 2), (8, 1, 2)]


@pytest.fixture
def host_fetches(monkeypatch):
  """Counts whole-array device->host fetches, which the guard does not see.

  `jax.device_put` between meshes of the same device order reshards through
  `ArrayImpl._value` (host numpy) inside JAX, under any transfer guard.
  """
  from jax._src import array
  count = [0]
  orig = array.ArrayImpl._value

  def counted(x):
    count[0] += 1
    return orig.fget(x)

  monkeypatch.setattr(array.ArrayImpl, "_value", property(counted))
  return count


@pytest.mark.parametrize("fsdp,tensor,rollout_tensor", LAYOUTS)
def test_round_trip_is_bitwise_and_never_touches_the_host(
    fsdp, tensor, rollout_tensor, host_fetches):
  train, rollout = _layouts(fsdp, tensor, rollout_tensor)
  _, params = _init(train)
  want = _host(params)
  shardings = [x.sharding for x in jax.tree.leaves(params)]
  co = colocate.Colocation(train, rollout, params, offload=False)
  leaves = jax.tree.leaves(params)
  if fsdp == 8 and rollout_tensor == 1:  # The counter does see device_put.
    host_fetches[0] = 0
    jax.device_put(params, co.rollout_shardings)
    assert host_fetches[0] > 0
  host_fetches[0] = 0
  with jax.transfer_guard("disallow"):
    rparams = co.to_rollout(params)
  assert all(x.is_deleted() for x in leaves)  # One weight copy: donated.
  for x, s in zip(jax.tree.leaves(rparams),
                  jax.tree.leaves(co.rollout_shardings)):
    assert x.sharding == rp.canonical(s)
  with jax.transfer_guard("disallow"):
    back = co.to_train(rparams)
  assert host_fetches[0] == 0
  assert [x.sharding for x in jax.tree.leaves(back)] == [
      rp.canonical(s) for s in shardings]
  for a, b in zip(_host(back), want):
    np.testing.assert_array_equal(a, b)


def test_logits_identical_in_both_layouts():
  """Same math, two layouts: logits agree to fp32 reduction order."""
  train, rollout = _layouts(4, 2, 2)
  _, params = _init(train, seed=1)
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (8, 16))
  a = _logits(params, train, tokens)
  co = colocate.Colocation(train, rollout, params, offload=False)
  b = _logits(co.to_rollout(params), rollout, tokens)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=2e-6)
  assert a.std() > 0.1  # Not vacuous.
  assert np.argmax(a, -1).tolist() == np.argmax(b, -1).tolist()


def test_rollout_shard_is_a_superset_of_the_training_shard():
  for (fsdp, tensor, rt), superset in zip(LAYOUTS, (True, True, False)):
    train, rollout = _layouts(fsdp, tensor, rt)
    _, abstract = model_lib.abstract_params(CFG)
    like = train.param_shardings(abstract)
    structs = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        jax.tree.leaves(abstract), jax.tree.leaves(like))
    plans = rp.plan(structs, jax.tree.leaves(rollout.param_shardings(abstract)))
    assert all(p.superset for p in plans) == superset, (fsdp, tensor, rt)
    assert sum(p.bytes_moved for p in plans) > 0


@pytest.fixture
def counted_live_bytes():
  """For the tests that count live device bytes against a base: earlier
  tests' garbage collected first, and no collection while they count (one
  would free arrays the base holds; tests/conftest.py collects rarely)."""
  gc.collect()
  gc.disable()
  yield
  gc.enable()


@pytest.mark.usefixtures("counted_live_bytes")
@pytest.mark.parametrize("fsdp,tensor,rollout_tensor", LAYOUTS[:2])
def test_live_bytes_stay_near_one_copy(fsdp, tensor, rollout_tensor):
  train, rollout = _layouts(fsdp, tensor, rollout_tensor)
  _, params = _init(train)
  co = colocate.Colocation(train, rollout, params, offload=False)
  small = rp.tree_device_bytes(params)
  big = rp.tree_device_bytes(params, co.rollout_shardings)
  base = rp.live_device_bytes() - small

  def group_bytes(shardings):
    leaves = jax.tree.leaves(shardings)
    return [rp.tree_device_bytes([jax.tree.leaves(params)[i] for i in g],
                                 [leaves[i] for i in g]) for g in co.groups]

  group_train = max(group_bytes(co.train_shardings))
  peaks = []
  for dst in (co.rollout_shardings, co.train_shardings):
    out = group_bytes(dst)
    before = [rp.live_device_bytes() - base]
    params = rp.repartition(
        params, dst, groups=co.groups,
        on_group=lambda _: before.append(rp.live_device_bytes() - base))
    # While group i runs its sources and its targets are both alive.
    peaks.append(max(b + o for b, o in zip(before, out)))
    assert before[-1] == rp.tree_device_bytes(params)  # Sources freed.
  # One copy of the larger layout plus one group (in the smaller layout);
  # a one-shot reshard holds both copies: big + small.
  assert max(peaks) <= big + group_train, (peaks, big, group_train)
  assert group_train < small / 2


@pytest.mark.usefixtures("counted_live_bytes")
def test_offload_round_trip_is_bitwise():
  train, rollout = _layouts(8, 1, 1)
  graphdef, params = _init(train)
  learner = Learner(graphdef, train, make_optimizer(OptimConfig()),
                    terms_fn=None, weight_fn=None, micro_batches=1)
  # Adam state with non-zero moments (shardings as the learner makes them).
  opt_state = jax.jit(lambda s: jax.tree.map(lambda x: x + 3, s))(
      learner.init_state(params).opt_state)
  want = _host(opt_state)
  co = colocate.Colocation(train, rollout, params, offload=True)
  assert co.host_kind in ("pinned_host", "unpinned_host")
  before, opt_bytes = rp.live_device_bytes(), rp.tree_device_bytes(opt_state)
  parked = co.park(opt_state)
  assert not rp.on_device(parked)
  assert all(x.sharding.memory_kind == co.host_kind
             for x in jax.tree.leaves(parked))
  assert rp.live_device_bytes() <= before - opt_bytes  # Left the device.
  back = co.unpark(parked)
  assert rp.on_device(back)
  for a, b in zip(_host(back), want):
    np.testing.assert_array_equal(a, b)
  assert [x.sharding for x in jax.tree.leaves(back)] == [
      x.sharding for x in jax.tree.leaves(opt_state)]


@pytest.mark.usefixtures("counted_live_bytes")
def test_bf16_rollout_copy_halves_decode_weights_and_master_returns_bitwise():
  """rollout_dtype=bf16 on fp32 params: the rollout copy is the params cast
  (what bf16 compute reads anyway) in the rollout layout; the fp32 master
  waits in host memory during rollout and comes back bit for bit; device
  bytes during rollout are the bf16 copy's (half the fp32 rollout copy)."""
  train, rollout = _layouts(8, 1, 1)
  _, params = _init(train)
  want = _host(params)
  shardings = [x.sharding for x in jax.tree.leaves(params)]
  co = colocate.Colocation(train, rollout, params, offload=True,
                           rollout_dtype=jnp.bfloat16)
  fp32_rollout = rp.tree_device_bytes(params, co.rollout_shardings)
  base = rp.live_device_bytes() - rp.tree_device_bytes(params)
  cast = co.to_rollout(params)
  assert co.version == 1
  for x, w, s in zip(jax.tree.leaves(cast), want,
                     jax.tree.leaves(co.rollout_shardings)):
    assert x.dtype == jnp.bfloat16 and x.sharding.is_equivalent_to(s, x.ndim)
    np.testing.assert_array_equal(np.asarray(x, np.float32),
                                  w.astype(jnp.bfloat16).astype(np.float32))
  on_device = rp.live_device_bytes() - base
  assert on_device == rp.tree_device_bytes(cast) == fp32_rollout // 2
  back = co.to_train(cast)
  assert all(x.is_deleted() for x in jax.tree.leaves(cast))
  assert [x.sharding for x in jax.tree.leaves(back)] == shardings
  for a, b in zip(_host(back), want):
    np.testing.assert_array_equal(a, b)
  # Same dtype: no cast, the params themselves switch (the fp32 path).
  assert colocate.Colocation(train, rollout, back,
                             rollout_dtype=jnp.float32).rollout_dtype is None


def test_weight_version_increases_and_stale_samples_are_rejected():
  """The synchronous rollouts' staleness rule (`step_rollouts.keep_mask`,
  eta = 0) against the versions `to_rollout` counts; async's eta keeps
  samples up to eta versions old."""
  from rlhf_jax.rollout import step_rollouts
  train, rollout = _layouts(8, 1, 2)
  _, params = _init(train)
  co = colocate.Colocation(train, rollout, params, offload=False, version=3)
  rparams = co.to_rollout(params)
  assert co.version == 4
  versions = [co.version, co.version]
  keep = step_rollouts.keep_mask
  assert keep(versions, co.version, 0, "raise").all()
  co.to_rollout(co.to_train(rparams))
  assert co.version == 5
  with pytest.raises(step_rollouts.StaleSampleError,
                     match="weight versions \\[4\\]"):
    keep(versions, co.version, 0, "raise")
  assert keep(versions + [5], co.version, 0, "drop").tolist() == [
      False, False, True]
  assert keep([3, 4, 5], 5, 1).tolist() == [False, True, True]  # eta = 1.
  with pytest.raises(ValueError, match="on_stale"):
    keep([1], 1, 0, "keep")


def test_layer_groups_cover_layers_and_top_level_entries():
  _, abstract = model_lib.abstract_params(CFG)
  leaves = jax.tree.leaves(abstract)
  stacked = [x for x in leaves if x.shape[:1] == (CFG.num_layers,)]
  groups = rp.layer_groups(abstract)
  # Stacked layers: one group per stacked weight (each holds every layer's
  # copy of it); embed, final norm and head one each.
  assert len(stacked) == 9 and len(groups) == len(stacked) + 3
  assert sorted(i for g in groups for i in g) == list(range(len(leaves)))
  # Per-layer trees (a list of layers) group by layers_per_group layers.
  per_layer = {"embed": 0, "blocks": [{"q": 1, "k": 2}] * 4, "head": 3}
  assert len(rp.layer_groups(per_layer)) == 4 + 2
  assert len(rp.layer_groups(per_layer, 2)) == 2 + 2


def _decode(engines, params, prompts, split_after=None):
  """Samples of a rollout on engines["all"]; with `split_after`, it
  continues on engines["part"] (the split's rollout part) after that many
  decode steps, the samples on the dropped replicas moved there."""
  driver = Driver(engines["all"], params["all"])
  driver.start([Request(pid, p, 2, seed=5) for pid, p in prompts])
  out = []
  while driver.busy:
    if driver.stats.steps == split_after:
      out += driver.step()  # Read the step in flight, then move.
      assert driver.consolidate(engines["part"], params["part"])[0] > 0
    out += driver.step()
  return {s.key: s.tokens for s in out}


def test_a_split_keeps_an_in_flight_rollout_identical():
  train, rollout = _layouts(4, 2, 2)  # 4 replicas x TP 2.
  graphdef, params = _init(train)
  rparams = colocate.Colocation(train, rollout, params,
                                offload=False).to_rollout(params)
  part, scoring = submesh.split(rollout, (2, 2), kinds=("rollout", "train"))
  assert submesh.devices_of(part) == jax.devices()[:4]
  assert submesh.devices_of(scoring) == jax.devices()[4:]
  assert scoring.mesh.shape["fsdp"] == 4 and part.mesh.shape["data"] == 2
  merged = submesh.merge(submesh.split(rollout, (1, 3)))
  assert merged.mesh.devices.tolist() == rollout.mesh.devices.tolist()

  M = 6
  make = lambda layout: Engine(
      CFG, graphdef, layout, num_slots=4 * layout.mesh.shape["data"],
      samples_per_group=2, prefill_buckets=(8,), page_size=4,
      num_pages=16 * layout.mesh.shape["data"], decode_window=1,
      sampling=SamplingParams(max_new_tokens=M))
  engines = {"all": make(rollout), "part": make(part)}
  params = {"all": rparams,
            "part": jax.device_put(rparams, engines["part"].param_shardings)}
  rng = np.random.default_rng(3)
  prompts = [(100 + i, rng.integers(1, CFG.vocab_size, 3 + i))
             for i in range(4)]
  whole = _decode(engines, params, prompts)
  split = _decode(engines, params, prompts, split_after=2)
  assert whole == split
  assert all(len(t) == M for t in whole.values())
  assert len({tuple(t) for t in whole.values()}) > 4  # Samples differ.
