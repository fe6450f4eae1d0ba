"""Tests for prefix-shared decode attention: reference, Pallas kernel, dispatch.

Three layers of oracle:
  1. The jnp reference equals plain softmax attention over the concatenated
     keys [prefix[:len] ; suffix[:len]], computed directly in float64 numpy.
  2. The Pallas TPU kernel equals the reference: in interpret mode on CPU
     (`...InterpretTest`), compiled on a real TPU (`...Test`, skipped on CPU).
  3. The dispatcher routes "xla" / "pallas" / "auto" by backend.
Shapes are tiny and odd: interpret mode is slow and odd lengths exercise the
partial last kv block (padded with NaN by the interpreter).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from kernels_pallas import prefix_decode_attention as pda
from kernels_pallas import prefix_decode_attention_tpu as pda_tpu

import fakes  # tests/ is on sys.path

_BACKEND = jax.default_backend()
# Jitted once per shape: eager op-by-op dispatch costs seconds per new shape.
_reference = jax.jit(
    pda.prefix_decode_attention_reference,
    static_argnames=("scale", "logit_softcap", "return_lse"))


def _make_inputs(seed, *, R, G, H, N, K, P, M, dtype=jnp.float32,
                 prefix_len=None, suffix_len=None):
  """Random inputs; lengths drawn in [0, P] / [0, M] unless given."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
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


class PrefixDecodeAttentionKernelTest(parameterized.TestCase):
  """Compiled Pallas TPU kernel vs the reference (real TPU only)."""

  INTERPRET = False
  HEAD_DIM = 128  # One lane tile: the shape Mosaic is tuned for.

  def setUp(self):
    super().setUp()
    if self.INTERPRET and _BACKEND != "cpu":
      self.skipTest("Interpret-mode tests run on CPU.")
    if not self.INTERPRET and _BACKEND != "tpu":
      self.skipTest("Needs a TPU (Mosaic).")

  def _check(self, args, *, softcap=None, block_sizes=None, atol=1e-5):
    block_sizes = block_sizes or pda_tpu.BlockSizes(block_p=8, block_m=8)
    out, lse = pda_tpu.prefix_decode_attention_tpu(
        *args, logit_softcap=softcap, return_lse=True,
        block_sizes=block_sizes, interpret=self.INTERPRET)
    want_out, want_lse = _reference(
        *args, logit_softcap=softcap, return_lse=True)
    self.assertEqual(out.dtype, args[0].dtype)
    self.assertFalse(np.isnan(np.asarray(out, np.float32)).any())
    np.testing.assert_allclose(
        out.astype(jnp.float32), want_out.astype(jnp.float32), atol=atol,
        rtol=atol)
    _assert_lse_close(lse, want_lse, atol=1e-4)
    return out

  # G in {1, 2, 8, 16}, query heads per kv head in {1, 4, 8}, odd lengths.
  @parameterized.named_parameters(
      dict(testcase_name="g1_mha", G=1, H=2, N=2, P=13, M=5),
      dict(testcase_name="g2_gqa4_two_head_blocks", G=2, H=16, N=4, P=17,
           M=9, block_heads=2),
      dict(testcase_name="g8_gqa8", G=8, H=8, N=1, P=9, M=3),
      dict(testcase_name="g16_gqa8_softcap", G=16, H=8, N=1, P=11, M=7,
           softcap=4.0),
      dict(testcase_name="g16_mha_bf16", G=16, H=2, N=2, P=19, M=3,
           dtype=jnp.bfloat16),
      dict(testcase_name="g2_gqa4_bf16_softcap_blocks16", G=2, H=4, N=1,
           P=25, M=11, dtype=jnp.bfloat16, softcap=3.0, block_p=16,
           block_m=16),
      dict(testcase_name="g8_mha_short_prompt", G=8, H=1, N=1, P=3, M=13),
  )
  def test_matches_reference(self, G, H, N, P, M, dtype=jnp.float32,
                             softcap=None, block_p=8, block_m=8,
                             block_heads=8):
    seed = G * 1000 + H * 10 + P
    args = _make_inputs(seed, R=3, G=G, H=H, N=N, K=self.HEAD_DIM, P=P, M=M,
                        dtype=dtype)
    atol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    self._check(args, softcap=softcap, atol=atol,
                block_sizes=pda_tpu.BlockSizes(block_p, block_m, block_heads))

  def test_finished_slots_empty_suffix_and_full_lengths(self):
    # Free slot, prompt-only row, full-length row, and lengths past the cache
    # (the engine writes with mode="drop" and passes suffix_len + 1).
    args = _make_inputs(3, R=4, G=2, H=4, N=2, K=self.HEAD_DIM, P=11, M=5,
                        prefix_len=[0, 11, 11, 4],
                        suffix_len=[[0, 0], [0, 0], [5, 5], [6, 2]])
    out = self._check(args)
    np.testing.assert_array_equal(out[0], 0.0)

  def test_garbage_past_lengths_is_ignored(self):
    # Stale or uninitialised cache slots past a length (here NaN) must not
    # leak into the output (0 * NaN = NaN), unlike a plain masked einsum.
    q, pk, pv, plen, sk, sv, slen = _make_inputs(
        4, R=2, G=2, H=2, N=1, K=self.HEAD_DIM, P=12, M=6, prefix_len=[5, 12],
        suffix_len=[[2, 0], [6, 3]])
    p_live = (jnp.arange(12)[None, :] < plen[:, None])[:, :, None, None]
    s_live = (jnp.arange(6) < slen[..., None])[..., None, None]
    clean = (q, pk, pv, plen, sk, sv, slen)
    dirty = (q, jnp.where(p_live, pk, jnp.nan), jnp.where(p_live, pv, jnp.nan),
             plen, jnp.where(s_live, sk, jnp.nan),
             jnp.where(s_live, sv, jnp.nan), slen)
    out = pda_tpu.prefix_decode_attention_tpu(
        *dirty, block_sizes=pda_tpu.BlockSizes(8, 8), interpret=self.INTERPRET)
    want = _reference(*clean)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)

  def test_no_suffix_axis(self):
    # M = 0 (before the first decode step): only the prefix part runs.
    args = _make_inputs(5, R=2, G=2, H=4, N=2, K=self.HEAD_DIM, P=9, M=0,
                        prefix_len=[9, 0])
    out, lse = pda_tpu.prefix_decode_attention_tpu(
        *args, return_lse=True, block_sizes=pda_tpu.BlockSizes(8, 8),
        interpret=self.INTERPRET)
    want_out, want_lse = _naive(*args)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    _assert_lse_close(lse, want_lse, atol=1e-5)


class PrefixDecodeAttentionKernelInterpretTest(
    PrefixDecodeAttentionKernelTest):
  """The same kernel tests in Pallas interpret mode (CPU)."""

  INTERPRET = True
  HEAD_DIM = 16  # Interpret mode is slow; the lane constraint is moot.

  def test_tpu_interpret_mode_detects_no_races(self):
    # TPU interpret mode simulates VMEM/SMEM, DMAs and two cores splitting the
    # 'parallel' grid dims in random order; scratch starts as NaN, so a
    # missing init would also show up as a mismatch.
    args = _make_inputs(6, R=2, G=2, H=2, N=1, K=8, P=9, M=5,
                        prefix_len=[9, 4], suffix_len=[[5, 0], [2, 3]])
    params = pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2, random_seed=0)
    try:
      out = pda_tpu.prefix_decode_attention_tpu(
          *args, block_sizes=pda_tpu.BlockSizes(8, 8), interpret=params)
      out.block_until_ready()
      self.assertFalse(interpret_pallas_call.races.races_found)
    finally:
      # Required after a failure inside an interpreted kernel; harmless else.
      pltpu.reset_tpu_interpret_mode_state()
    want = _reference(*args)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


class DispatchTest(parameterized.TestCase):
  """`prefix_decode_attention(impl=...)` routing."""

  def _args(self):
    return _make_inputs(7, R=2, G=2, H=4, N=2, K=8, P=9, M=3)

  def _dispatch(self, impl):
    return jax.jit(functools.partial(pda.prefix_decode_attention, impl=impl))

  def test_xla_is_the_reference(self):
    args = self._args()
    np.testing.assert_array_equal(self._dispatch("xla")(*args),
                                  _reference(*args))

  def test_pallas_under_jit(self):
    # The engine calls the dispatcher inside its jitted decode step.
    args = self._args()
    if _BACKEND == "gpu":
      with self.assertRaisesRegex(ValueError, "TPU"):
        pda.prefix_decode_attention(*args, impl="pallas")
      return
    step = jax.jit(functools.partial(
        pda.prefix_decode_attention, impl="pallas", logit_softcap=2.0,
        return_lse=True, block_sizes=pda_tpu.BlockSizes(8, 8)))
    out, lse = step(*args)
    want_out, want_lse = _reference(
        *args, logit_softcap=2.0, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    _assert_lse_close(lse, want_lse, atol=1e-5)

  @absltest.skipIf(_BACKEND == "tpu", "auto is the kernel on TPU.")
  def test_auto_is_the_reference_off_tpu(self):
    args = self._args()
    np.testing.assert_array_equal(self._dispatch("auto")(*args),
                                  _reference(*args))

  def test_unknown_impl_raises(self):
    with self.assertRaisesRegex(ValueError, "attention_impl"):
      pda.prefix_decode_attention(*self._args(), impl="triton")

  def test_block_sizes_validated(self):
    with self.assertRaisesRegex(ValueError, "multiple of 8"):
      pda_tpu.BlockSizes(block_p=12)

  def test_skipped_kv_blocks_repeat_the_last_needed_block(self):
    # The clamp is what saves bandwidth: a repeated block index makes the
    # Pallas pipeline skip the DMA. (Not visible in the outputs.)
    index = lambda j, length: int(pda_tpu._kv_block_index(j, length, 8))
    self.assertEqual([index(j, 17) for j in range(5)], [0, 1, 2, 2, 2])
    self.assertEqual([index(j, 0) for j in range(3)], [0, 0, 0])
    self.assertEqual([index(j, 16) for j in range(3)], [0, 1, 1])


def _decode_specs(layout, R, G, H, N, K, P, M, C, dtype):
  """Abstract decode-attention args with the rollout layout's shardings."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  shapes = [(R, G, H, K), (R, P, N, K), (R, P, N, K), (R,), (R, G, M, N, K),
            (R, G, M, N, K), (R, G), (C, N, K), (C, N, K), ()]
  axes = [("batch", None, "heads", None), ("batch", None, "kv_heads", None),
          ("batch", None, "kv_heads", None), ("batch",),
          ("batch", None, None, "kv_heads", None),
          ("batch", None, None, "kv_heads", None), ("batch", None),
          (None, "kv_heads", None), (None, "kv_heads", None), ()]
  int_args = {3, 6, 9}
  return [jax.ShapeDtypeStruct(
      s, jnp.int32 if i in int_args else dtype,
      sharding=NamedSharding(layout.mesh, layout.spec(a, s)))
          for i, (s, a) in enumerate(zip(shapes, axes))]


def _with_layout(layout, **kw):
  from rlhf_jax.parallel.layout import use_layout  # pylint: disable=g-import-not-at-top

  def f(q, pk, pv, plen, sk, sv, slen, ck, cv, clen):
    with use_layout(layout):
      return pda.prefix_decode_attention(
          q, pk, pv, plen, sk, sv, slen, common_k_CxNxK=ck,
          common_v_CxNxK=cv, common_len=clen, impl="pallas", **kw)
  return jax.jit(f)


def test_sharded_kernel_equals_reference_on_8_devices():
  """The kernel under shard_map over 4 replicas x tensor 2 (interpreted):
  each device its rows and heads, the same numbers as the reference."""
  layout = fakes.rollout_layout8(2)
  R, G, H, N, K, P, M, C = 4, 2, 4, 2, 16, 13, 5, 6
  args = list(_make_inputs(7, R=R, G=G, H=H, N=N, K=K, P=P, M=M))
  rng = np.random.default_rng(7)
  args += [jnp.asarray(rng.standard_normal((C, N, K)), jnp.float32),
           jnp.asarray(rng.standard_normal((C, N, K)), jnp.float32),
           jnp.asarray(4, jnp.int32)]
  specs = _decode_specs(layout, R, G, H, N, K, P, M, C, jnp.float32)
  placed = [jax.device_put(a, s.sharding) for a, s in zip(args, specs)]
  out, lse = _with_layout(layout, logit_softcap=3.0, return_lse=True,
                          block_sizes=pda_tpu.BlockSizes(8, 8))(*placed)
  assert out.sharding.spec == specs[0].sharding.spec
  want_out, want_lse = _reference(
      *args[:7], common_k_CxNxK=args[7], common_v_CxNxK=args[8],
      common_len=args[9], logit_softcap=3.0, return_lse=True)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  _assert_lse_close(lse, want_lse, atol=1e-5)


def test_sharded_kernel_lowers_for_tpu():
  """What the engine runs on a TPU pod slice, exported for TPU from this
  CPU: 8 devices (4 replicas x tensor 2), prompt 2048 in bf16, the Mosaic
  kernels (prefix and suffix) inside one shard_map, each on its device's
  rows and heads."""
  import re  # pylint: disable=g-import-not-at-top
  layout = fakes.rollout_layout8(2)
  R, G, H, N, K, P, M, C = 8, 4, 8, 2, 128, 2048, 512, 64
  specs = _decode_specs(layout, R, G, H, N, K, P, M, C, jnp.bfloat16)
  text = jax.export.export(_with_layout(layout, interpret=False),
                           platforms=("tpu",))(*specs).mlir_module()
  assert text.count("tpu_custom_call") >= 2, "prefix and suffix kernels"
  assert "manual_computation" in text or "SPMDFullToShardShape" in text
  dims = [[int(d) for d in m.split("x")[:-1]]
          for m in re.findall(r"tensor<((?:\d+x)+)", text)]
  assert [R // 4, G, H // 2, K] in dims, "the per-device query block"


if __name__ == "__main__":
  absltest.main()
