"""Full-sequence attention (training, log-probs, prefill) without T x T.

Dimension letters: B batch, T query length, S key length, H query heads, N
kv heads (GQA: Q = H/N queries per kv head), K head dim.

Which keys a query sees is given by per-token ids, so one op covers causal
sequences, padding, packed rows of several sequences, packed groups (a
prompt shared by its responses), the grouped layout's prompt part and a
shared context:
  allowed(t, s) = seg_q[t] == seg_k[s]
                  and (sub_k[s] == 0 or sub_k[s] == sub_q[t])
                  and (not causal or pos_k[s] <= pos_q[t])
                  and pos_q[t] - pos_k[s] < window
(pad tokens carry a segment no real token has; `sub` is optional: in a
packed group the prompt is sub 0, seen by every response, and response g
is sub g + 1, seen by itself only). Scores are scaled, then
soft-capped (Gemma 2: cap * tanh(s / cap)), and the softmax is fp32.

Implementations (`attention(..., impl=)`):
  "reference" (`attention_reference`): materialises the [B, H, T, S] scores;
    the oracle of the tests, and fine for tiny shapes.
  "chunked" (`chunked_attention`): online softmax over key blocks for each
    query block (jnp + `jax.lax.scan`), with its own VJP that recomputes the
    scores block by block from the saved log-sum-exp (flash attention's
    backward), so neither pass holds more than a [bq, bk] block of scores
    per head; blocks with no allowed pair are skipped (`lax.cond`) where
    `SKIP_EMPTY_BLOCKS` says so (not on GPU). Runs on every backend; the
    default on CPU, and on GPU and TPU whenever the vendor kernel cannot
    take a feature.
  "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (GPU
    flash): causal self-attention of one sequence per row, right padding,
    sliding window; no soft-cap, no packed segments, no log-sum-exp.
  "splash": the Pallas TPU splash kernel of `jax.experimental.pallas.ops`
    (causal or local masks, segment ids, soft-cap), under `shard_map` over
    the active layout's batch and head axes; self-attention of contiguous
    segments (positions one apart), no log-sum-exp.
  "auto": splash on TPU, cuDNN on GPU, where they take the call; chunked
    otherwise (never a silent T x T fallback); when T and S are both at
    most one block (128), the scores in one piece ("reference": the same
    memory as one chunked block, without the loops).
Returns (out [B, T, H, K] in q's dtype, lse [B, T, H] fp32) when
`return_lse` (a part merged with others by `attention_parts.merge_parts`;
the log-sum-exp gets gradients), else out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention_parts import cap_logits

NO_WINDOW = np.iinfo(np.int32).max
# "auto" computes scores of at most this many queries x keys in one piece
# (the chunked path's own block size: holding them is what it does too).
_ONE_BLOCK = 128
_PAD_Q, _PAD_K = -2, -3  # Segments of block padding: match nothing.
# Whether the chunked path skips a block pair with no allowed (query, key)
# by `lax.cond`, per backend (default: skip). Not on GPU: XLA's GPU
# conditional copies its predicate to the host and waits for it, so a step
# of ~10^5 block pairs spent most of its time in those waits (a whole GRPO
# step's train step ran > 105 s on an H200, docs/results.md, GPU); there a
# masked block is computed and contributes nothing, which costs at most the
# causal half's FLOPs. `tools/lowered_step.py --noskip` counts a step so.
SKIP_EMPTY_BLOCKS = {"gpu": False}


def _if_any(ok, update, carry):
  """update(carry) where some pair of the block is allowed, else carry;
  unconditionally where the backend does not skip (`SKIP_EMPTY_BLOCKS`)."""
  if not SKIP_EMPTY_BLOCKS.get(jax.default_backend(), True):
    return update(carry)
  return jax.lax.cond(jnp.any(ok), update, lambda c: c, carry)




def _allowed(q_pos, k_pos, q_seg, k_seg, window, causal, q_sub=None,
             k_sub=None):
  """[B, T, S] bool of `allowed` (module doc)."""
  ok = q_seg[:, :, None] == k_seg[:, None, :]
  if q_sub is not None:
    ok &= (k_sub[:, None, :] == 0) | (k_sub[:, None, :] == q_sub[:, :, None])
  dist = q_pos[:, :, None] - k_pos[:, None, :]
  if causal:
    ok &= dist >= 0
  return ok & (dist < window)


def attention_reference(q, k, v, q_pos, k_pos, q_seg, k_seg, *,
                        window=NO_WINDOW, softcap=None, scale=None,
                        causal=True, q_sub=None, k_sub=None):
  """(out, lse) with the full [B, N, Q, T, S] scores (the test oracle)."""
  B, T, H, K = q.shape
  N = k.shape[2]
  scale = K**-0.5 if scale is None else scale
  qg = q.reshape(B, T, N, H // N, K)
  s = jnp.einsum("btnqk,bsnk->bnqts", qg, k,
                 preferred_element_type=jnp.float32) * scale
  s = cap_logits(s, softcap)
  ok = _allowed(q_pos, k_pos, q_seg, k_seg, window, causal, q_sub,
                k_sub)[:, None, None]
  s = jnp.where(ok, s, -jnp.inf)
  m = jnp.max(s, -1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])
  l = jnp.sum(p, -1)
  out = jnp.einsum("bnqts,bsnk->btnqk", p / jnp.where(l > 0, l, 1.0)[..., None],
                   v.astype(jnp.float32))
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return (out.reshape(B, T, H, K).astype(q.dtype),
          jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, T, H))


# ------------------------------------------------------------ chunked (jnp)
def _allowed_ids(q_pos, k_pos, q_ids, k_ids, window, causal):
  """`_allowed` of id arrays [..., 2] = (segment, sub)."""
  return _allowed(q_pos, k_pos, q_ids[..., 0], k_ids[..., 0], window, causal,
                  q_ids[..., 1], k_ids[..., 1])


def _pad_to(x, size, axis, value):
  extra = -x.shape[axis] % size
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _blocks(x, size):
  """[B, L, ...] -> [L/size, B, size, ...]."""
  B, L = x.shape[:2]
  return jnp.moveaxis(x.reshape((B, L // size, size) + x.shape[2:]), 1, 0)


def _unblocks(x):
  """[nb, B, size, ...] -> [B, nb * size, ...]."""
  nb, B, size = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape((B, nb * size) + x.shape[3:])


def _block_scores(qb, kb, scale, softcap):
  """(capped scores, pre-cap scores) [B, N, Q, bq, bk] fp32."""
  s0 = jnp.einsum("bqnhk,bsnk->bnhqs", qb, kb,
                  preferred_element_type=jnp.float32) * scale
  return cap_logits(s0, softcap), s0


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _chunked(q, k, v, q_pos, k_pos, q_seg, k_seg, window, scale, softcap,
             causal, bq, bk):
  out, lse, _ = _chunked_fwd_impl(q, k, v, q_pos, k_pos, q_seg, k_seg,
                                  window, scale, softcap, causal, bq, bk)
  return out, lse


def _chunked_fwd_impl(q, k, v, q_pos, k_pos, q_seg, k_seg, window, scale,
                      softcap, causal, bq, bk):
  """Blocked online softmax. q [B, Tp, N, Q, K] (padded), k/v [B, Sp, N, K]."""
  qs, ks, vs = _blocks(q, bq), _blocks(k, bk), _blocks(v, bk)
  qps, kps = _blocks(q_pos, bq), _blocks(k_pos, bk)
  qss, kss = _blocks(q_seg, bq), _blocks(k_seg, bk)
  B, _, N, Q, K = q.shape

  def q_block(inputs):
    qb, qp, qsg = inputs

    def k_block(carry, kin):
      kb, vb, kp, ksg = kin
      ok = _allowed_ids(qp, kp, qsg, ksg, window, causal)  # [B, bq, bk]

      def update(carry):
        m, l, acc = carry
        s, _ = _block_scores(qb, kb, scale, softcap)
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, -1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + jnp.sum(p, -1)
        acc = acc * corr[..., None] + jnp.einsum(
            "bnhqs,bsnk->bnhqk", p, vb.astype(jnp.float32))
        return m_new, l, acc

      return _if_any(ok, update, carry), None

    init = (jnp.full((B, N, Q, bq), -jnp.inf, jnp.float32),
            jnp.zeros((B, N, Q, bq), jnp.float32),
            jnp.zeros((B, N, Q, bq, K), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, (ks, vs, kps, kss))
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    out = acc / l_safe[..., None]
    lse = jnp.where(has, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l_safe),
                    -jnp.inf)
    # [B, N, Q, bq, K] -> [B, bq, N, Q, K]; lse -> [B, bq, N, Q].
    return (jnp.transpose(out, (0, 3, 1, 2, 4)),
            jnp.transpose(lse, (0, 3, 1, 2)))

  out, lse = jax.lax.map(q_block, (qs, qps, qss))
  out, lse = _unblocks(out), _unblocks(lse)
  return out.astype(q.dtype), lse, None


def _chunked_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, window, scale, softcap,
                 causal, bq, bk):
  out, lse, _ = _chunked_fwd_impl(q, k, v, q_pos, k_pos, q_seg, k_seg,
                                  window, scale, softcap, causal, bq, bk)
  return (out, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, window, out, lse)


def _pair_grads(qb, kb, vb, ok, dob, lseb, deltab, dlseb, scale, softcap):
  """(p, ds) of one (query block, key block) pair: the probabilities and the
  gradient w.r.t. the pre-cap, pre-scale scores' logits (scale folded in)."""
  to_bnhq = lambda x: jnp.transpose(x, (0, 2, 3, 1))  # [B,bq,N,Q]->[B,N,Q,bq]
  s, _ = _block_scores(qb, kb, scale, softcap)
  p = jnp.where(ok[:, None, None],
                jnp.exp(s - to_bnhq(lseb)[..., None]), 0.0)
  dp = jnp.einsum("bqnhk,bsnk->bnhqs", dob, vb.astype(jnp.float32))
  ds = p * (dp - to_bnhq(deltab)[..., None] + to_bnhq(dlseb)[..., None])
  if softcap is not None:  # s = cap * tanh(s0 / cap): ds0 = ds * (1 - t^2).
    ds = ds * (1.0 - jnp.square(s / softcap))
  return p, ds * scale


def _chunked_bwd(scale, softcap, causal, bq, bk, res, cotangents):
  """Flash attention's backward: scores recomputed block by block, in two
  sweeps (dk, dv per key block; dq per query block), each loop carrying one
  block. The log-sum-exp's cotangent adds p * d_lse to the scores' one."""
  q, k, v, q_pos, k_pos, q_seg, k_seg, window, out, lse = res
  d_out, d_lse = cotangents
  d_out = d_out.astype(jnp.float32)
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  delta = jnp.sum(d_out * out.astype(jnp.float32), -1)  # [B, Tp, N, Q]
  qs, ks, vs = _blocks(q, bq), _blocks(k, bk), _blocks(v, bk)
  qps, kps = _blocks(q_pos, bq), _blocks(k_pos, bk)
  qss, kss = _blocks(q_seg, bq), _blocks(k_seg, bk)
  q_side = (qs, qps, qss, _blocks(d_out, bq), _blocks(lse_safe, bq),
            _blocks(delta, bq), _blocks(d_lse, bq))
  k_side = (ks, vs, kps, kss)

  def dkv_of_key_block(kin):
    kb, vb, kp, ksg = kin

    def step(carry, qin):
      qb, qp, qsg, dob, lseb, deltab, dlseb = qin
      ok = _allowed_ids(qp, kp, qsg, ksg, window, causal)

      def add(carry):
        dk, dv = carry
        p, ds = _pair_grads(qb, kb, vb, ok, dob, lseb, deltab, dlseb, scale,
                            softcap)
        return (dk + jnp.einsum("bnhqs,bqnhk->bsnk", ds,
                                qb.astype(jnp.float32)),
                dv + jnp.einsum("bnhqs,bqnhk->bsnk", p, dob))

      return _if_any(ok, add, carry), None

    zeros = jnp.zeros(kb.shape, jnp.float32)
    (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), q_side)
    return dk, dv

  def dq_of_query_block(qin):
    qb, qp, qsg, dob, lseb, deltab, dlseb = qin

    def step(dq, kin):
      kb, vb, kp, ksg = kin
      ok = _allowed_ids(qp, kp, qsg, ksg, window, causal)

      def add(dq):
        _, ds = _pair_grads(qb, kb, vb, ok, dob, lseb, deltab, dlseb, scale,
                            softcap)
        return dq + jnp.einsum("bnhqs,bsnk->bqnhk", ds,
                               kb.astype(jnp.float32))

      return _if_any(ok, add, dq), None

    dq, _ = jax.lax.scan(step, jnp.zeros(qb.shape, jnp.float32), k_side)
    return dq

  dk, dv = jax.lax.map(dkv_of_key_block, k_side)
  dq = jax.lax.map(dq_of_query_block, q_side)
  return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
          _unblocks(dv).astype(v.dtype), None, None, None, None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, *,
                      window=NO_WINDOW, softcap=None, scale=None, causal=True,
                      q_sub=None, k_sub=None, block_q: int = 128,
                      block_k: int = 128):
  """(out, lse) by blocked online softmax (module doc); any T and S.

  Args:
    q: [B, T, H, K]; k, v: [B, S, N, K] (N divides H).
    q_pos, k_pos: [B, T], [B, S] int positions.
    q_seg, k_seg: [B, T], [B, S] int segments (different: never attend).
    q_sub, k_sub: optional [B, T], [B, S] sub-segments (module doc).
    window: keys with pos_q - pos_k >= window are masked (int, may be a
      traced scalar: a scanned layer's window).
    softcap: logit soft-cap or None.
    scale: score scale (default K ** -0.5).
    causal: keys after the query's position are masked.
    block_q, block_k: block sizes (shrunk to the lengths when shorter).
  """
  B, T, H, K = q.shape
  S, N = k.shape[1], k.shape[2]
  scale = K**-0.5 if scale is None else float(scale)
  bq, bk = min(block_q, _round8(T)), min(block_k, _round8(S))
  qg = _pad_to(q.reshape(B, T, N, H // N, K), bq, 1, 0)
  q_pos = _pad_to(q_pos.astype(jnp.int32), bq, 1, 0)
  k, v = _pad_to(k, bk, 1, 0), _pad_to(v, bk, 1, 0)
  k_pos = _pad_to(k_pos.astype(jnp.int32), bk, 1, 0)

  def ids(seg, sub, block, pad):  # [B, L, 2]: (segment, sub), padded.
    sub = jnp.zeros_like(seg) if sub is None else sub
    return jnp.stack([_pad_to(seg.astype(jnp.int32), block, 1, pad),
                      _pad_to(sub.astype(jnp.int32), block, 1, 0)], -1)

  window = jnp.asarray(window, jnp.int32)
  out, lse = _chunked(qg, k, v, q_pos, k_pos, ids(q_seg, q_sub, bq, _PAD_Q),
                      ids(k_seg, k_sub, bk, _PAD_K), window, scale, softcap,
                      causal, bq, bk)
  return (out[:, :T].reshape(B, T, H, K),
          lse[:, :T].reshape(B, T, H))


def _round8(n: int) -> int:
  return max(8, -(-n // 8) * 8)


# ------------------------------------------------------------- vendor paths
_SPLASH_BLOCK = 128


def _splash(q, k, v, q_seg, *, window, softcap, scale, interpret=False):
  """Pallas TPU splash attention, causal self-attention of one row's
  contiguous segments; `shard_map` over the active layout's batch and
  head axes (a Pallas kernel does not partition by itself)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as sk, splash_attention_mask as sm)
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel.layout import active_layout  # pylint: disable=g-import-not-at-top

  B, T, H, K = q.shape
  q = q * jnp.asarray(scale, q.dtype)  # The kernel does not scale.
  pad = -T % _SPLASH_BLOCK
  seg = _pad_to(q_seg.astype(jnp.int32), _SPLASH_BLOCK, 1, _PAD_Q)
  q, k, v = (_pad_to(x, _SPLASH_BLOCK, 1, 0) for x in (q, k, v))
  Tp = T + pad
  layout = active_layout()

  def local(q, k, v, seg):  # [b, T, h, K] per device.
    h = q.shape[2]
    one = (sm.CausalMask((Tp, Tp)) if window == NO_WINDOW else
           sm.LocalMask((Tp, Tp), (window - 1, 0), offset=0))
    kernel = sk.make_splash_mha(sm.MultiHeadMask([one] * h), head_shards=1,
                                q_seq_shards=1, attn_logits_soft_cap=softcap,
                                interpret=interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    out = jax.vmap(lambda q, k, v, s: kernel(
        q, k, v, segment_ids=sk.SegmentIds(s, s)))(
            heads_first(q), heads_first(k), heads_first(v), seg)
    return jnp.swapaxes(out, 1, 2)

  if layout is None:
    out = local(q, k, v, seg)
  else:
    batch = layout.spec(("batch",), (B,))[0]
    heads = layout.spec(("heads",), (H,))[0]
    kv_heads = layout.spec(("kv_heads",), (k.shape[2],))[0]
    out = jax.shard_map(
        local, mesh=layout.mesh,
        in_specs=(P(batch, None, heads), P(batch, None, kv_heads),
                  P(batch, None, kv_heads), P(batch)),
        out_specs=P(batch, None, heads), check_vma=False)(q, k, v, seg)
  return out[:, :T]


def _cudnn(q, k, v, q_seg, *, window, scale):
  """cuDNN flash attention (GPU): causal, right-padded rows (segment 0 up
  to the row's length, -1 after), optional static window."""
  lengths = jnp.sum(q_seg == 0, axis=1).astype(jnp.int32)
  return jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
      key_value_seq_lengths=lengths,
      local_window_size=None if window == NO_WINDOW else (window - 1, 0),
      implementation="cudnn")


_SAID: set[str] = set()


def _say_once(message: str) -> None:
  if message not in _SAID:
    _SAID.add(message)
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.info(message)


def auto_impl(backend: str, q, k, *, self_attention: bool, causal: bool,
              padded_rows: bool, return_lse: bool, softcap, static_window: bool,
              packed: bool) -> str:
  """What impl="auto" runs: the vendor kernel where it takes the call
  (splash on TPU; cuDNN on GPU, which has fp16/bf16 kernels only), one
  block of scores for short sequences, else the chunked jnp path."""
  if q.shape[1] <= _ONE_BLOCK and k.shape[1] <= _ONE_BLOCK:
    return "reference"  # All the scores are one block: no loop needed.
  if packed:
    return "chunked"  # Packed groups: a mask the vendor kernels cannot express.
  if (backend == "tpu" and self_attention and causal and not return_lse
      and static_window):
    return "splash"
  if (backend == "gpu" and self_attention and causal and padded_rows
      and not return_lse and softcap is None and static_window
      and q.dtype in (jnp.bfloat16, jnp.float16)):
    return "cudnn"
  return "chunked"


def attention(q, k, v, q_pos, k_pos, q_seg, k_seg, *, window=NO_WINDOW,
              softcap=None, scale=None, causal=True, q_sub=None, k_sub=None,
              impl: str = "auto", return_lse: bool = False,
              self_attention: bool = False, padded_rows: bool = False,
              interpret: bool | None = None, block_q: int = 128,
              block_k: int = 128):
  """Attention by `impl` (module doc); (out, lse) with `return_lse`.

  `self_attention`: q and k are the same tokens (same positions and
  segments, positions one apart within a segment), which the vendor kernels
  need; `padded_rows`: one sequence per row, right-padded (segment 0 then
  -1), which cuDNN needs. `window` may be traced only on the chunked path;
  sub-segments (packed groups) too. `interpret`: run the Pallas kernel
  interpreted (default: off a TPU; False to lower it for a TPU elsewhere,
  e.g. `jax.export` on CPU). `block_q`, `block_k`: the chunked path's
  block sizes (each block pair is one step of its loops).
  """
  scale = q.shape[-1]**-0.5 if scale is None else float(scale)
  backend = jax.default_backend()
  static_window = isinstance(window, (int, np.integer))
  if q_sub is not None and impl in ("splash", "cudnn"):
    raise ValueError(f"impl={impl!r} takes no sub-segments")
  if impl == "auto":
    impl = auto_impl(backend, q, k, self_attention=self_attention,
                     causal=causal, padded_rows=padded_rows,
                     return_lse=return_lse, softcap=softcap,
                     static_window=static_window, packed=q_sub is not None)
    if impl == "chunked":
      _say_once(f"attention: chunked jnp path on {backend} (self_attention="
                f"{self_attention}, lse={return_lse}, softcap={softcap}, "
                f"dtype={q.dtype})")
  if impl == "reference":
    out, lse = attention_reference(q, k, v, q_pos, k_pos, q_seg, k_seg,
                                   window=window, softcap=softcap,
                                   scale=scale, causal=causal, q_sub=q_sub,
                                   k_sub=k_sub)
  elif impl == "chunked":
    out, lse = chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg,
                                 window=window, softcap=softcap, scale=scale,
                                 causal=causal, q_sub=q_sub, k_sub=k_sub,
                                 block_q=block_q, block_k=block_k)
  elif impl in ("splash", "cudnn"):
    if return_lse or not self_attention or not causal:
      raise ValueError(f"impl={impl!r} takes causal self-attention without "
                       "log-sum-exp")
    if impl == "splash":  # Interpreted off TPU (tests).
      out = _splash(q, k, v, q_seg, window=int(window), softcap=softcap,
                    scale=scale, interpret=(backend != "tpu" if interpret is
                                            None else interpret))
    else:
      out = _cudnn(q, k, v, q_seg, window=int(window), scale=scale)
    lse = None
  else:
    raise ValueError(f"attention impl must be auto | chunked | reference | "
                     f"splash | cudnn, got {impl!r}")
  return (out, lse) if return_lse else out
