"""Decoder parity: prefill + incremental decode equals the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig, RopeScaling
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout

FAMILIES = {
    "llama": dict(rope_scaling=RopeScaling(factor=8.0,
                                           original_max_position=16)),
    "qwen2_qkv_bias": dict(qkv_bias=True, tie_embeddings=True),
    "qwen3_qk_norm": dict(qk_norm=True, tie_embeddings=True),
    "gemma2_geglu": dict(mlp_activation="gelu", norm_plus_one=True,
                         post_norms=True, embed_scale=True, tie_embeddings=True,
                         attn_logit_softcap=50.0, final_logit_softcap=30.0,
                         query_scale=0.2),
}


def _random_nonzero(params, seed):
  """Perturb every param (biases and norms are born 0/1 and would hide bugs)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_then_decode_matches_full_forward(family, mesh8):
  # Both modes run sharded on the same 8-device layout (FSDP 4 x tensor 2), so
  # the comparison isolates the cached-decode math from reduction order.
  cfg = ModelConfig.tiny(**FAMILIES[family])
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=4, tensor=2))
  graphdef, params = model_lib.init_params(cfg, 0, layout)
  params = jax.jit(_random_nonzero, static_argnums=1)(params, 1)
  B, T, prompt_len, M = 4, 12, 5, 8
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  mask = np.ones((B, T), bool)

  with use_layout(layout):
    full = jax.jit(model_lib.forward, static_argnums=0)(
        graphdef, params, tokens, positions, mask)

  @jax.jit
  def prefill_and_decode(params):
    with use_layout(layout):
      logits, (k, v) = model_lib.forward(
          graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len],
          mask[:, :prompt_len], return_kv=True)
      # Rows = the B prompts, one sample each; pad the prompt cache to 8.
      pad = [(0, 0), (0, 0), (0, 8 - prompt_len), (0, 0), (0, 0)]
      k, v = jnp.pad(k, pad), jnp.pad(v, pad)
      shape = (cfg.num_layers, B, 1, M, cfg.num_kv_heads, cfg.head_dim)
      sk = sv = jnp.zeros(shape)
      slen = jnp.zeros((B, 1), jnp.int32)

      # One decode step as a scan body: compiled once, not once per step.
      def step(carry, token_and_position):
        sk, sv, slen = carry
        tok_Bx1, pos_Bx1 = token_and_position
        lg_Bx1xV, sk, sv = model_lib.decode(
            graphdef, params, tok_Bx1, pos_Bx1, k, v,
            jnp.full((B,), prompt_len), sk, sv, slen)
        return (sk, sv, slen + 1), lg_Bx1xV[:, 0]

      later = lambda x: x[:, prompt_len:].T[..., None]  # noqa: E731  [S, B, 1]
      _, decoded_SxBxV = jax.lax.scan(
          step, (sk, sv, slen), (later(tokens), later(positions)))
      return jnp.concatenate(
          [logits, jnp.moveaxis(decoded_SxBxV, 0, 1)], axis=1)

  incremental = prefill_and_decode(params)
  np.testing.assert_allclose(incremental, full, atol=1e-5, rtol=0)


def test_padding_does_not_change_real_tokens(mesh8):
  cfg = ModelConfig.tiny()
  graphdef, params = model_lib.init_params(cfg, 0)
  tokens = np.arange(1, 9, dtype=np.int32)[None]
  pos = np.arange(8, dtype=np.int32)[None]
  short = model_lib.forward(graphdef, params, tokens[:, :5], pos[:, :5],
                            np.ones((1, 5), bool))
  mask = np.arange(8)[None] < 5
  padded = model_lib.forward(graphdef, params, tokens, pos, mask)
  np.testing.assert_allclose(padded[:, :5], short, atol=1e-5, rtol=0)


def test_presets_have_published_sizes():
  # Parameter counts of the released checkpoints (embeddings included).
  expected = {"qwen2.5-0.5b": 494.0e6, "llama3.2-1b": 1.236e9,
              "qwen3-0.6b": 596.0e6, "gemma2-2b": 2.614e9}
  for name, count in expected.items():
    n = ModelConfig.preset(name).num_params()
    assert abs(n - count) / count < 0.01, (name, n)
  with pytest.raises(ValueError, match="unknown model preset"):
    ModelConfig.preset("gpt5")
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig.tiny(num_heads=4, num_kv_heads=3)


def test_random_init_takes_its_key_as_an_argument(mesh8, monkeypatch):
  """The jitted init draws from a key argument, never a constant key
  (every weight a constant expression XLA may fold: the constant-key init
  of Qwen2.5-1.5B compiled for 2 min 12 s on an H100). The values are
  those the constant-key init gave."""
  real_jit, calls = jax.jit, []

  def spy(fn, **kw):
    jitted = real_jit(fn, **kw)

    def call(*args):
      calls.append(args)
      return jitted(*args)
    return call

  monkeypatch.setattr(jax, "jit", spy)
  cfg = ModelConfig.tiny(qkv_bias=True)
  layout = mesh_lib.train_layout(mesh8)
  _, params = model_lib.init_params(cfg, 3, layout)
  monkeypatch.undo()
  assert len(calls) == 1 and len(calls[0]) == 1
  assert jax.dtypes.issubdtype(calls[0][0].dtype, jax.dtypes.prng_key)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rlhf_jax.models.transformer import Decoder  # pylint: disable=g-import-not-at-top
  constant_key = jax.jit(
      lambda: nnx.split(Decoder(cfg, rngs=nnx.Rngs(3)), nnx.Param)[1])()
  for got, want in zip(jax.tree.leaves(params),
                       jax.tree.leaves(constant_key)):
    assert got.sharding.mesh.size == 8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
