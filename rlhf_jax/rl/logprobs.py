"""Per-token log-probabilities and entropies from logits.

Dimension letters: B sequences, T positions, V vocabulary.

Both functions work in fp32 whatever the logits dtype (bf16 log-softmax loses
about 3 significant digits, which is the size of the policy ratios PPO clips
at), and neither builds a one-hot [B, T, V] or a stored log-softmax [B, T, V]:
log p(y) = logits[y] - logsumexp(logits), where the gather reads one logit per
token and the logsumexp is a single reduction that XLA fuses with the fp32
cast. The only V-sized tensor left is the softmax in the backward pass.
"""

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention_parts import cap_logits
from rlhf_jax.parallel.layout import constrain



def _scaled_fp32(logits_BxTxV: jax.Array, temperature: float) -> jax.Array:
  """fp32 logits divided by the sampling temperature."""
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  if temperature != 1.0:
    logits_BxTxV = logits_BxTxV / temperature
  return logits_BxTxV


def token_logprobs(
    logits_BxTxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    temperature: float = 1.0,
) -> jax.Array:
  """Gathers log p(targets) under softmax(logits / temperature).

  Pass the sampler's temperature so the trainer's log-probs are of the same
  distribution the rollout sampled from (they are compared in the PPO ratio).

  Args:
    logits_BxTxV: [B, T, V] logits; position t predicts targets_BxT[:, t].
    targets_BxT: [B, T] integer token ids in [0, V).
    temperature: static sampling temperature (> 0).

  Returns:
    [B, T] fp32 log-probabilities (<= 0).
  """
  logits_BxTxV = _scaled_fp32(logits_BxTxV, temperature)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  target_BxTx1 = targets_BxT.astype(jnp.int32)[..., None]
  picked_BxT = jnp.take_along_axis(logits_BxTxV, target_BxTx1, axis=-1)[..., 0]
  return picked_BxT - lse_BxT


def token_entropy(
    logits_BxTxV: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
  """Entropy of softmax(logits / temperature) at every position.

  Uses H = logsumexp(z) - sum_v p_v z_v, which needs no log(p) and therefore
  no log(0) for tokens whose probability underflows; logits of -inf (masked
  vocabulary entries) contribute 0 instead of 0 * -inf = nan.

  Args:
    logits_BxTxV: [B, T, V] logits.
    temperature: static sampling temperature (> 0).

  Returns:
    [B, T] fp32 entropies in nats, in [0, log V].
  """
  logits_BxTxV = _scaled_fp32(logits_BxTxV, temperature)
  lse_BxTx1 = jax.nn.logsumexp(logits_BxTxV, axis=-1, keepdims=True)
  p_BxTxV = jnp.exp(logits_BxTxV - lse_BxTx1)
  z_BxTxV = jnp.where(p_BxTxV > 0, logits_BxTxV, 0.0)
  return lse_BxTx1[..., 0] - jnp.sum(p_BxTxV * z_BxTxV, axis=-1)


# -------------------------------------------- from hidden states, in chunks
def head_logprobs(hidden_BxTxD: jax.Array, head: jax.Array,
                  targets_BxT: jax.Array, *, vocab_axis: int,
                  softcap: float | None = None, temperature: float = 1.0,
                  row_chunk: int = 1024, vocab_chunk: int = 8192,
                  row_groups: int = 1):
  """(log p(targets), entropy, argmax) [B, T] from hidden states and the
  vocabulary projection, never holding more than a [row_chunk, vocab_chunk]
  block of logits (the full [B, T, V] is what OOMs at real vocabularies:
  19 GB fp32 for 32k tokens of Qwen2.5's 152k).

  logits = softcap(hidden @ head) / temperature, the model's `_logits`
  (fp32 accumulation) and `token_logprobs`' temperature. A scan over
  vocabulary chunks keeps the running max, sum of exp and exp-weighted
  logit (for the entropy) and picks the target's logit; the custom VJP
  recomputes each block to form (onehot - softmax) * d_logp. Entropy and
  argmax are metrics: no gradient flows through them.

  Args:
    hidden_BxTxD: final-norm hidden states (compute dtype).
    head: the projection, [V, D] (`vocab_axis=0`, a tied embedding) or
      [D, V] (`vocab_axis=1`).
    targets_BxT: token ids.
    softcap: the final-logit soft-cap (Gemma 2) or None.
    temperature: the sampler's temperature.
    row_chunk, vocab_chunk: block sizes (shrunk to the shapes); logits
      that fit one block are computed whole (the same memory, no loops).
    row_groups: the devices the [B * T] rows are split over (the active
      layout's "rows": batch shards x context shards). Each group's rows
      are chunked on their own, under `vmap`, so every device computes its
      own rows: a loop over chunks of rows split across devices would
      have XLA gather every row onto every device and compute the whole
      head there.
  """
  B, T, D = hidden_BxTxD.shape
  V = head.shape[vocab_axis]
  if row_groups > 1 and (B * T) % row_groups == 0 and (
      B * T > row_chunk or V > vocab_chunk):
    h_SxMxD = constrain(hidden_BxTxD.reshape(row_groups, -1, D),
                        ("rows", None, None))
    t_SxM = constrain(targets_BxT.reshape(row_groups, -1), ("rows", None))
    out = jax.vmap(lambda h, t: head_logprobs(
        h[None], head, t[None], vocab_axis=vocab_axis, softcap=softcap,
        temperature=temperature, row_chunk=row_chunk,
        vocab_chunk=vocab_chunk))(h_SxMxD, t_SxM)
    return tuple(o.reshape(B, T) for o in out)
  if B * T <= row_chunk and V <= vocab_chunk:  # One block: no loops needed.
    z = jnp.einsum("btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv",
                   hidden_BxTxD, head.astype(hidden_BxTxD.dtype),
                   preferred_element_type=jnp.float32)
    z = cap_logits(z, softcap)
    return (token_logprobs(z, targets_BxT, temperature=temperature),
            jax.lax.stop_gradient(token_entropy(z, temperature=temperature)),
            jnp.argmax(z, -1))
  rc = min(row_chunk, B * T)
  vc = min(vocab_chunk, V)
  rows = -(-B * T // rc) * rc
  h = jnp.pad(hidden_BxTxD.reshape(B * T, D), ((0, rows - B * T), (0, 0)))
  t = jnp.pad(targets_BxT.reshape(B * T).astype(jnp.int32), (0, rows - B * T))
  vp = -(-V // vc) * vc
  w = jnp.pad(head, ((0, vp - V), (0, 0)) if vocab_axis == 0
              else ((0, 0), (0, vp - V)))
  logp, ent, arg = _head_logprobs(h, w, t, vocab_axis, V, softcap,
                                  float(temperature), rc, vc)
  cut = lambda x: x[:B * T].reshape(B, T)  # noqa: E731
  return cut(logp), jax.lax.stop_gradient(cut(ent)), cut(arg)


def _chunk_logits(h_MxD, w, j, vocab_axis, vc, V, softcap, temperature):
  """(logits, pre-cap logits) [M, vc] fp32 of vocabulary chunk j (entries
  past V are -inf)."""
  wj = jax.lax.dynamic_slice_in_dim(w, j * vc, vc, vocab_axis)
  spec = "md,vd->mv" if vocab_axis == 0 else "md,dv->mv"
  z0 = jnp.einsum(spec, h_MxD, wj.astype(h_MxD.dtype),
                  preferred_element_type=jnp.float32)
  z = cap_logits(z0, softcap)
  z = z / temperature
  valid = j * vc + jnp.arange(vc) < V
  return jnp.where(valid, z, -jnp.inf), z0


def _row_stats(h, w, t, vocab_axis, V, softcap, temperature, vc):
  """One row chunk: (lse, target logit, sum p*z pieces, argmax)."""
  M = h.shape[0]
  n_chunks = w.shape[vocab_axis] // vc

  def body(carry, j):
    m, s, tz, picked, best, arg = carry
    z, _ = _chunk_logits(h, w, j, vocab_axis, vc, V, softcap, temperature)
    cm = jnp.max(z, -1)
    m_new = jnp.maximum(m, cm)
    corr = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    zs = jnp.where(jnp.isfinite(z), z, 0.0)
    s = s * corr + jnp.sum(e, -1)
    tz = tz * corr + jnp.sum(e * zs, -1)
    local = t - j * vc
    hit = (local >= 0) & (local < vc)
    picked = jnp.where(hit, jnp.take_along_axis(
        z, jnp.clip(local, 0, vc - 1)[:, None], -1)[:, 0], picked)
    better = cm > best
    arg = jnp.where(better, j * vc + jnp.argmax(z, -1), arg)
    best = jnp.maximum(best, cm)
    return (m_new, s, tz, picked, best, arg), None

  init = (jnp.full((M,), -jnp.inf), jnp.zeros((M,)), jnp.zeros((M,)),
          jnp.zeros((M,)), jnp.full((M,), -jnp.inf),
          jnp.zeros((M,), jnp.int32))
  (m, s, tz, picked, _, arg), _ = jax.lax.scan(body, init,
                                               jnp.arange(n_chunks))
  lse = m + jnp.log(s)
  return lse, picked, lse - tz / s, arg


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _head_logprobs(h, w, t, vocab_axis, V, softcap, temperature, rc, vc):
  return _head_fwd(h, w, t, vocab_axis, V, softcap, temperature, rc,
                   vc)[0]


def _head_fwd(h, w, t, vocab_axis, V, softcap, temperature, rc, vc):
  hs, ts = h.reshape(-1, rc, h.shape[-1]), t.reshape(-1, rc)
  lse, picked, ent, arg = jax.lax.map(
      lambda x: _row_stats(x[0], w, x[1], vocab_axis, V, softcap,
                           temperature, vc), (hs, ts))
  out = (picked - lse).reshape(-1), ent.reshape(-1), arg.reshape(-1)
  return out, (h, w, t, lse.reshape(-1))


def _head_bwd(vocab_axis, V, softcap, temperature, rc, vc, res, cot):
  """d logp / d logits = onehot(target) - softmax; blocks recomputed."""
  h, w, t, lse = res
  g = cot[0].astype(jnp.float32)
  n_chunks = w.shape[vocab_axis] // vc
  D = h.shape[-1]

  def row_chunk(dw, x):
    h_c, t_c, lse_c, g_c = x

    def vocab_chunk(carry, j):
      dh, dw = carry
      z, z0 = _chunk_logits(h_c, w, j, vocab_axis, vc, V, softcap,
                            temperature)
      p = jnp.exp(z - lse_c[:, None])
      onehot = (t_c - j * vc)[:, None] == jnp.arange(vc)[None]
      dz = g_c[:, None] * (onehot.astype(jnp.float32) - p) / temperature
      if softcap is not None:
        dz = dz * (1.0 - jnp.square(jnp.tanh(z0 / softcap)))
      wj = jax.lax.dynamic_slice_in_dim(w, j * vc, vc, vocab_axis)
      spec = "mv,vd->md" if vocab_axis == 0 else "mv,dv->md"
      dh = dh + jnp.einsum(spec, dz, wj.astype(jnp.float32))
      dwj = (jnp.einsum("mv,md->vd", dz, h_c.astype(jnp.float32))
             if vocab_axis == 0 else
             jnp.einsum("mv,md->dv", dz, h_c.astype(jnp.float32)))
      old = jax.lax.dynamic_slice_in_dim(dw, j * vc, vc, vocab_axis)
      dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dwj, j * vc,
                                               vocab_axis)
      return (dh, dw), None

    (dh, dw), _ = jax.lax.scan(
        vocab_chunk, (jnp.zeros((h_c.shape[0], D), jnp.float32), dw),
        jnp.arange(n_chunks))
    return dw, dh

  hs = h.reshape(-1, rc, D)
  dw, dh = jax.lax.scan(
      row_chunk, jnp.zeros(w.shape, jnp.float32),
      (hs, t.reshape(-1, rc), lse.reshape(-1, rc), g.reshape(-1, rc)))
  return dh.reshape(h.shape).astype(h.dtype), dw.astype(w.dtype), None


_head_logprobs.defvjp(_head_fwd, _head_bwd)
