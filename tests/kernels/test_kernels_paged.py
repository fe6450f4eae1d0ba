"""Paged prefix-shared decode attention against a float64 oracle.

The oracle is plain softmax attention of each slot's query over the keys it
should see, laid out densely ([common[:c] ; prompt[:p] ; own[:o]]) and
computed in numpy; the op reads the same KV scattered over shuffled pages of
a pool, with groups of ragged size, free slots and empty groups.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import paged_decode_attention as pda
from kernels_pallas import paged_decode_attention_gpu as gpu_kernel

import fakes  # tests/ is on sys.path

_op = jax.jit(pda.paged_decode_attention_reference,
              static_argnames=("scale", "logit_softcap", "return_lse",
                               "groups_read", "prompt_pages_read",
                               "own_pages_read"))
L = 2  # Pools of the kernel-shape tests have two layers.


def _case(seed, *, S=7, R=4, G=3, H=4, N=2, K=8, T=4, A=3, B=3, C=0,
          window=None):
  """Random groups/slots scattered over a shuffled pool, and the dense KV
  each live slot sees (for the oracle)."""
  rng = np.random.default_rng(seed)
  num_pages = 1 + R * A + S * B
  pool_k = rng.standard_normal((num_pages, T, N, K))
  pool_v = rng.standard_normal((num_pages, T, N, K))
  perm = rng.permutation(np.arange(1, num_pages))  # Page 0: never written.
  group_pages = perm[:R * A].reshape(R, A)
  own_pages = perm[R * A:].reshape(S, B)
  group_len = rng.integers(1, A * T + 1, R)
  group_len[-1] = 0  # An empty group entry.
  own_len = rng.integers(1, B * T + 1, S)
  # Slots into groups 0..R-2, ragged membership, one free slot (S-1).
  group_slots = -np.ones((R, G), np.int64)
  slot_group = np.zeros(S, np.int64)
  slot_member = np.zeros(S, np.int64)
  free_members = [(r, g) for r in range(R - 1) for g in range(G)]
  order = rng.permutation(len(free_members))[:S - 1]
  for s, i in enumerate(order):
    r, g = free_members[i]
    group_slots[r, g] = s
    slot_group[s], slot_member[s] = r, g
  common_k = rng.standard_normal((C, N, K))
  common_v = rng.standard_normal((C, N, K))
  common_len = int(rng.integers(1, C + 1)) if C else 0
  q = rng.standard_normal((S, H, K))
  q_pos = common_len + group_len[slot_group] + own_len - 1
  dense = []
  for s in range(S - 1):
    r = slot_group[s]
    pk = pool_k[group_pages[r]].reshape(-1, N, K)[:group_len[r]]
    pv = pool_v[group_pages[r]].reshape(-1, N, K)[:group_len[r]]
    ok = pool_k[own_pages[s]].reshape(-1, N, K)[:own_len[s]]
    ov = pool_v[own_pages[s]].reshape(-1, N, K)[:own_len[s]]
    dense.append((np.concatenate([common_k[:common_len], pk, ok]),
                  np.concatenate([common_v[:common_len], pv, ov])))
  # Layer 1 of a 2-layer pool (layer 0: other numbers, never to be read).
  other = rng.standard_normal((1, N, num_pages, T, K))
  args = dict(
      q_SxHxK=q,
      k_pages_LxNxPxTxK=np.concatenate([other, pool_k.transpose(2, 0, 1, 3)[None]]),
      v_pages_LxNxPxTxK=np.concatenate([other, pool_v.transpose(2, 0, 1, 3)[None]]),
      layer=1,
      slot_group_S=slot_group, slot_member_S=slot_member,
      group_slots_RxG=group_slots, group_pages_RxA=group_pages,
      group_len_R=group_len, own_pages_SxB=own_pages, own_len_S=own_len)
  if C:
    args.update(common_k_CxNxK=common_k, common_v_CxNxK=common_v,
                common_len=common_len)
  if window is not None:
    args.update(q_pos_S=q_pos, window=window)
  # Cast on the host (a cast of a device array compiles a program).
  args = {k: v if k == "layer" else jnp.asarray(np.asarray(
      v, np.float32 if np.asarray(v).dtype == np.float64 else np.int32))
          for k, v in args.items()}
  # Exactly what is live: the groups with members, the most pages of one
  # of their prompts, the most own pages of one slot.
  live_groups = (group_slots >= 0).any(axis=1)
  args["groups_read"] = int(live_groups.sum())
  args["prompt_pages_read"] = int(np.ceil(group_len[live_groups] / T).max())
  args["own_pages_read"] = int(np.ceil(own_len / T).max())
  return args, q, q_pos, dense


def _oracle(q, q_pos, dense, *, softcap=None, window=None):
  S, H, K = q.shape
  out = []
  for s, (k, v) in enumerate(dense):
    N = k.shape[1]
    qs = q[s].reshape(N, H // N, K)
    logits = np.einsum("nqk,tnk->nqt", qs, k) * K**-0.5
    if softcap is not None:
      logits = softcap * np.tanh(logits / softcap)
    if window is not None:  # Keys are at positions 0..len-1.
      pos = np.arange(k.shape[0])
      logits = np.where(q_pos[s] - pos < window, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out.append(np.einsum("nqt,tnk->nqk", p, v).reshape(H, K))
  return np.stack(out)


@pytest.mark.parametrize("C", [0, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_paged_equals_dense_oracle(C, softcap):
  args, q, q_pos, dense = _case(C + 1, C=C)
  out = _op(**args, logit_softcap=softcap)
  want = _oracle(q, q_pos, dense, softcap=softcap)
  np.testing.assert_allclose(np.asarray(out)[:-1], want, atol=2e-5)
  assert np.isfinite(np.asarray(out)).all()  # Free slot: garbage, not NaN.


@pytest.mark.parametrize("gqa", [(4, 1), (4, 4)])
def test_paged_window_and_gqa(gqa):
  H, N = gqa
  args, q, q_pos, dense = _case(11, H=H, N=N, C=3, window=6)
  out = _op(**args)
  want = _oracle(q, q_pos, dense, window=6)
  np.testing.assert_allclose(np.asarray(out)[:-1], want, atol=2e-5)


def test_surplus_reads_are_masked():
  """Larger bounds (a bigger bucket: a group without live members, pages
  past every length) read masked surplus: same result, whatever page ids
  sit past a row's length."""
  args, *_ = _case(5)
  out = _op(**args)
  wide = dict(args)
  junk = lambda t: jnp.concatenate([t, jnp.ones_like(t[:, :2]) * 3], axis=1)
  wide["group_pages_RxA"] = junk(args["group_pages_RxA"])
  wide["own_pages_SxB"] = junk(args["own_pages_SxB"])
  wide["groups_read"] += 1
  wide["prompt_pages_read"] += 2
  wide["own_pages_read"] += 2
  np.testing.assert_allclose(_op(**wide), out, atol=1e-6)


def test_a_group_past_the_bound_is_not_read():
  """Groups with live members come first, whatever their entries: with
  the bound at the live count every live slot is served (an empty entry
  sits before them in the table)."""
  args, q, q_pos, dense = _case(6)
  gs = np.asarray(args["group_slots_RxG"])
  assert not (gs[-1] >= 0).any()  # The empty entry, moved to the front.
  order = np.r_[len(gs) - 1, np.arange(len(gs) - 1)]
  inverse = np.argsort(order)
  moved = dict(args, group_slots_RxG=jnp.asarray(gs[order]),
               group_pages_RxA=args["group_pages_RxA"][order],
               group_len_R=args["group_len_R"][order],
               slot_group_S=jnp.asarray(inverse)[args["slot_group_S"]])
  np.testing.assert_allclose(np.asarray(_op(**moved))[:-1],
                             _oracle(q, q_pos, dense), atol=2e-5)


KERNEL_CASES = [
    dict(seed=7, C=0), dict(seed=12, C=5, softcap=3.0),
    dict(seed=3, C=3, H=4, N=1, window=6),
    dict(seed=4, C=0, H=8, N=2, T=8, window=5),
    dict(seed=5, C=2, A=6, B=9, window=13)]  # Several page blocks.


def _check_kernel(kernel, case, *, interpret, dtype=jnp.float32, atol=2e-5):
  case = dict(case)
  softcap = case.pop("softcap", None)
  args, q, q_pos, dense = _case(case.pop("seed"), **case)
  for k in ("groups_read", "prompt_pages_read", "own_pages_read"):
    args.pop(k)
  for k in ("q_SxHxK", "k_pages_LxNxPxTxK", "v_pages_LxNxPxTxK"):
    args[k] = args[k].astype(dtype)
  out = jax.jit(functools.partial(
      pda.paged_decode_attention, impl="pallas", kernel=kernel,
      interpret=interpret, logit_softcap=softcap))(**args)
  if dtype != jnp.float32:  # The oracle sees the rounded inputs.
    rounded = lambda x: np.asarray(  # noqa: E731
        jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32),
        np.float64)
    q = rounded(q)
    dense = [(rounded(k), rounded(v)) for k, v in dense]
  want = _oracle(q, q_pos, dense, softcap=softcap, window=case.get("window"))
  np.testing.assert_allclose(np.asarray(out, np.float64)[:-1], want,
                             atol=atol)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_interpreted_equals_oracle(kernel, case):
  """The Pallas GPU (Triton) and TPU (Mosaic) kernels, in interpret mode
  here, against the fp64 oracle: ragged lengths, an empty group, a free
  slot, GQA, soft-cap, common prefix, sliding windows that start inside
  and before the prompt."""
  _check_kernel(kernel, case, interpret=True)


# Groups of 8 members x 4 query rows (M = 32): two row blocks of 16.
SPLIT_CASES = [dict(seed=21, G=8, H=8, N=2, A=9, B=7, C=2, window=13),
               dict(seed=22, G=8, H=8, N=2, A=9, B=7, softcap=3.0)]


def _split_launch(X, N, M, A, **kw):
  """Row blocks of 16 and 3 key splits, whatever the shapes."""
  del X, N, A, kw
  return max(1, M // 16), 3


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_gpu_kernel_row_blocks_and_key_splits_equal_oracle(case,
                                                           monkeypatch):
  """A segment's rows in blocks and its keys walked by 3 programs, whose
  parts merge exactly (interpreted here)."""
  monkeypatch.setattr(gpu_kernel, "launch_shape", _split_launch)
  _check_kernel("gpu", case, interpret=True)


# The engine's launch shape at Qwen2.5-1.5B's heads (12 query / 2 kv, so
# 16 members x 6 rows = 96, padded to 128) and 2048-token prompts in pages
# of 16: one row block of 128 and 4 key splits (`launch_shape`), unpatched.
ENGINE_CASE = dict(seed=31, S=32, R=3, G=16, H=12, N=2, K=16, T=16, A=128,
                   B=4)


def test_gpu_kernel_at_the_engine_launch_shape():
  """Two groups of 16 samples with prompts up to 2048 tokens: the
  launch shape the GPU decode runs (interpreted here)."""
  assert gpu_kernel.launch_shape(3, 2, 128, 128) == (1, 4)
  _check_kernel("gpu", ENGINE_CASE, interpret=True)


def test_launch_shape_of_the_engine_decode():
  """Qwen2.5-1.5B decode, 16 prompts x G=16 over 256 slots, prompt 2048 in
  pages of 16: a group's 16 x 6 query rows (padded to 128) in one program
  of 8 warps and its 128 prompt pages walked by 4 programs (8 blocks of 4
  pages each): 16 x 2 x 1 x 4 = 128 programs; each slot's own part: 1 x 1
  at 4 warps."""
  assert gpu_kernel.launch_shape(16, 2, 128, 128) == (1, 4)
  assert gpu_kernel.warps_for(128) == 8 and gpu_kernel.warps_for(16) == 4
  # Rows a program: the 128 x 128 fp32 accumulator measured, at any head dim.
  assert [gpu_kernel.rows_for_head_dim(k) for k in (64, 128, 256)] == [
      256, 128, 64]
  assert gpu_kernel.launch_shape(256, 2, 16, 34) == (1, 1)
  assert gpu_kernel.launch_shape(1, 2, 16, 512) == (1, 16)  # One long slot.


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="compiles the Triton kernel: a GPU only")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", KERNEL_CASES + SPLIT_CASES + [ENGINE_CASE])
def test_gpu_kernel_compiled_equals_oracle(case, dtype, monkeypatch):
  """The same cases through the compiled Triton kernel on a GPU
  (`JAX_PLATFORMS=cuda pytest ...`), fp32 and a bf16 pool; the split
  cases with row blocks and key splits. Head dim 8 (the small cases: fp32
  dots) and 16 (the engine's case: bf16 tensor-core dots for a bf16
  pool)."""
  if case in SPLIT_CASES:
    monkeypatch.setattr(gpu_kernel, "launch_shape", _split_launch)
  bf16 = dtype == "bfloat16"
  _check_kernel("gpu", case, interpret=False, dtype=jnp.dtype(dtype),
                atol=2e-2 if bf16 else 2e-5)


def _decode_shapes():
  """Qwen2.5-1.5B-like decode in bf16: 64 slots, 16 groups of 8, 16 query
  / 2 kv heads of 128, a pool of 512 pages of 16 tokens."""
  S, H, N, K, P, T, R, G, A, B = 64, 16, 2, 128, 512, 16, 16, 8, 32, 128
  sd, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
  return (sd((S, H, K), bf16), sd((L, N, P, T, K), bf16),
          sd((L, N, P, T, K), bf16),
          sd((S,), i32), sd((S,), i32), sd((R, G), i32), sd((R, A), i32),
          sd((R,), i32), sd((S, B), i32), sd((S,), i32))


@pytest.mark.parametrize("windowed", [False, True])
def test_paged_kernel_lowers_for_tpu(windowed):
  """The TPU kernel lowers for TPU on this CPU machine: the exported module
  holds its two Mosaic custom calls (prompt and own parts), with and
  without a sliding window (a traced one and a traced layer, as in a
  scanned Gemma 2)."""
  args = _decode_shapes()
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  extra = ((jax.ShapeDtypeStruct((64,), jnp.int32), i32, i32) if windowed
           else ())

  def f(*a):
    kw = dict(q_pos_S=a[10], window=a[11], layer=a[12]) if windowed else {}
    return pda.paged_decode_attention(*a[:10], impl="pallas", kernel="tpu",
                                      interpret=False, **kw)

  exported = jax.export.export(jax.jit(f), platforms=("tpu",))(*args, *extra)
  assert exported.mlir_module().count("tpu_custom_call") == 2


def test_gpu_kernel_lowers_for_cuda():
  """The GPU kernel lowers for CUDA on this CPU machine (Triton custom call
  in the exported module) at Qwen2.5-1.5B-like decode shapes in bf16: 64
  slots, 16 groups of 8, 16 query / 2 kv heads of 128, pages of 16."""
  args = _decode_shapes()
  f = jax.jit(functools.partial(pda.paged_decode_attention, impl="pallas",
                                kernel="gpu", interpret=False))
  triton = "__gpu$xla.gpu.triton"
  exported = jax.export.export(
      f, platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(
          *args)
  assert exported.mlir_module().count(triton) == 2  # Prompt and own parts.


def _sharded_op(layout, **kw):
  """The dispatcher inside a jit with the rollout layout active, the pool
  and queries placed as the paged engine places them (heads over tensor)."""
  from rlhf_jax.parallel.layout import use_layout  # pylint: disable=g-import-not-at-top

  def f(args):
    with use_layout(layout):
      return pda.paged_decode_attention(**args, **kw)
  return jax.jit(f)


def _place(layout, args):
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  axes = {"q_SxHxK": ("batch", "heads", None),
          "k_pages_LxNxPxTxK": (None, "kv_heads", "batch", None, None),
          "v_pages_LxNxPxTxK": (None, "kv_heads", "batch", None, None),
          "common_k_CxNxK": (None, "kv_heads", None),
          "common_v_CxNxK": (None, "kv_heads", None)}
  placed = {}
  for name, x in args.items():
    if isinstance(x, jax.Array) or hasattr(x, "shape"):
      spec = layout.spec(axes.get(name, (None,) * x.ndim), x.shape)
      placed[name] = (jax.device_put(x, NamedSharding(layout.mesh, spec))
                      if isinstance(x, jax.Array) else
                      jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=NamedSharding(
                                               layout.mesh, spec)))
    else:
      placed[name] = x
  return placed


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_sharded_kernel_equals_oracle_on_8_devices(kernel):
  """Each kernel under shard_map over 4 replicas x tensor 2 (interpreted):
  each device runs its kv heads, with a common prefix and a traced window;
  the fp64 oracle's numbers."""
  layout = fakes.rollout_layout8(2)
  args, q, q_pos, dense = _case(21, S=8, H=4, N=2, C=4, window=7)
  for k in ("groups_read", "prompt_pages_read", "own_pages_read"):
    args.pop(k)
  args["window"] = jnp.asarray(7, jnp.int32)
  args["layer"] = jnp.asarray(1, jnp.int32)
  out = _sharded_op(layout, impl="pallas", kernel=kernel, interpret=True)(
      _place(layout, args))
  np.testing.assert_allclose(np.asarray(out)[:-1],
                             _oracle(q, q_pos, dense, window=7), atol=2e-5)


def test_sharded_paged_kernel_lowers_for_tpu():
  """What the paged engine runs on a TPU slice (4 replicas x tensor 2),
  exported for TPU from this CPU: both Mosaic kernels inside one shard_map,
  each device on its replica's slots (16 of 64) and pages (128 of 512),
  its kv head (one of 2) and query heads (8 of 16)."""
  import re  # pylint: disable=g-import-not-at-top
  layout = fakes.rollout_layout8(2)
  names = ("q_SxHxK", "k_pages_LxNxPxTxK", "v_pages_LxNxPxTxK", "slot_group_S",
           "slot_member_S", "group_slots_RxG", "group_pages_RxA",
           "group_len_R", "own_pages_SxB", "own_len_S")
  specs = _place(layout, dict(zip(names, _decode_shapes())))
  text = jax.export.export(
      _sharded_op(layout, impl="pallas", kernel="tpu", interpret=False),
      platforms=("tpu",))(specs).mlir_module()
  assert text.count("tpu_custom_call") == 2
  assert "manual_computation" in text or "SPMDFullToShardShape" in text
  dims = [[int(d) for d in m.split("x")[:-1]]
          for m in re.findall(r"tensor<((?:\d+x)+)", text)]
  assert [L, 1, 128, 16, 128] in dims, "the per-device pool"
  assert [16, 8, 128] in dims, "the per-device queries"
