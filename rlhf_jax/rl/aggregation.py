"""Loss aggregation modes: per-token losses [B, T] -> one scalar.

Dimension letters: B sequences, T response positions.

Modes (registered under category "aggregation"):
  "token-mean": sum of all valid token losses / number of valid tokens. Every
    token weighs the same, so long responses weigh more (DAPO).
  "seq-mean-token-mean": mean over tokens within a sequence, then mean over
    the sequences that have at least one valid token (original GRPO). Tokens
    of long responses weigh less.
  "seq-mean-token-sum-norm": sum over tokens divided by the constant `max_len`,
    then mean over the B rows (Dr.GRPO). Both divisors are constants, so a
    token's gradient does not depend on its own or anyone's length.

Packed rows (`rl/packing.py`) hold several sequences per row; the batch
says which tokens belong to which (`aggregate_terms(..., packed=batch)`),
so the "seq-mean" modes average per sequence, not per row.

Each mode is a pair (numerator, weight) with aggregate = numerator / weight.
Summing numerators and weights over micro-batches and dividing once gives
exactly the full-batch value, which is what gradient accumulation needs
(averaging per-micro-batch means would not, for the two "mean" modes).
"""

import jax
import jax.numpy as jnp

from rlhf_jax.rl import registry


def _fp32_mask(mask_BxT: jax.Array) -> jax.Array:
  """Bool or numeric mask as fp32 0/1 weights."""
  return jnp.asarray(mask_BxT).astype(jnp.float32)


def _masked_loss(loss_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """loss * mask, with padding forced to 0 even where the loss is nan/inf."""
  return jnp.where(mask_BxT > 0, loss_BxT.astype(jnp.float32), 0.0) * mask_BxT


def masked_mean(
    x: jax.Array, mask: jax.Array, axis: int | None = None
) -> jax.Array:
  """Mean of x over entries where mask != 0 (0 when there are none).

  Args:
    x: values, same shape as mask.
    mask: 1/0 or bool weights.
    axis: reduction axis; None reduces everything.

  Returns:
    fp32 masked mean, reduced over `axis`.
  """
  mask = _fp32_mask(mask)
  total = jnp.sum(_masked_loss(x, mask), axis=axis)
  return total / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def sequence_sums(x_BxT: jax.Array, mask_BxT: jax.Array,
                  seq_BxT: jax.Array | None = None):
  """Each sequence's sum of x over its valid tokens and their count, and a
  function laying one value per sequence on that sequence's tokens.

  One sequence a row (`seq_BxT` None): S = B. Packed rows (`rl/packing.py`)
  hold several: a sequence is a run of equal `seq` cells (its cells are
  contiguous in one row; a multi-turn sample's environment tokens are
  masked, not outside the run), and cells with `seq` -1 belong to none.
  Runs are numbered within this array, so S = B * T whatever sample
  indices `seq` holds (they are the batch's, larger than a micro-batch's
  cell count in a batch of many short responses).

  Args:
    x_BxT: [B, T] values.
    mask_BxT: [B, T] 1 on valid tokens.
    seq_BxT: packed rows only: the sequence of each cell (-1: none).

  Returns:
    (sums_S, counts_S, on_tokens): fp32 [S] sums of x * mask and of mask;
    on_tokens(values_S) -> [B, T], 0 (False) where a cell has no sequence.
  """
  mask_BxT = _fp32_mask(mask_BxT)
  x_BxT = _masked_loss(x_BxT, mask_BxT)
  if seq_BxT is None:
    def on_rows(values_S):
      return jnp.broadcast_to(values_S[:, None], mask_BxT.shape)
    return jnp.sum(x_BxT, axis=1), jnp.sum(mask_BxT, axis=1), on_rows
  seq = jnp.ravel(seq_BxT)
  num = seq.size
  starts = jnp.concatenate([jnp.ones((1,), bool), seq[1:] != seq[:-1]])
  run = jnp.where(seq >= 0, jnp.cumsum(starts) - 1, num)  # num: dropped.

  def segment_sum(v_BxT):
    return jax.ops.segment_sum(jnp.ravel(v_BxT), run, num_segments=num,
                               mode="drop")

  def on_runs(values_S):
    return jnp.take(values_S, run, mode="fill",
                    fill_value=0).reshape(mask_BxT.shape)

  return segment_sum(x_BxT), segment_sum(mask_BxT), on_runs


def _sequences(mask_BxT, seq_BxT, seq_len_BxT):
  """(per-token length of the token's sequence, 1 on each sequence's first
  trained token). Repeated/grouped rows are one sequence each; packed rows
  (`rl/packing.py`) say which tokens belong to which sequence (`seq`) and
  how long each is (`seq_len`, its trained tokens). A multi-turn sample's
  trained tokens have gaps (the environment's, masked); `seq` covers them.
  """
  if seq_BxT is None:
    B, T = mask_BxT.shape
    seq_len_BxT = jnp.broadcast_to(jnp.sum(mask_BxT, 1, keepdims=True), (B, T))
    valid = mask_BxT > 0
    first = valid & (jnp.cumsum(valid, axis=1) == 1)
    return seq_len_BxT, first.astype(jnp.float32)
  before = jnp.pad(seq_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  first = ((mask_BxT > 0) & (seq_BxT != before)).astype(jnp.float32)
  return seq_len_BxT, first


@registry.register("aggregation", "token-mean")
def token_mean_terms(loss_BxT: jax.Array, mask_BxT: jax.Array,
                     **unused) -> tuple[jax.Array, jax.Array]:
  """Terms of "token-mean": (sum of valid losses, number of valid tokens).

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    **unused: the other modes' arguments (one signature for all).

  Returns:
    (numerator, weight), fp32 scalars.
  """
  del unused
  mask_BxT = _fp32_mask(mask_BxT)
  return jnp.sum(_masked_loss(loss_BxT, mask_BxT)), jnp.sum(mask_BxT)


@registry.register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean_terms(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *,
    seq_BxT: jax.Array | None = None, seq_len_BxT: jax.Array | None = None,
    **unused) -> tuple[jax.Array, jax.Array]:
  """Terms of "seq-mean-token-mean": (sum of sequence means, #sequences).

  Sequences without any valid token (batch padding) count in neither term.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    seq_BxT, seq_len_BxT: packed rows only (`_sequences`).
    **unused: the other modes' arguments.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  del unused
  mask_BxT = _fp32_mask(mask_BxT)
  len_BxT, first_BxT = _sequences(mask_BxT, seq_BxT, seq_len_BxT)
  per_token = _masked_loss(loss_BxT, mask_BxT) / jnp.maximum(len_BxT, 1.0)
  return jnp.sum(per_token), jnp.sum(first_BxT)


@registry.register("aggregation", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm_terms(
    loss_BxT: jax.Array, mask_BxT: jax.Array, *, max_len: int | None = None,
    num_seqs: jax.Array | None = None, **unused
) -> tuple[jax.Array, jax.Array]:
  """Terms of "seq-mean-token-sum-norm": (sum / max_len, #sequences).

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens.
    max_len: the constant length normaliser, normally the maximum response
      length of the run; defaults to T (not in packed rows: required there).
    num_seqs: packed rows only: [B] sequences each row counts for (every
      sample, trained or not, as the B rows of the other layouts do).
    **unused: the other modes' arguments.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  del unused
  mask_BxT = _fp32_mask(mask_BxT)
  if max_len is None and num_seqs is not None:
    raise ValueError("seq-mean-token-sum-norm of packed rows needs max_len")
  norm = float(loss_BxT.shape[1] if max_len is None else max_len)
  total = jnp.sum(_masked_loss(loss_BxT, mask_BxT)) / norm
  count = (jnp.asarray(loss_BxT.shape[0], jnp.float32) if num_seqs is None
           else jnp.sum(num_seqs))
  return total, count


def aggregate_terms(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    max_len: int | None = None,
    packed: dict | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(numerator, weight) of `mode`; sum these over micro-batches.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens, 0 on prompt/padding.
    mode: a registered aggregation name, e.g. "token-mean".
    max_len: constant normaliser of "seq-mean-token-sum-norm".
    packed: a packed batch (`rl/packing.py`): rows hold several sequences,
      which its "seq", "seq_len" and "row_seqs" tell apart.

  Returns:
    (numerator, weight), fp32 scalars.
  """
  extra = {} if packed is None else dict(
      seq_BxT=packed["seq"], seq_len_BxT=packed["seq_len"],
      num_seqs=packed["row_seqs"])
  return registry.get("aggregation", mode)(loss_BxT, mask_BxT,
                                           max_len=max_len, **extra)


def aggregate_loss(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    max_len: int | None = None,
) -> jax.Array:
  """Aggregates per-token losses to a scalar according to `mode`.

  Args:
    loss_BxT: [B, T] per-token losses.
    mask_BxT: [B, T] 1 on valid tokens, 0 on prompt/padding.
    mode: a registered aggregation name, e.g. "token-mean".
    max_len: constant normaliser of "seq-mean-token-sum-norm".

  Returns:
    fp32 scalar loss (0 when there is nothing to aggregate).
  """
  num, weight = aggregate_terms(loss_BxT, mask_BxT, mode, max_len=max_len)
  return num / jnp.maximum(weight, 1.0)
