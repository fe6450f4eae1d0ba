"""Tunix's own GRPO step time at our benchmark shapes (a reference point).

python -m benchmarks.tunix_grpo [--quick] [--smoke] [--out=PATH]
    [--layers=28 --d_model=1536 --prompt_len=2048 --new_tokens=1024
     --prompts=16 --G=16 --steps=3]

Drives Google's Tunix (PyPI `google-tunix`, import `tunix`; not a dependency
of rlhf_jax) through its public API, the way its own GRPO examples do: its
Qwen2 model (`tunix.models.qwen2`) with Qwen2.5-1.5B dimensions and random
weights (`tunix.models.dummy_model_creator`, no checkpoint), an `RLCluster`
whose actor, reference and rollout roles share one single-device mesh, the
"vanilla" rollout engine (Tunix's own JAX sampler; vLLM / SGLang are not
available), and `GRPOLearner.train`. Nothing of GRPO is reimplemented here.

Tunix works on text, so prompts are strings of random token ids and the
tokenizer (`IdTokenizer`) maps "12 7 9" <-> [12, 7, 9]. Its EOS id is one
past the vocabulary, so no sample can stop early: every completion is
exactly --new_tokens long, like our benchmarks' forced lengths. The reward
(fraction of even ids in a completion) is trivial on purpose.

Timing: `GRPOLearner.train` runs the warm-up step plus --steps timed steps
in one call. The prompt iterator is asked for a new batch at the start of
each global step; it first waits for the actor's parameters (the previous
step's update) to be ready, then stamps the time, so step k is the wall time
between two stamps (the last one ends when `train` returns and the weights
are ready). Each step's time is printed as soon as it is known, so a run cut
short still shows what it did. Tunix's own perf tracer
(`PerfMetricsExport`) splits each step into rollout / reference log-probs /
actor training; its figures are kept next to ours.

How Tunix does it (what differs from rlhf_jax): every prompt is repeated G
times before the rollout (no prompt sharing: each of the G copies is
prefilled and cached on its own); the sampler's KV cache is dense, [batch,
prompt_len + new_tokens, kv_heads, head_dim] per layer, and each decode step
attends over all of it under a mask; Qwen2's layers are unrolled (no scan)
and its attention off TPU is plain XLA (the flash kernel is TPU's splash
attention), so a [G, heads, T, T] score tensor exists per layer; and it
computes full-vocabulary float32 logits at every position (prefill and
log-probs alike). The *_micro flags (in prompts, G sequences each) bound
those tensors; the sizes are printed first ("largest buffers").

Remat: training at full size needs Tunix's RematConfig, but that model's
nnx.remat fails inside the sampler's decode loop (Tunix 0.1.7, flax 0.12),
so the rollout engine is Tunix's VanillaRollout on a remat-free view of the
same parameters (`no_remat_rollout`); Tunix still sees shared weights.

Last stdout line: JSON with `tunix_version`, `step_s_median`,
`first_step_s`, `steps`, `prompts`, `G`, `prompt_len`, `new_tokens`,
`peak_bytes` (the device's high-water mark, where the backend reports
one), plus every step's time and Tunix's phase split; out of device memory,
a JSON line with "error" instead (exit 1). --out writes the result with
its commit, date and machine (benchmarks/report.py).
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags, logging

from benchmarks import report
from benchmarks import timing

_QUICK = flags.DEFINE_bool("quick", False, "One timed step instead of "
                           "--steps (still full size unless shrunk).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny model and batch (CPU, "
                           "< 2 minutes): that it runs, not a measurement.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny model dims (2 layers, width "
                          "64, vocab 512); batch and lengths as given.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps after one warm-up.")
# Qwen2.5-1.5B (tunix.models.qwen2.ModelConfig.qwen2p5_1p5b) by default.
_LAYERS = flags.DEFINE_integer("layers", 28, "Decoder layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 1536, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 12, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_MLP = flags.DEFINE_integer("mlp", 8960, "MLP hidden width.")
_VOCAB = flags.DEFINE_integer("vocab", 151936, "Vocabulary size.")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Prompts per step.")
_G = flags.DEFINE_integer("G", 16, "Generations per prompt.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 2048, "Prompt tokens.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 1024, "Generated tokens "
                                   "per sample (exactly: no EOS can occur).")
_ROLLOUT_MICRO = flags.DEFINE_integer(
    "rollout_micro", 2, "Prompts per sampler call (x G sequences): the "
    "decode batch. The prefill's float32 logits are micro x G x prompt_len "
    "x vocab x 4 bytes (full size, 2 prompts: 37 GiB).")
_LOGPS_MICRO = flags.DEFINE_integer(
    "logps_micro", 1, "Prompts per reference log-prob call (x G sequences).")
_TRAIN_MICRO = flags.DEFINE_integer(
    "train_micro", 1, "Prompts per gradient-accumulation micro-batch "
    "(x G sequences); 1 is Tunix's smallest. Full size: 28 GiB of float32 "
    "logits and as much again for their gradient.")
_REMAT = flags.DEFINE_enum("remat", "decoder", ["none", "block", "decoder"],
                           "Tunix's Qwen2 RematConfig for training.")
_PARAM_DTYPE = flags.DEFINE_enum(
    "param_dtype", "bfloat16", ["bfloat16", "float32"],
    "Stored weights (actor, reference, Adam moments follow). Compute is "
    "bf16 either way. The rollout shares the actor's weights (one mesh), so "
    "float32 here means the sampler casts them each step.")
_BETA = flags.DEFINE_float("beta", 0.01, "KL coefficient (reference model "
                           "is scored only when it is not 0).")
_LR = flags.DEFINE_float("lr", 1e-6, "AdamW learning rate.")
_MEM_FRACTION = flags.DEFINE_string(
    "mem_fraction", "0.95", "XLA_PYTHON_CLIENT_MEM_FRACTION when the "
    "environment does not set it ('' leaves JAX's default, 0.75).")


class IdTokenizer:
  """Text <-> token ids where the text is the ids, space separated.

  Tunix's TokenizerAdapter accepts any object with these five methods. No
  BOS (bos_id is None, so the sampler adds nothing); pad is id 0; EOS is
  one past the vocabulary, so it can never be sampled.
  """

  def __init__(self, vocab: int):
    self._eos = vocab

  def encode(self, text, **kwargs):
    del kwargs
    return [int(t) for t in str(text).split()]

  def decode(self, ids, **kwargs):
    del kwargs
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return 0


def even_fraction_reward(prompts, completions, **kwargs):
  """Fraction of even token ids in each completion (a reward that costs
  nothing, so the step time is the model's)."""
  del prompts, kwargs
  out = []
  for text in completions:
    ids = [int(t) for t in text.split()]
    out.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
  return out


def no_remat_rollout(vanilla_rollout, base_rollout, qwen2):
  """Tunix's vanilla rollout engine on a remat-free view of the actor.

  Training at full size needs remat (Tunix's Qwen2 keeps every layer's
  [G, heads, T, T] attention otherwise), but the model's nnx.remat fails
  inside the sampler's decode while_loop ("Cannot mutate Param from a
  different trace level", Tunix 0.1.7 with flax 0.12). The view is the
  same Param objects under a graph whose config says no remat: updates to
  the actor are seen by the sampler at once, exactly as when the rollout
  engine holds the actor itself (Tunix's colocated default), and Tunix
  still sees shared weights, so it syncs nothing. Passed to Tunix as a
  custom rollout engine class (ClusterConfig.rollout_engine).
  """
  import dataclasses
  from flax import nnx

  class NoRematVanillaRollout(vanilla_rollout.VanillaRollout):

    def __init__(self, rollout_actor, tokenizer, mesh, rollout_config):
      del mesh  # one mesh for every role
      config = dataclasses.replace(
          rollout_actor.config, remat_config=qwen2.RematConfig.NONE)
      graphdef = nnx.graphdef(nnx.eval_shape(
          lambda: qwen2.Qwen2(config, rngs=nnx.Rngs(0))))
      view = nnx.merge(graphdef, nnx.state(rollout_actor))
      # The cache RLCluster builds for the "vanilla" engine.
      super().__init__(view, tokenizer, base_rollout.CacheConfig(
          cache_size=rollout_config.kv_cache_size,
          num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
          head_dim=config.head_dim))

  return NoRematVanillaRollout


def _apply_presets():
  if _SMOKE.value:
    timing.smoke_defaults(tiny=True, prompts=2, G=2, prompt_len=16,
                          new_tokens=8, steps=1, rollout_micro=1,
                          logps_micro=1, train_micro=1)
  if _TINY.value:
    timing.smoke_defaults(layers=2, d_model=64, heads=4, kv_heads=2,
                          head_dim=16, mlp=128, vocab=512)
  if _QUICK.value:
    timing.smoke_defaults(steps=1)


def main(argv):
  del argv
  _apply_presets()
  if _MEM_FRACTION.value:
    # Tunix's float32 full-vocabulary logits need more than JAX's default
    # 75% of the GPU; must be set before JAX starts its backend.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                          _MEM_FRACTION.value)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  try:
    import tunix
  except ImportError as e:
    raise SystemExit(
        "Tunix is not installed (not an rlhf_jax dependency): install the "
        "wheels in .whl/ with `pip install --no-index --no-deps --target "
        "DIR .whl/*.whl` and put DIR first on PYTHONPATH") from e
  from tunix.models import dummy_model_creator
  from tunix.models.qwen2 import model as qwen2
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  from tunix.rl.rollout import vanilla_rollout

  P, G = _PROMPTS.value, _G.value
  prompt_len, new_tokens = _PROMPT_LEN.value, _NEW_TOKENS.value
  vocab = _VOCAB.value
  warmup, timed = 1, _STEPS.value
  for name, micro in (("rollout_micro", _ROLLOUT_MICRO.value),
                      ("logps_micro", _LOGPS_MICRO.value),
                      ("train_micro", _TRAIN_MICRO.value)):
    if P % micro:  # Tunix checks this too, later and less plainly.
      raise app.UsageError(f"--{name}={micro} must divide --prompts={P}")
  param_dtype = jnp.dtype(_PARAM_DTYPE.value)

  # One device; every role on the same mesh, so Tunix colocates them: the
  # rollout engine samples with the actor's own weights (no weight sync),
  # and the rollout is not run ahead of training (async only across meshes).
  # Auto axes, as tunix.utils.mesh makes them (jax.make_mesh's default,
  # Explicit, breaks the model's embedding gather).
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  config = qwen2.ModelConfig(
      num_layers=_LAYERS.value, vocab_size=vocab, embed_dim=_D_MODEL.value,
      hidden_dim=_MLP.value, num_heads=_HEADS.value,
      head_dim=_HEAD_DIM.value, num_kv_heads=_KV_HEADS.value,
      rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True,
      remat_config=qwen2.RematConfig[_REMAT.value.upper()],
      dtype=jnp.bfloat16, param_dtype=param_dtype)

  # The big buffers, from the shapes alone (see the module docstring): a
  # rollout call's KV cache and prefill logits, a log-prob or train
  # micro-batch's logits (Tunix scores the whole prompt + completion).
  seq = prompt_len + new_tokens
  plan = {
      "kv_cache_per_rollout_call": 2 * 2 * _LAYERS.value * _ROLLOUT_MICRO.value
      * G * seq * _KV_HEADS.value * _HEAD_DIM.value,
      "prefill_logits_f32": 4 * _ROLLOUT_MICRO.value * G * prompt_len * vocab,
      "logps_logits_f32": 4 * _LOGPS_MICRO.value * G * seq * vocab,
      "train_logits_f32": 4 * _TRAIN_MICRO.value * G * seq * vocab,
  }
  print("largest buffers (GiB): " + ", ".join(
      f"{k} {v / 2**30:.1f}" for k, v in plan.items()), flush=True)

  t0 = time.perf_counter()
  # Tunix's random-weight builder (normal * 0.02 for every parameter, made
  # with the model's shardings on the mesh): no checkpoint is read.
  actor = dummy_model_creator.create_dummy_model(
      qwen2.Qwen2, config, mesh=mesh, dtype=param_dtype, random_seed=0)
  # The reference starts as a copy of the policy, as in GRPO.
  graphdef, state = nnx.split(actor)
  reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  jax.block_until_ready(nnx.state(reference))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))

  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=new_tokens,
      max_prompt_length=prompt_len,
      # The sampler needs room for prompt + completion, no more.
      kv_cache_size=prompt_len + new_tokens,
      temperature=1.0, top_p=1.0, top_k=None,
      data_type=jnp.bfloat16)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(_LR.value, b1=0.9, b2=0.99, weight_decay=0.0))
  total_steps = warmup + timed
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer,
      eval_every_n_steps=10**9,  # no eval set is given anyway
      max_steps=total_steps,
      # One optimizer update per step (one PPO epoch, one mini-batch),
      # gradients accumulated over micro-batches of train_micro prompts.
      mini_batch_size=P,
      train_micro_batch_size=_TRAIN_MICRO.value,
      rollout_micro_batch_size=_ROLLOUT_MICRO.value,
      compute_logps_micro_batch_size=_LOGPS_MICRO.value,
      checkpoint_root_directory=None,  # no checkpoints, no metric files
      metrics_logging_options=None)
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh,
                    rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine=(
          "vanilla" if _REMAT.value == "none" else
          no_remat_rollout(vanilla_rollout, base_rollout, qwen2)),
      offload_to_cpu=False,
      training_config=training_config,
      rollout_config=rollout_config)
  # Tunix's own phase timer (rollout / reference / actor train per step).
  perf_config = tunix.PerfMetricsConfig()
  perf_config.custom_export_fn = tunix.PerfMetricsExport.from_cluster_config(
      cluster_config)
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=IdTokenizer(vocab),
      cluster_config=cluster_config, perf_config=perf_config)
  phases = []  # Tunix's perf metrics per global step, in order.

  lengths = []  # Tunix's mean completion length per step (a check).

  def keep_perf(buffer):
    """Tunix hands each step's buffered metrics here as it logs them."""
    perf = {k: float(np.asarray(v[0]).ravel()[0])
            for k, v in buffer.metrics.items() if k.startswith("perf/")}
    if perf:
      phases.append(perf)
    if "completions/mean_length" in buffer.metrics:
      lengths.append(float(np.mean(
          buffer.metrics["completions/mean_length"][0])))

  cluster.with_external_metrics_logger(keep_perf)
  algo_config = grpo_learner.GRPOConfig(
      num_generations=G, num_iterations=1, beta=_BETA.value, epsilon=0.2,
      loss_agg_mode="token-mean")
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, algo_config=algo_config,
      reward_fns=[even_fraction_reward])
  build_s = time.perf_counter() - t0

  actor_model = cluster.actor_trainer.model
  stamps = []
  rng = np.random.default_rng(0)

  def batches():
    """One batch of P prompts per global step, stamped as it is asked for."""
    for _ in range(total_steps):
      # Wait for the previous update, so the stamp closes that step.
      jax.block_until_ready(nnx.state(actor_model))
      stamps.append(time.perf_counter())
      if len(stamps) > 1:  # progress survives a run cut short
        print(f"step {len(stamps) - 1} of {total_steps}: "
              f"{stamps[-1] - stamps[-2]:.2f} s", flush=True)
      ids = rng.integers(1, vocab, size=(P, prompt_len))
      yield {"prompts": np.array([" ".join(map(str, row)) for row in ids])}

  print(f"built in {build_s:.1f} s; {total_steps} steps to run "
        f"(the first compiles)", flush=True)
  try:
    learner.train(batches())
    jax.block_until_ready(nnx.state(actor_model))
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e):
      raise
    # Out of device memory: one plain JSON line says so and what ran.
    print(json.dumps({
        "tunix_version": tunix.__version__, "error": "out of memory",
        "detail": str(e)[:500], "steps_done": max(len(stamps) - 1, 0),
        "prompts": P, "G": G, "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "micro_batches": {"rollout": _ROLLOUT_MICRO.value,
                          "logps": _LOGPS_MICRO.value,
                          "train": _TRAIN_MICRO.value}}))
    sys.exit(1)
  stamps.append(time.perf_counter())
  print(f"step {total_steps} of {total_steps}: "
        f"{stamps[-1] - stamps[-2]:.2f} s", flush=True)
  if len(stamps) != total_steps + 1:
    raise RuntimeError(f"expected {total_steps} steps, got "
                       f"{len(stamps) - 1}: Tunix stopped early")
  # Colocated as Tunix's default: the sampler reads the actor's own
  # parameters, so no weight sync was timed.
  from tunix.rl import utils as rl_utils
  shares = bool(rl_utils.is_sharing_weights(actor_model,
                                            cluster.rollout.model()))
  step_s = [b - a for a, b in zip(stamps, stamps[1:])]
  first_s, timed_s = step_s[0], step_s[warmup:]

  B = P * G
  peak = (jax.local_devices()[0].memory_stats() or {}).get(
      "peak_bytes_in_use")
  keys = ("perf/global_step_time", "perf/sum/rollout_time",
          "perf/sum/refer_inference_time", "perf/sum/actor_train_time")
  print(f"Tunix {tunix.__version__} GRPO: {P} prompts x G={G} = {B} "
        f"sequences, prompt {prompt_len} + {new_tokens} new tokens, "
        f"{_LAYERS.value} layers x {_D_MODEL.value} ({n_params / 1e9:.2f}B "
        f"params, {param_dtype.name}), {jax.devices()[0].device_kind}")
  print(f"{'step':<8}{'wall_s':>10}" + "".join(
      f"{k.split('/')[-1].replace('_time', '_s'):>19}" for k in keys))
  for i, s in enumerate(step_s):
    row = phases[i] if i < len(phases) else {}
    label = "warm-up" if i < warmup else str(i - warmup + 1)
    print(f"{label:<8}{s:>10.3f}" + "".join(
        f"{row.get(k, float('nan')):>19.3f}" for k in keys))
  med = statistics.median(timed_s)
  tokens = B * new_tokens
  print(f"median step {med:.3f} s ({tokens / med:.0f} generated tok/s); "
        f"first step (compiles) {first_s:.3f} s; build {build_s:.1f} s")
  print(f"mean completion length per step: {lengths} (of {new_tokens}); "
        f"rollout shares the actor's weights: {shares}")
  if peak is not None:
    print(f"peak device memory: {peak / 2**30:.2f} GiB")
  phase_median = {}
  timed_phases = phases[warmup:total_steps]
  if timed_phases:
    for k in keys:
      vals = [p[k] for p in timed_phases if k in p]
      if vals:
        phase_median[k.split("/")[-1].replace("_time", "_s")] = (
            statistics.median(vals))
  summary = {
      "tunix_version": tunix.__version__,
      "step_s_median": med, "first_step_s": first_s, "steps": timed,
      "prompts": P, "G": G, "prompt_len": prompt_len,
      "new_tokens": new_tokens, "peak_bytes": peak,
      "step_s": timed_s, "build_s": build_s,
      "tunix_phase_median_s": phase_median, "tunix_phases": phases,
      "layers": _LAYERS.value, "d_model": _D_MODEL.value,
      "params": int(n_params), "param_dtype": param_dtype.name,
      "micro_batches": {"rollout": _ROLLOUT_MICRO.value,
                        "logps": _LOGPS_MICRO.value,
                        "train": _TRAIN_MICRO.value},
      "remat": _REMAT.value, "beta": _BETA.value, "plan_bytes": plan,
      "completion_mean_length": lengths, "rollout_shares_actor": shares,
      "device": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
  }
  report.emit(summary)


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  app.run(main)
