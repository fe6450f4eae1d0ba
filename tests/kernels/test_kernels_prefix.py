"""Tests for the row decode's prefix-shared attention (jnp; the static-rows
decoder's, `benchmarks/static_rows.py`).

The jnp reference equals plain softmax attention over the concatenated keys
[prefix[:len] ; suffix[:len]], computed directly in float64 numpy; the
dispatcher runs it for "auto" and "xla" and refuses "pallas" (the rows
engine's TPU kernel went with [one-engine]) in one line.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import prefix_decode_attention as pda


# Jitted once per shape: eager op-by-op dispatch costs seconds per new shape.
_reference = jax.jit(
    pda.prefix_decode_attention_reference,
    static_argnames=("scale", "logit_softcap", "return_lse"))


def _make_inputs(seed, *, R, G, H, N, K, P, M, dtype=jnp.float32,
                 prefix_len=None, suffix_len=None):
  """Random inputs; lengths drawn in [0, P] / [0, M] unless given."""
  rng = np.random.default_rng(seed)
  # Cast on the host (a cast of a device array compiles a program).
  normal = lambda *s: jnp.asarray(  # noqa: E731
      rng.standard_normal(s).astype(jnp.dtype(dtype)))
  if prefix_len is None:
    prefix_len = rng.integers(0, P + 1, size=R)
  if suffix_len is None:
    suffix_len = rng.integers(0, M + 1, size=(R, G))
  return (normal(R, G, H, K), normal(R, P, N, K), normal(R, P, N, K),
          jnp.asarray(prefix_len, jnp.int32), normal(R, G, M, N, K),
          normal(R, G, M, N, K), jnp.asarray(suffix_len, jnp.int32))


def _naive(q, pk, pv, plen, sk, sv, slen, *, scale=None, softcap=None,
           window=None):
  """Float64 softmax over [prefix[:plen] ; suffix[:slen]] per query; with
  `window`, only the keys at positions t - window < s <= t, where the query
  is the sample's last own token (t = plen + slen - 1)."""
  q, pk, pv, sk, sv = (np.asarray(x, np.float64) for x in (q, pk, pv, sk, sv))
  plen, slen = np.asarray(plen), np.asarray(slen)
  R, G, H, K = q.shape
  N = pk.shape[2]
  scale = K**-0.5 if scale is None else scale
  out = np.zeros((R, G, H, K))
  lse = np.full((R, G, H), -np.inf)
  for r in range(R):
    for g in range(G):
      for h in range(H):
        n = h // (H // N)
        keys = np.concatenate([pk[r, :plen[r], n], sk[r, g, :slen[r, g], n]])
        vals = np.concatenate([pv[r, :plen[r], n], sv[r, g, :slen[r, g], n]])
        if window is not None:
          positions = np.arange(len(keys))  # Prompt, then own tokens.
          keep = positions[-1] - positions < window
          keys, vals = keys[keep], vals[keep]
        if not len(keys):
          continue
        s = keys @ q[r, g, h] * scale
        if softcap is not None:
          s = softcap * np.tanh(s / softcap)
        lse[r, g, h] = np.logaddexp.reduce(s)
        out[r, g, h] = np.exp(s - lse[r, g, h]) @ vals
  return out, lse


def _assert_lse_close(actual, expected, atol):
  """LSE equality that treats matching -inf (no keys) as equal."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
  finite = np.isfinite(expected)
  np.testing.assert_allclose(actual[finite], expected[finite], atol=atol)


class ReferenceTest(parameterized.TestCase):
  """The jnp reference against float64 naive concatenated-key attention."""

  @parameterized.named_parameters(
      dict(testcase_name="mha", G=2, H=2, N=2, softcap=None),
      dict(testcase_name="gqa4_softcap", G=3, H=8, N=2, softcap=5.0),
      dict(testcase_name="mqa8_g16", G=16, H=8, N=1, softcap=None),
  )
  def test_matches_naive_concatenation(self, G, H, N, softcap):
    args = _make_inputs(0, R=3, G=G, H=H, N=N, K=8, P=11, M=5)
    out, lse = _reference(
        *args, logit_softcap=softcap, return_lse=True)
    want_out, want_lse = _naive(*args, softcap=softcap)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    _assert_lse_close(lse, want_lse, atol=1e-5)

  @parameterized.named_parameters(
      dict(testcase_name="inside_prompt", window=3),
      dict(testcase_name="past_prompt", window=9),
      dict(testcase_name="wider_than_all", window=40))
  def test_sliding_window_matches_naive(self, window):
    """Gemma 2's local layers: only the last `window` positions."""
    args = _make_inputs(3, R=3, G=3, H=4, N=2, K=8, P=11, M=6,
                        prefix_len=[11, 4, 9],
                        suffix_len=[[1, 6, 3], [2, 5, 1], [6, 6, 4]])
    q_pos = args[3][:, None] + args[6] - 1
    out, lse = jax.jit(functools.partial(
        pda.prefix_decode_attention_reference, return_lse=True,
        logit_softcap=5.0))(*args, q_pos_RxG=q_pos, window=window)
    want_out, want_lse = _naive(*args, softcap=5.0, window=window)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    _assert_lse_close(lse, want_lse, atol=1e-5)

  def test_finished_slots_and_empty_suffix(self):
    # Row 0: prompt only (empty suffix); row 1: a free slot (no keys at all);
    # row 2: suffix only.
    args = _make_inputs(1, R=3, G=2, H=4, N=2, K=8, P=7, M=3,
                        prefix_len=[7, 0, 0], suffix_len=[[0, 0], [0, 0],
                                                          [3, 1]])
    out, lse = _reference(*args, return_lse=True)
    want_out, want_lse = _naive(*args)
    self.assertFalse(np.isnan(np.asarray(out)).any())
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    _assert_lse_close(lse, want_lse, atol=1e-5)

  def test_bf16_inputs_accumulate_in_fp32(self):
    args = _make_inputs(2, R=2, G=2, H=4, N=1, K=16, P=9, M=4,
                        dtype=jnp.bfloat16)
    out, lse = _reference(*args, return_lse=True)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertEqual(lse.dtype, jnp.float32)
    want_out, want_lse = _naive(*args)  # On the bf16 values, in float64.
    np.testing.assert_allclose(out.astype(jnp.float32), want_out, atol=2e-2)
    _assert_lse_close(lse, want_lse, atol=1e-4)


class DispatchTest(absltest.TestCase):

  def _args(self):
    return _make_inputs(3, R=2, G=3, H=4, N=2, K=8, P=11, M=5)

  def test_auto_and_xla_are_the_reference(self):
    args = self._args()
    for impl in ("auto", "xla"):
      np.testing.assert_array_equal(
          pda.prefix_decode_attention(*args, impl=impl), _reference(*args))

  def test_pallas_and_unknown_impls_raise(self):
    with self.assertRaisesRegex(ValueError, "row decode has no kernel"):
      pda.prefix_decode_attention(*self._args(), impl="pallas")
    with self.assertRaisesRegex(ValueError, "attention_impl"):
      pda.prefix_decode_attention(*self._args(), impl="triton")
