"""Engine and driver: prompt sharing, placement independence, compiles, errors.

The oracles are independent of the sharing under test: a prompt's G samples
in one group (its KV stored and read once) against G one-sample requests
(each its own copy), one layout against another, a scanned model against
an unrolled one, a run with stop tokens against one without."""

import dataclasses

import jax
import numpy as np
import pytest

import fakes
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Request
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import model as model_lib
from rlhf_jax.models import rollout_copy
from rlhf_jax.parallel import mesh as mesh_lib

CFG = fakes.TINY_CFG
STOP = 5
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95,
                         max_new_tokens=10, stop_tokens=(STOP,))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


def _prompts(n=5, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(6, CFG.vocab_size, rng.integers(3, 14)).astype(np.int32)
          for _ in range(n)]


def _run(model, layout, requests, *, rows, per_row, sampling=SAMPLED,
         buckets=(8, 16), cfg=CFG):
  graphdef, params = model
  engine = _engine(cfg, graphdef, layout, rows=rows, per_row=per_row,
                   buckets=buckets, sampling=sampling)
  driver = Driver(engine, mesh_lib.to_layout(params, layout))
  out = {s.key: s for s in driver.run(requests)}
  return out, engine, driver


def _engine(cfg, graphdef, layout, *, rows, per_row, buckets=(8, 16),
            sampling=SAMPLED):
  """`rows` groups of `per_row` samples: as many slots as samples."""
  return Engine(cfg, graphdef, layout, num_slots=rows * per_row,
                     samples_per_group=per_row, prefill_buckets=buckets,
                     sampling=sampling, page_size=4)


def _grouped(prompts, g, seed=3):
  return [Request(i, p, g, seed=seed) for i, p in enumerate(prompts)]


def _repeated(prompts, g, seed=3):
  return [Request(i, p, 1, seed=seed, first_sample_index=j)
          for i, p in enumerate(prompts) for j in range(g)]


def _assert_same(a, b, logp_atol=1e-5):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].tokens == b[k].tokens, k
    assert a[k].finish_reason == b[k].finish_reason, k
    np.testing.assert_allclose(a[k].logp_raw, b[k].logp_raw, atol=logp_atol)
    np.testing.assert_allclose(a[k].logp, b[k].logp, atol=logp_atol)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_groups_equal_independent_copies(model, mesh8, sampling):
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  prompts, g = _prompts(), 4
  shared, *_ = _run(model, layout, _grouped(prompts, g), rows=4, per_row=g,
                    sampling=sampling)
  copies, *_ = _run(model, layout, _repeated(prompts, g), rows=8, per_row=1,
                    sampling=sampling)
  assert len(shared) == len(prompts) * g
  _assert_same(shared, copies)
  if not sampling.greedy:  # The G samples of a prompt really differ.
    assert len({tuple(shared[0, j].tokens) for j in range(g)}) > 1


@pytest.mark.slow
def test_placement_independence(model, mesh8):
  prompts, g = _prompts(7, seed=1), 2
  base, *_ = _run(model, mesh_lib.rollout_layout(mesh8, tensor=2),
                  _grouped(prompts, g), rows=4, per_row=g)
  # Fewer slots, reversed admission order, and 8 replicas instead of 4.
  reordered, *_ = _run(model, mesh_lib.rollout_layout(mesh8, tensor=1),
                       _grouped(prompts, g)[::-1], rows=8, per_row=4)
  _assert_same(base, reordered)
  # One replica of tensor 8 (kv heads are not split: 2 heads over 8 devices).
  tp8, *_ = _run(model, mesh_lib.rollout_layout(mesh8, tensor=8),
                 _grouped(prompts, g), rows=2, per_row=g)
  _assert_same(base, tp8)


def test_sharded_rollout_equals_one_device(model, mesh8, mesh1):
  prompts, g = _prompts(4, seed=2), 4
  sharded, *_ = _run(model, mesh_lib.rollout_layout(mesh8, tensor=2),
                     _grouped(prompts, g), rows=4, per_row=g)
  single, *_ = _run(model, mesh_lib.rollout_layout(mesh1),
                    _grouped(prompts, g), rows=4, per_row=g)
  _assert_same(sharded, single)


def test_unrolled_rollout_layers_sample_what_the_scan_samples(model, mesh8):
  """rollout.scan_layers=False (`rollout_copy.rollout_model`): the same
  stacked params run as a Python loop over the layers, with no scan left
  in the model; its samples and log-probs equal the scanned model's."""
  graphdef, params = model
  cfg, unrolled, weights = rollout_copy.rollout_model(CFG, graphdef,
                                                      scan_layers=False)
  assert weights is None and not cfg.scan_layers and CFG.scan_layers
  for scan in (True, False):  # Unasked, the rollout runs as the model does.
    same = CFG.replace(scan_layers=scan)
    assert rollout_copy.rollout_model(same, graphdef)[:2] == (same, graphdef)
  tokens = np.ones((2, 8), np.int32)
  positions = np.tile(np.arange(8, dtype=np.int32), (2, 1))
  mask = np.ones((2, 8), bool)

  def primitives(g):
    jaxpr = jax.make_jaxpr(lambda p: model_lib.forward(
        g, p, tokens, positions, mask))(params)
    return {str(e.primitive) for e in jaxpr.jaxpr.eqns}
  assert "scan" in primitives(graphdef)
  assert "scan" not in primitives(unrolled)
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  requests = _grouped(_prompts(4, seed=5), 2)
  scanned, *_ = _run(model, layout, requests, rows=4, per_row=2)
  looped, *_ = _run((unrolled, params), layout, requests, rows=4, per_row=2,
                    cfg=cfg)
  _assert_same(scanned, looped)


def test_generate_compiles_once_over_50_steps(model, mesh8):
  sampling = SamplingParams(temperature=1.0, max_new_tokens=25)
  prompts = _prompts(6, seed=4)  # Two waves through 4 rows: >= 50 steps.
  out, engine, driver = _run(model, mesh_lib.rollout_layout(mesh8, tensor=2),
                             _grouped(prompts, 2), rows=4, per_row=2,
                             sampling=sampling)
  assert driver.stats.steps >= 50
  assert engine.trace_counts["generate"] == 1
  assert engine.trace_counts["insert"] <= len(engine.buckets)
  assert all(len(s.tokens) == 25 and s.finish_reason == "length"
             for s in out.values())


def test_an_equal_engine_reuses_the_programs_of_a_live_one(model, mesh8):
  """An engine built with the same arguments as a live one (a job's or a
  test's engines rebuilt) runs that one's jitted programs: the same
  tokens, and nothing traced again; one with other arguments traces its
  own."""
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  requests = _grouped(_prompts(3, seed=6), 2)
  first = _engine(CFG, graphdef, layout, rows=2, per_row=2)
  params = mesh_lib.to_layout(params, layout)
  want = {s.key: s for s in Driver(first, params).run(requests)}
  traced = dict(first.trace_counts)
  assert traced["generate"] >= 1 and traced["prefill"] >= 1
  again = _engine(CFG, graphdef, layout, rows=2, per_row=2)
  assert dict(again.trace_counts) == traced  # first's counts, ...
  _assert_same({s.key: s for s in Driver(again, params).run(requests)},
               want, logp_atol=0)
  assert dict(again.trace_counts) == traced  # ... and nothing traced again.
  other = Engine(CFG, graphdef, layout, num_slots=8, samples_per_group=2,
                 prefill_buckets=(8, 16), sampling=SAMPLED, page_size=4,
                 decode_window=3)  # Arguments no other test's engine has.
  assert not other.trace_counts
  _assert_same({s.key: s for s in Driver(other, params).run(requests)},
               want)
  assert other.trace_counts["generate"] >= 1
  assert dict(first.trace_counts) == traced
  del first  # Kept alive by `again` (it runs first's programs).


def test_stop_tokens_and_sample_fields(model, mesh8):
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  requests = _grouped(_prompts(4), 4)
  out, *_ = _run(model, layout, requests, rows=4, per_row=4)
  # Oracle: the same requests without stop tokens. A token's key depends
  # only on (seed, prompt, sample, position), so a stop token ends a
  # sample right after its first occurrence and changes nothing before it.
  no_stop = dataclasses.replace(SAMPLED, stop_tokens=())
  full, *_ = _run(model, layout, requests, rows=4, per_row=4,
                  sampling=no_stop)
  assert out.keys() == full.keys() and len(out) == 16
  reasons = []
  for k, s in out.items():
    f = full[k]
    assert len(f.tokens) == SAMPLED.max_new_tokens and (
        f.finish_reason == "length")
    if STOP in f.tokens:
      n = f.tokens.index(STOP) + 1
      want = (f.tokens[:n], "stop")
    else:
      n, want = len(f.tokens), (f.tokens, "length")
    assert (s.tokens, s.finish_reason) == want, k
    assert len(s.tokens) == len(s.logp) == len(s.logp_raw) == n
    np.testing.assert_allclose(s.logp_raw, f.logp_raw[:n], atol=1e-5)
    np.testing.assert_allclose(s.logp, f.logp[:n], atol=1e-5)
    assert s.weight_version == 0
    assert all(lp <= 0 for lp in s.logp_raw)
    reasons.append(s.finish_reason)
  # Both endings occur, so both branches above were checked.
  assert 0 < reasons.count("stop") < len(reasons), reasons


def test_bad_inputs_raise_clear_errors(model, mesh8):
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  run = lambda reqs, **kw: list(_run(model, layout, reqs, rows=4, per_row=2,
                                     **kw)[0])
  with pytest.raises(ValueError, match="prompt 7 has 17 tokens, longer than"):
    run([Request(7, np.ones(17, np.int32), 1)])
  with pytest.raises(ValueError, match="prompt 3 asks for num_samples=3"):
    run([Request(3, np.ones(4, np.int32), 3)])
  with pytest.raises(ValueError, match=r"prompt 2 has token ids \[64\] outside"):
    run([Request(2, np.array([6, 64], np.int32), 1)])
  with pytest.raises(ValueError, match="prompt 9 is empty"):
    run([Request(9, np.array([], np.int32), 1)])
  for bad, msg in [(dict(temperature=-1.0), "temperature"),
                   (dict(top_p=0.0), "top_p"), (dict(top_k=100), "top_k"),
                   (dict(max_new_tokens=0), "max_new_tokens"),
                   (dict(stop_tokens=(64,)), "stop_tokens")]:
    with pytest.raises(ValueError, match=f"invalid sampling parameters.*{msg}"):
      _engine(CFG, graphdef, layout, rows=4, per_row=2, buckets=(8,),
              sampling=SamplingParams(**bad))
  with pytest.raises(ValueError, match="num_slots=6 must be a multiple of "
                     "the layout's 4 data replicas"):
    _engine(CFG, graphdef, layout, rows=3, per_row=2, buckets=(8,))
