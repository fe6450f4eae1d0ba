"""The trainer at real-model scale: scanned layers and remat equal the loop,
the chunked attention and log-prob paths equal the reference ones, and no
[.., T, T] (or [.., T, V]) intermediate is left in a compiled train step."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import flash_attention as fa
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import grouped, logprobs, objectives
from rlhf_jax.rl.learner import (
    Learner, OptimConfig, TrainState, make_optimizer)
from rlhf_jax.rl.losses import KLConfig

# Tiny Gemma-2-like switches: sliding window on local layers, attention and
# final-logit soft-caps, post-norms; GQA.
GEMMA = ModelConfig.tiny(
    vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    embed_dim=64, mlp_dim=96, sliding_window=5, attn_logit_softcap=20.0,
    final_logit_softcap=10.0, post_norms=True, norm_plus_one=True,
    mlp_activation="gelu", embed_scale=True, tie_embeddings=True)


def _repeated_batch(cfg, B=4, T=24, seed=0):
  rng = np.random.default_rng(seed)
  lens = rng.integers(T // 2, T + 1, B)
  tokens = rng.integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
  mask = np.arange(T)[None] < lens[:, None]
  tokens = np.where(mask, tokens, 0)
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], 1)
  loss_mask = (mask & (np.arange(T)[None] >= 3)
               & (np.arange(T)[None] < lens[:, None] - 1)).astype(np.float32)
  return dict(tokens=tokens,
              positions=np.broadcast_to(np.arange(T, dtype=np.int32),
                                        (B, T)).copy(),
              attn_mask=mask, targets=targets, loss_mask=loss_mask,
              old_logp=-rng.random((B, T)).astype(np.float32),
              ref_logp=-rng.random((B, T)).astype(np.float32),
              advantages=rng.normal(size=B).astype(np.float32))


def _grouped_batch(cfg, N=2, G=2, P=9, R=11, seed=1):
  rng = np.random.default_rng(seed)
  plen = rng.integers(2, P + 1, N).astype(np.int32)
  prompt = np.where(np.arange(P)[None] < plen[:, None],
                    rng.integers(1, cfg.vocab_size, (N, P)), 0)
  rlen = rng.integers(1, R + 1, (N, G))
  resp = rng.integers(1, cfg.vocab_size, (N, G, R)).astype(np.int32)
  mask = (np.arange(R)[None, None] < rlen[..., None]).astype(np.float32)
  return dict(prompt_tokens=prompt.astype(np.int32), prompt_len=plen,
              response_tokens=resp, loss_mask=mask,
              old_logp=-rng.random((N, G, R)).astype(np.float32),
              ref_logp=-rng.random((N, G, R)).astype(np.float32),
              advantages=rng.normal(size=(N, G)).astype(np.float32))


def _loss_and_grads(params, graphdef, batch):
  terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
      kl=KLConfig(0.05), aggregation="seq-mean-token-mean"))

  def loss(p):
    num, aux = terms(graphdef, p, batch)
    return num / weight(batch), aux

  return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.fixture(scope="module")
def gemma_params(mesh8):
  layout = mesh_lib.train_layout(mesh8)
  graphdef, params = model_lib.init_params(GEMMA, 0, layout)
  return layout, graphdef, params


def _results(cfg, layout, params, batch):
  graphdef, _ = model_lib.abstract_params(cfg)
  fn = jax.jit(lambda p, b: _loss_and_grads(p, graphdef, b))
  with use_layout(layout):
    (loss, aux), grads = fn(params, batch)
    logp = jax.jit(grouped.token_logprobs_in_layout, static_argnums=0)(
        graphdef, params, batch)
  return (float(loss), jax.device_get(aux), jax.device_get(grads),
          np.asarray(logp))


_BATCHES = {"repeated": _repeated_batch, "grouped": _grouped_batch}


@pytest.fixture(scope="module")
def reference(gemma_params):
  """The oracle per layout: Python loop over layers, T x T attention,
  whole [B, T, V] logits."""
  layout, _, params = gemma_params
  ref_cfg = GEMMA.replace(scan_layers=False, remat="none",
                          attention="reference", logprob_chunks=(0, 0))
  return {kind: _results(ref_cfg, layout, params, make(GEMMA))
          for kind, make in _BATCHES.items()}


@pytest.mark.parametrize("layout_kind,changes", [
    ("repeated", dict(scan_layers=True, remat="full")),
    ("grouped", dict(scan_layers=True, remat="dots", attention="chunked")),
    ("grouped", dict(scan_layers=False, remat="none", attention="chunked",
                     logprob_chunks=(16, 32))),
    pytest.param("repeated", dict(scan_layers=True, remat="dots",
                                  attention="chunked", logprob_chunks=(8, 16)),
                 marks=pytest.mark.slow),
])
def test_scan_remat_chunked_equal_the_loop_reference(gemma_params, reference,
                                                    changes, layout_kind):
  """Logits, loss and every gradient entry of the scanned / rematerialised /
  chunked paths equal the Python loop with T x T attention and whole
  logits (8 devices, Gemma-2 switches, padding, GQA)."""
  layout, _, params = gemma_params
  batch = _BATCHES[layout_kind](GEMMA)
  l0, a0, g0, p0 = reference[layout_kind]
  l1, a1, g1, p1 = _results(GEMMA.replace(**changes), layout, params, batch)
  mask = np.asarray(batch["loss_mask"]) > 0
  np.testing.assert_allclose(p1[mask], p0[mask], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
  for k in ("kl", "entropy"):
    np.testing.assert_allclose(a1[k], a0[k], rtol=1e-4, atol=1e-5)
  flat0 = jax.tree.leaves(g0)
  flat1 = jax.tree.leaves(g1)
  assert max(float(np.abs(x).max()) for x in flat0) > 1e-3  # Not vacuous.
  for x, y in zip(flat0, flat1):
    np.testing.assert_allclose(y, x, rtol=2e-4, atol=5e-6)


@pytest.mark.parametrize("skip_empty", [True, False])
@pytest.mark.parametrize("window,softcap,causal", [
    (fa.NO_WINDOW, None, True), (6, None, True), (fa.NO_WINDOW, 5.0, True),
    (9, 3.0, True), (fa.NO_WINDOW, None, False)])
def test_chunked_attention_equals_reference_with_lse_grads(
    window, softcap, causal, skip_empty, monkeypatch):
  """Chunked == T x T reference in value, log-sum-exp and every gradient
  (the lse's too: the grouped layout merges parts by it), with padding,
  packed segments, GQA, windows and soft-caps; blocks that do not divide
  the lengths. Both ways of treating a block pair with no allowed pair:
  skipped by `lax.cond` (CPU, TPU) and computed masked (GPU, whose
  conditionals wait on the host: a whole GRPO step took minutes so)."""
  monkeypatch.setitem(fa.SKIP_EMPTY_BLOCKS, jax.default_backend(), skip_empty)
  rng = np.random.default_rng(0)
  B, T, S, H, N, K = 2, 37, 29, 4, 2, 16
  q = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, S, N, K)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, S, N, K)), jnp.float32)
  q_pos = jnp.asarray(np.sort(rng.integers(0, 40, (B, T)), 1), jnp.int32)
  k_pos = jnp.asarray(np.sort(rng.integers(0, 40, (B, S)), 1), jnp.int32)
  q_seg = jnp.asarray(rng.integers(-1, 2, (B, T)), jnp.int32)
  k_seg = jnp.asarray(rng.integers(-1, 2, (B, S)), jnp.int32)
  w_out = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  w_lse = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)

  # One program per attention path and block shape (eager, each primitive
  # of the scans compiled alone: 415 programs for this test's cases).
  @functools.partial(jax.jit, static_argnums=(0, 1))
  def loss(impl, block, q, k, v, q_pos, k_pos, q_seg, k_seg):
    def f(q, k, v):
      out, lse = fa.attention(q, k, v, q_pos, k_pos, q_seg, k_seg,
                              window=window, softcap=softcap, causal=causal,
                              impl="reference", return_lse=True) if (
          impl == "reference") else fa.chunked_attention(
              q, k, v, q_pos, k_pos, q_seg, k_seg, window=window,
              softcap=softcap, causal=causal, block_q=block[0],
              block_k=block[1])
      lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out * w_out) + jnp.sum(jnp.sin(lse) * w_lse), (out, lse)
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  inputs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  (l0, (o0, s0)), g0 = loss("reference", None, *inputs)
  # Square blocks, and the grouped prefix's shape: tall query blocks over
  # wider key blocks (`models/grouped_forward.py`), and the reverse.
  for block in ((8, 8), (24, 16), (8, 32)):
    (l1, (o1, s1)), g1 = loss("chunked", block, *inputs)
    np.testing.assert_allclose(o1, o0, atol=2e-6, err_msg=str(block))
    np.testing.assert_allclose(s1, s0, atol=2e-6, err_msg=str(block))
    for x, y in zip(g0, g1):
      np.testing.assert_allclose(y, x, atol=5e-6, err_msg=str(block))
  # The compiled forward and backward hold conditionals exactly when skipping.
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fa.chunked_attention(
      q, k, v, q_pos, k_pos, q_seg, k_seg, window=window, softcap=softcap,
      causal=causal, block_q=8, block_k=8)[0]), argnums=(0, 1, 2)))
  hlo = grad.lower(q, k, v).compile().as_text()
  assert (" conditional(" in hlo) == skip_empty


def test_splash_equals_reference_interpreted():
  """The TPU splash path (interpreted on CPU): causal, padding, sliding
  window, soft-cap, GQA; what `impl="auto"` runs on a TPU."""
  rng = np.random.default_rng(0)
  B, T, H, N, K = 2, 100, 4, 2, 128
  q = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, T, N, K)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, T, N, K)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  seg = jnp.asarray(np.where(np.arange(T)[None] < np.array([[100], [61]]),
                             0, -1), jnp.int32)
  valid = np.asarray(seg) >= 0
  for window, softcap in ((fa.NO_WINDOW, None), (17, 30.0)):
    ref = fa.attention(q, k, v, pos, pos, seg, seg, window=window,
                       softcap=softcap, impl="reference")
    ours = fa.attention(q, k, v, pos, pos, seg, seg, window=window,
                        softcap=softcap, impl="splash", self_attention=True)
    np.testing.assert_allclose(np.asarray(ours)[valid],
                               np.asarray(ref)[valid], atol=2e-5)


def test_auto_attention_takes_cudnn_only_where_it_has_a_kernel():
  """impl="auto" on a GPU: cuDNN flash attention for bf16/fp16 causal
  padded rows, the chunked path for fp32 (cuDNN has no fp32 kernel: the
  first fp32 forward on an H100 would fail), soft-caps and lse; splash on
  TPU; one block of scores for short sequences on every backend."""
  def pick(backend, dtype, T=512, **kw):
    x = jax.ShapeDtypeStruct((1, T, 4, 64), dtype)
    args = dict(self_attention=True, causal=True, padded_rows=True,
                return_lse=False, softcap=None, static_window=True,
                packed=False)
    return fa.auto_impl(backend, x, x, **{**args, **kw})

  assert pick("gpu", jnp.bfloat16) == "cudnn"
  assert pick("gpu", jnp.float16) == "cudnn"
  assert pick("gpu", jnp.float32) == "chunked"
  assert pick("gpu", jnp.bfloat16, softcap=30.0) == "chunked"
  assert pick("gpu", jnp.bfloat16, return_lse=True) == "chunked"
  assert pick("gpu", jnp.bfloat16, padded_rows=False) == "chunked"
  assert pick("tpu", jnp.float32) == "splash"
  assert pick("tpu", jnp.bfloat16, packed=True) == "chunked"
  assert pick("cpu", jnp.bfloat16) == "chunked"
  assert pick("gpu", jnp.bfloat16, T=128) == "reference"


def test_splash_train_attention_lowers_for_tpu_without_t_by_t():
  """The TPU path (what `impl="auto"` picks there) exported for a TPU from
  this CPU: forward and backward lower to Mosaic kernels (custom calls),
  and no [T, T] tensor is left outside them."""
  B, T, H, N, K = 2, 1024, 4, 2, 128
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  seg = jnp.zeros((B, T), jnp.int32)

  def lowered(impl):
    def loss(q, k, v):
      out = fa.attention(q, k, v, pos, pos, seg, seg, window=256,
                         softcap=30.0, impl=impl, self_attention=True,
                         interpret=False)
      return jnp.sum(out.astype(jnp.float32))

    spec = lambda n: jax.ShapeDtypeStruct((B, T, n, K), jnp.bfloat16)
    text = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))),
                             platforms=("tpu",))(
                                 spec(H), spec(N), spec(N)).mlir_module()
    dims = [[int(d) for d in m.split("x")[:-1]]
            for m in re.findall(r"tensor<((?:\d+x)+)", text)]
    assert [B, T, H, K] in dims
    return text, [d for d in dims if sum(x >= T for x in d) >= 2]

  text, big = lowered("splash")
  assert text.count("tpu_custom_call") >= 2, "forward and backward kernels"
  assert not big, big[:5]
  assert lowered("reference")[1], "the check finds T x T where it exists"


def test_head_logprobs_equal_full_logits():
  """Log-probs, entropy and argmax from hidden states in vocabulary chunks
  equal the ones from the whole [B, T, V] logits; so do the gradients
  (tied [V, D] and untied [D, V] heads, soft-cap, temperature)."""
  rng = np.random.default_rng(0)
  B, T, D, V = 2, 13, 16, 37
  h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w_vd = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
  tg = jnp.asarray(rng.integers(0, V, size=(B, T)))
  weights = jnp.arange(T, dtype=jnp.float32)
  for cap, temp, axis in ((None, 1.0, 0), (3.0, 0.7, 0), (2.0, 1.3, 1)):
    w = w_vd if axis == 0 else w_vd.T

    def full(h, w, cap=cap, temp=temp, axis=axis):
      z = jnp.einsum("btd,vd->btv" if axis == 0 else "btd,dv->btv", h, w)
      z = z if cap is None else cap * jnp.tanh(z / cap)
      return (logprobs.token_logprobs(z, tg, temperature=temp),
              logprobs.token_entropy(z, temperature=temp), jnp.argmax(z, -1))

    def chunked(h, w, cap=cap, temp=temp, axis=axis):
      return logprobs.head_logprobs(h, w, tg, vocab_axis=axis, softcap=cap,
                                    temperature=temp, row_chunk=8,
                                    vocab_chunk=10)

    # Jitted: one program per path (eager, each primitive of the chunk
    # loops compiled alone).
    a, b = jax.jit(full)(h, w), jax.jit(chunked)(h, w)
    np.testing.assert_allclose(b[0], a[0], atol=1e-5)
    np.testing.assert_allclose(b[1], a[1], atol=2e-5)
    np.testing.assert_array_equal(b[2], a[2])
    ga = jax.jit(jax.grad(lambda h, w: (full(h, w)[0] * weights).sum(),
                          (0, 1)))(h, w)
    gb = jax.jit(jax.grad(lambda h, w: (chunked(h, w)[0] * weights).sum(),
                          (0, 1)))(h, w)
    for x, y in zip(ga, gb):
      np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-5)


def test_head_logprobs_split_over_devices_compute_their_own_rows(mesh8):
  """Under the 8-device train layout, with the rows in 8 groups, the
  chunked log-probs and their gradients equal the whole logits'; and no
  device gathers all the rows (as the one-group loop over row chunks has
  XLA do: every device computing the whole batch's vocabulary head)."""
  from rlhf_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from rlhf_jax.parallel.layout import use_layout  # pylint: disable=g-import-not-at-top
  layout = mesh_lib.train_layout(mesh8)
  rng = np.random.default_rng(1)
  B, T, D, V = 8, 12, 16, 37
  h = jax.device_put(jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32),
                     layout.sharding(("batch", None, None)))
  w = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
  tg = jax.device_put(jnp.asarray(rng.integers(0, V, size=(B, T))),
                      layout.sharding(("batch", None)))
  weights = jnp.asarray(rng.random((B, T)), jnp.float32)
  groups = layout.shards("rows")
  assert groups == 8

  def loss(h, w, groups):
    with use_layout(layout):
      logp, _, _ = logprobs.head_logprobs(
          h, w, tg, vocab_axis=0, row_chunk=8, vocab_chunk=10,
          row_groups=groups)
    return (logp * weights).sum(), logp

  def full(h, w):
    z = jnp.einsum("btd,vd->btv", h, w)
    logp = logprobs.token_logprobs(z, tg)
    return (logp * weights).sum(), logp

  def gathers_all_rows(fn):
    text = jax.jit(fn).lower(h, w).compile().as_text()
    sizes = [np.prod([int(d) for d in m.group(1).split(",") if d])
             for line in text.splitlines() if "all-gather" in line
             for m in _SHAPE.finditer(line.split("=", 1)[1][:80])]
    return max(sizes, default=0) >= B * T * D

  want = jax.value_and_grad(full, (0, 1), has_aux=True)(h, w)
  split = lambda h, w: loss(h, w, groups)  # noqa: E731
  got = jax.jit(jax.value_and_grad(split, (0, 1), has_aux=True))(h, w)
  np.testing.assert_allclose(got[0][1], want[0][1], atol=1e-5)
  for x, y in zip(want[1], got[1]):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-5)
  grad_of = lambda f: jax.grad(lambda h, w: f(h, w)[0], (0, 1))  # noqa: E731
  assert not gathers_all_rows(grad_of(split))
  assert gathers_all_rows(grad_of(lambda h, w: loss(h, w, 1)))


# ------------------------------------------------------- compiled HLO shapes
_SHAPE = re.compile(r"\b(?:f32|bf16|f16|pred|s32|u32)\[([0-9,]+)\]")


def _big_pairs(hlo: str, at_least: int) -> set[str]:
  """Array shapes in `hlo` with two dimensions >= at_least."""
  out = set()
  for m in _SHAPE.finditer(hlo):
    dims = [int(x) for x in m.group(1).split(",") if x]
    if sum(d >= at_least for d in dims) >= 2:
      out.add(m.group(0))
  return out


@pytest.mark.parametrize("layout_kind", ["repeated", "grouped", "packed"])
def test_no_t_by_t_in_the_compiled_train_step(mesh8, layout_kind):
  """The train step (forward, backward, AdamW) of a Gemma-2-like model
  with soft-caps and windows, on 8 devices, compiled: no array anywhere has
  two sequence-sized dimensions (T = 512: every model dimension is smaller),
  so neither [T, T] scores nor [T, V]-sized logits blocks of whole rows
  exist. The reference path (the baseline) does have them. The grouped
  prefix's blocks are bounded by `prefix_block_scores` (a constant, 2M
  elements by default, larger than these whole parts): 128 x 128 here."""
  cfg = GEMMA.replace(vocab_size=256, remat="full",
                      prefix_block_scores=128 * 128)
  layout = mesh_lib.train_layout(mesh8)
  T = 512
  if layout_kind == "repeated":
    batch = _repeated_batch(cfg, B=8, T=T)
  elif layout_kind == "grouped":
    batch = _grouped_batch(cfg, N=8, G=2, P=448, R=T)
  else:  # Packed groups: segments and sub-segments (rl/packing.py).
    batch = _repeated_batch(cfg, B=8, T=T)
    ids = np.arange(T)[None] // 100 * np.ones((8, 1), np.int32)
    batch.pop("attn_mask")
    batch.update(seg=ids // 2, sub=ids % 2, seq=ids, seq_len=np.full(
        (8, T), 100.0, np.float32), row_seqs=np.full(8, 5.0, np.float32),
                 advantages=np.ones((8, T), np.float32))
  found = {}
  for name, changes in (("ours", dict(attention="chunked")),
                        ("reference", dict(attention="reference",
                                           logprob_chunks=(0, 0)))):
    c = cfg.replace(**changes)
    graphdef, params = model_lib.abstract_params(c)
    terms, weight = objectives.policy_terms(objectives.PolicyLossConfig(
        kl=KLConfig(0.05), aggregation="seq-mean-token-mean"))
    learner = Learner(graphdef, layout, make_optimizer(OptimConfig()),
                      terms_fn=terms, weight_fn=weight, micro_batches=1)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        params, layout.param_shardings(params))
    opt = jax.eval_shape(learner.optimizer.init, params)
    state = TrainState(params, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        opt, learner.opt_shardings(params, opt)),
                       jax.ShapeDtypeStruct((), jnp.int32,
                                            sharding=layout.replicated()))
    sds = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype,
                                   sharding=layout.sharding(
                                       ("batch",) + (None,) * (np.ndim(v) - 1),
                                       np.shape(v)))
           for k, v in batch.items()}
    hlo = learner._step_jit.lower(state, sds).compile().as_text()  # pylint: disable=protected-access
    found[name] = _big_pairs(hlo, 400)
  assert not found["ours"], sorted(found["ours"])[:10]
  assert found["reference"], "the check finds T x T where it exists"
