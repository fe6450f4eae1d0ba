"""Context parallelism: each sequence's tokens split over the `context` axis.

Under a training layout whose rule maps "length" to a `context` axis of C
devices, the decoder's trunk (`models/transformer.py`) runs every
per-token op (embedding, projections, MLP, norms, RoPE at each token's own
position) on its device's T / C tokens. Attention is the one op that reads
other tokens: each device gathers the keys and values of the whole
sequence over `context` (`jax.lax.all_gather` in `shard_map`) and attends
its own queries to them. Masks are by position and segment id
(`kernels_pallas/flash_attention.py`), never by index, so any order of the
tokens gives the same result; the gradient of the gather is a
reduce-scatter of the keys' and values' gradients.

Why a gather and not a ring (K/V blocks passed C - 1 times with
`ppermute`, an online softmax across the steps): both move (C - 1) / C of
a layer's keys and values into every device; the ring holds one block at a
time where the gather holds the whole sequence's K/V for a layer (GQA
keeps it small next to the activations: Qwen2.5-7B at 128K tokens, 4 kv
heads, 256 MiB of bf16 K and V), and the ring could overlap its transfers
with compute, which XLA does not schedule across our attention's loops.
The gather also keeps the one attention kernel we have unchanged.
`benchmarks/memory.py` measures what it costs (`..._cp<N>` keys).

Load balance: cut a sequence into 2 C chunks. With contiguous shards
device i holds chunks 2i and 2i + 1, which the causal mask lets attend to
4i + 3 (query chunk, key chunk) pairs: 3 on the first device, 4 C - 1 on
the last. The trunk therefore lays each sequence out so that device i
holds chunks i and 2 C - 1 - i ("zigzag"): 2 C + 1 pairs on every device. `balance` and `unbalance` move the chunks with two
`ppermute`s over `context` (a gather of the whole array would hold every
shard's activations on every device); the trunk balances its inputs once
and unbalances its output once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels_pallas import flash_attention as fa
from rlhf_jax.parallel.layout import Layout, active_layout

AXIS = "context"


def shards(layout: Layout | None = None) -> int:
  """Devices the active (or given) layout splits a sequence over."""
  layout = active_layout() if layout is None else layout
  if layout is None or dict(layout.rules).get("length") != AXIS:
    return 1
  return int(layout.mesh.shape.get(AXIS, 1))


def padded_length(T: int, C: int) -> int:
  """T rounded up to whole chunks: 2 C of them, each a multiple of 8."""
  unit = 2 * C * 8
  return -(-T // unit) * unit


def _chunk_destination(j: int, C: int) -> int:
  """The device that holds chunk j of 2 C in the balanced layout."""
  return j if j < C else 2 * C - 1 - j


def _tokens_spec(layout: Layout, x) -> P:
  """x's spec with its dims 0, 1 as (batch, length), the rest whole."""
  spec = layout.spec(("batch", "length"), x.shape[:2])
  return P(*spec, *([None] * (x.ndim - 2)))


def _move(x, *, to_balanced: bool):
  """`balance` / `unbalance` of one array [B, T, ...] (T = 2 C c)."""
  layout = active_layout()
  C = shards(layout)
  # Device d holds chunks 2d and 2d+1 in sequence order; chunk j belongs
  # to device _chunk_destination(j). Each of the two streams is a
  # permutation of the devices (even chunks below C stay even, those
  # above map to odd devices), so each is one ppermute.
  first = [(d, _chunk_destination(2 * d, C)) for d in range(C)]
  second = [(d, _chunk_destination(2 * d + 1, C)) for d in range(C)]
  flip = lambda pairs: [(b, a) for a, b in pairs]  # noqa: E731

  def local(x):
    c = x.shape[1] // 2
    lo, hi = x[:, :c], x[:, c:]
    # On device i, the first stream brings chunk i when i is even, chunk
    # 2C-1-i when odd: the balanced slots are (first, second) or swapped.
    even = jax.lax.axis_index(AXIS) % 2 == 0
    if to_balanced:
      a = jax.lax.ppermute(lo, AXIS, first)
      b = jax.lax.ppermute(hi, AXIS, second)
      return jnp.where(even, jnp.concatenate([a, b], 1),
                       jnp.concatenate([b, a], 1))
    a = jnp.where(even, lo, hi)  # What the first stream brought.
    b = jnp.where(even, hi, lo)
    return jnp.concatenate([jax.lax.ppermute(a, AXIS, flip(first)),
                            jax.lax.ppermute(b, AXIS, flip(second))], 1)

  spec = _tokens_spec(layout, x)
  return jax.shard_map(local, mesh=layout.mesh, in_specs=(spec,),
                       out_specs=spec)(x)


def balance(x):
  """[B, T, ...] in sequence order -> the balanced (zigzag) layout; T a
  multiple of 2 C (`padded_length`)."""
  return _move(x, to_balanced=True)


def unbalance(x):
  """The inverse of `balance`."""
  return _move(x, to_balanced=False)


def balanced_order(T: int, C: int) -> np.ndarray:
  """Sequence positions in the balanced layout's order (a test oracle and
  for reading): device i's tokens are chunks i and 2 C - 1 - i."""
  c = T // (2 * C)
  chunks = [j for i in range(C) for j in (i, 2 * C - 1 - i)]
  return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def attention(q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT, seg_BxT,
              sub_BxT, window, *, return_lse: bool, **kwargs):
  """Self-attention of sequences split over `context`: each device's
  queries against the whole sequence's keys and values, gathered
  (`fa.attention`'s other arguments in `kwargs`; `impl` "chunked" or
  "reference")."""
  layout = active_layout()
  tok_spec = layout.spec(("batch", "length"), positions_BxT.shape)
  if tok_spec[1] is None:  # A length C does not divide: not split here.
    return fa.attention(q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT,
                        positions_BxT, seg_BxT, seg_BxT, q_sub=sub_BxT,
                        k_sub=sub_BxT, window=window, return_lse=return_lse,
                        **kwargs)
  q_spec = layout.spec(("batch", "length", "heads", None), q_BxTxHxK.shape)
  kv_spec = layout.spec(("batch", "length", "kv_heads", None),
                        k_BxTxNxK.shape)
  lse_spec = P(*q_spec[:3])
  has_sub = sub_BxT is not None

  def local(q, k, v, pos, seg, sub, window):
    gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
    out = fa.attention(q, gather(k), gather(v), pos, gather(pos), seg,
                       gather(seg), q_sub=sub if has_sub else None,
                       k_sub=gather(sub) if has_sub else None, window=window,
                       return_lse=True, **kwargs)
    return out

  sub = sub_BxT if has_sub else jnp.zeros_like(seg_BxT)
  out, lse = jax.shard_map(
      local, mesh=layout.mesh,
      in_specs=(q_spec, kv_spec, kv_spec, tok_spec, tok_spec, tok_spec, P()),
      # Unchecked: the kernel's skip of empty blocks (`lax.cond`) mixes
      # the gathered (varying) keys with its constant zero branch.
      out_specs=(q_spec, lse_spec), check_vma=False)(
          q_BxTxHxK, k_BxTxNxK, v_BxTxNxK, positions_BxT, seg_BxT, sub,
          jnp.asarray(window, jnp.int32))
  return (out, lse) if return_lse else out
