"""The flash-decoding online softmax both TPU decode kernels run.

Per kv head of a grid step's head block, a kernel computes scores s
[rows, kv] of its query rows against one block of keys (masked keys at
-inf) and calls `update`; `init` and `finalize` run on the first and last
steps of the kv axis. Running max and sum are lane-replicated [rows, LANES]
buffers and the accumulator is [rows, K], all fp32 in VMEM (`scratch`),
lane-dense like the flash attention kernels in
jax.experimental.pallas.ops.tpu (no 1-lane masked stores). A row with no
visible key yet shifts by 0, so exp(-inf - 0) = 0 and never NaN; a row that
never sees a key ends with output 0 and lse -inf (an empty part, which the
exact merge of parts ignores).
"""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

LANES = 128
NT_DIMS = (((1,), (1,)), ((), ()))  # [rows, K] x [kv, K]^T.


def scratch(heads: int, rows: int, K: int):
  """Running max, running sum (lane-replicated) and fp32 accumulator."""
  return [pltpu.VMEM((heads, rows, LANES), jnp.float32),
          pltpu.VMEM((heads, rows, LANES), jnp.float32),
          pltpu.VMEM((heads, rows, K), jnp.float32)]


def init(m_scr, l_scr, acc_scr) -> None:
  m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
  l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
  acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)


def update(h: int, s, v, m_scr, l_scr, acc_scr) -> None:
  """Folds head h's masked scores s [rows, kv] and values v [kv, K] (fp32,
  zero where not a key: 0 * NaN from a stale tail would poison the
  product) into the running state. P @ V is fp32: decode is bandwidth
  bound, and it keeps parity with the jnp reference and the merge exact."""
  m_prev = m_scr[h]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  alpha = jnp.exp(m_prev - m_safe)  # 0 on the first block.
  p = jnp.exp(s - m_safe[:, :1])
  l_scr[h] = alpha * l_scr[h] + jnp.sum(p, axis=1, keepdims=True)
  m_scr[h] = m_next
  acc_scr[h] = alpha[:, :1] * acc_scr[h] + jnp.dot(
      p, v, preferred_element_type=jnp.float32)


def finalize(m_scr, l_scr, acc_scr, o_ref, lse_ref) -> None:
  """Normalised output and lane-replicated log-sum-exp (-inf: no keys)."""
  l = l_scr[...]
  nonempty = l > 0.0
  l_safe = jnp.where(nonempty, l, 1.0)
  o_ref[...] = (acc_scr[...] / l_safe[..., :1]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m_scr[...] + jnp.log(l_safe), -jnp.inf)
