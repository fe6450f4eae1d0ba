"""[lora] A LoRA policy: adapters on a frozen base, merged for rollout."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

import resume
from configs import tiny_grpo_lora
from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.models import lora
from rlhf_jax.models import model as model_lib
from rlhf_jax.models import rollout_copy
from rlhf_jax.models.config import LORA_TARGETS, LoraSpec, ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.trainers import rl_job

CFG = ModelConfig.tiny(vocab_size=64, scan_layers=True)
CFG_VOCAB = CharTokenizer().vocab_size  # The addition task's tokenizer.
ALL = LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS)
# Weight name -> how many leading axes (after "layers") it contracts.
IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def _tokens(seed=0, B=4, T=12):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  lengths = rng.integers(T // 2, T + 1, B)
  mask = jnp.asarray(np.arange(T)[None] < lengths[:, None])
  return tokens, positions, mask


@pytest.fixture(scope="module")
def base():
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=4, tensor=2))
  graphdef, params = model_lib.init_params(CFG, 0, layout)
  return layout, graphdef, params


def _forward(graphdef, params, layout):
  with use_layout(layout):
    return jax.jit(model_lib.forward, static_argnums=0)(
        graphdef, params, *_tokens())


def _random_adapters(params, seed):
  """Non-zero A and B, so the adapters change the model."""
  adapters, frozen = lora.split(params)
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  adapters = jax.tree.map(
      lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype),
      adapters)
  return nnx.merge_state(adapters, frozen)


def test_zero_b_lora_is_the_base_model(base):
  layout, graphdef, params = base
  _, lora_graphdef, lora_params = lora.attach(CFG, params, ALL, seed=1,
                                              layout=layout)
  adapters, _ = lora.split(lora_params)
  assert all(float(jnp.abs(v).max()) > 0 for k, v in
             nnx.to_flat_state(adapters) if k[-1].endswith("_lora_a"))
  plain = np.asarray(_forward(graphdef, params, layout))
  np.testing.assert_array_equal(
      np.asarray(_forward(lora_graphdef, lora_params, layout)), plain)


def test_lora_forward_and_merge_equal_the_low_rank_update(base):
  """Oracle: W + alpha/r * A @ B in float64 numpy, run by the plain model."""
  layout, graphdef, params = base
  _, lora_graphdef, lora_params = lora.attach(CFG, params, ALL, seed=1,
                                              layout=layout)
  lora_params = _random_adapters(lora_params, seed=2)
  flat = dict(nnx.to_flat_state(lora_params))
  updated = []
  for path, var in nnx.to_flat_state(params):
    name = path[-1]
    if name in IN_AXES:
      a = np.asarray(flat[path[:-1] + (name + "_lora_a",)].get_value(),
                     np.float64)
      b = np.asarray(flat[path[:-1] + (name + "_lora_b",)].get_value(),
                     np.float64)
      w = np.asarray(var.get_value(), np.float64)
      L, n_in = w.shape[0], IN_AXES[name]
      delta = np.stack([
          (a[i].reshape(-1, ALL.rank) @ b[i].reshape(ALL.rank, -1)).reshape(
              w.shape[1:]) for i in range(L)])
      var = var.replace(jnp.asarray(w + ALL.scale * delta, jnp.float32))
      assert n_in == a.ndim - 2
    updated.append((path, var))
  oracle = nnx.from_flat_state(updated)
  merged = lora.merged(lora_params, ALL)
  for (path, want), (_, got) in zip(nnx.to_flat_state(oracle),
                                    nnx.to_flat_state(merged)):
    np.testing.assert_allclose(np.asarray(got.get_value()),
                               np.asarray(want.get_value()), rtol=0,
                               atol=1e-6, err_msg=str(path))
  want = np.asarray(_forward(graphdef, oracle, layout))
  plain = np.asarray(_forward(graphdef, params, layout))
  assert np.abs(want - plain).max() > 0.1  # The adapters matter.
  np.testing.assert_allclose(
      np.asarray(_forward(lora_graphdef, lora_params, layout)), want,
      rtol=1e-4, atol=1e-4)
  # The reference policy: the same base with the adapters off.
  np.testing.assert_array_equal(
      np.asarray(_forward(lora_graphdef, lora.without_adapters(lora_params),
                          layout)),
      np.asarray(_forward(graphdef, params, layout)))


@pytest.mark.parametrize("overrides, message", [
    ({"lora.rank": -1}, "config.lora.rank=-1: must be an int >= 0"),
    ({"lora.rank": 4, "lora.targets": ("q", "qkv")},
     "config.lora.targets must be a non-empty subset"),
    ({"lora.alpha": 0.0}, "config.lora.alpha must be > 0, got 0.0"),
])
def test_lora_config_errors(overrides, message):
  c = resume.override(tiny_grpo_lora.get_config("runlocal"), **overrides)
  with pytest.raises(ConfigError, match="^" + message.replace(".", r"\.")
                     .replace("(", r"\(")):
    RLJob.from_config(c)


def _lora_config(**extra):
  return resume.override(tiny_grpo_lora.get_config("runlocal"), **{
      "train.steps": 4, "eval.every": 2, **extra})


_rl_records = resume.rl_records


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lora"))
  state = rl_job.run(_lora_config(), workdir)
  return workdir, state


def _adapter_bytes(cfg: ModelConfig, spec: LoraSpec) -> int:
  """fp32 bytes of the adapters, from the shapes of the layers."""
  d, h, n, k, f, r = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.mlp_dim, spec.rank)
  sizes = {"q": (d, h * k), "k": (d, n * k), "v": (d, n * k),
           "o": (h * k, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
  return 4 * cfg.num_layers * sum(r * (i + o) for i, o in
                                  (sizes[t] for t in spec.targets))


@pytest.mark.slow
def test_lora_job_trains_the_adapters_only(lora_run):
  workdir, state = lora_run
  c = RLJob.from_config(_lora_config())
  spec = c.lora.spec()
  cfg = c.model.model_config(vocab_size=CFG_VOCAB)
  records = _rl_records(workdir)
  assert sorted(records) == [0, 1, 2, 3, 4]
  adapters = _adapter_bytes(cfg, spec)
  last = records[4]
  assert last["memory/trained_param_bytes"] == adapters
  assert last["memory/frozen_param_bytes"] == 4 * cfg.num_params()
  # Adam's two moments of the adapters (+ its step counts), nothing more.
  assert 2 * adapters <= last["memory/opt_state_bytes"] <= 2 * adapters + 64
  # The policy starts as the base (B = 0), which is the reference.
  assert records[1]["rollout/kl"] == 0.0
  assert records[4]["rollout/kl"] > 0.0  # The adapters moved it.
  # Merged rollout weights sample what the unmerged trainer scores.
  for step in (1, 2, 3, 4):
    assert records[step]["rollout/logprob_gap"] < 1e-4, step
  # The base never moved: the final base equals the step-2 checkpoint's.
  from rlhf_jax import checkpoint
  with checkpoint.Checkpointer(f"{workdir}/checkpoints", keep=None) as ckpt:
    saved, _ = ckpt.restore(2, {"policy": state})
  before, after = (lora.split(s.params) for s in (saved["policy"], state))
  for x, y in zip(jax.tree.leaves(before[1]), jax.tree.leaves(after[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert any(np.abs(np.asarray(x) - np.asarray(y)).max() > 0 for x, y in
             zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0])))


@pytest.mark.slow
def test_lora_job_resumes_after_sigterm_as_if_uninterrupted(lora_run,
                                                            tmp_path):
  reference, _ = lora_run
  workdir = str(tmp_path / "run")
  with resume.SigtermWhen(lambda: resume.has_record(workdir, "rl", 2)
                          ) as sigterm:
    rl_job.run(_lora_config(), workdir)
  assert sigterm.sent
  assert not resume.has_record(workdir, "rl", 4)
  rl_job.run(_lora_config(), workdir)
  resume.assert_same_records(resume.records(workdir),
                             resume.records(reference))


@pytest.mark.parametrize("kind, bound", [("int8", 0.02), ("fp8", 0.1)])
def test_quantized_weights_are_per_channel_roundings(base, kind, bound):
  """Oracle: numpy per-output-channel scales and rounding; the quantized
  model's log-probs stay within `bound` nats (mean) of the plain one's."""
  layout, graphdef, params = base
  quantized = rollout_copy.quantize(params, kind)
  flat = dict(nnx.to_flat_state(quantized))
  top = {"int8": 127.0, "fp8": 448.0}[kind]
  for path, var in nnx.to_flat_state(params):
    if path[-1] not in IN_AXES:
      continue
    w = np.asarray(var.get_value(), np.float64)
    inputs = tuple(range(1, 1 + IN_AXES[path[-1]]))
    scale = np.abs(w).max(axis=inputs, keepdims=True) / top
    got_scale = np.asarray(flat[path[:-1] + (path[-1] + "_scale",)]
                           .get_value())
    np.testing.assert_allclose(got_scale, np.squeeze(scale, inputs),
                               rtol=1e-6)
    q = np.asarray(flat[path].get_value().astype(jnp.float32), np.float64)
    if kind == "int8":
      assert flat[path].get_value().dtype == jnp.int8
      np.testing.assert_array_equal(q, np.round(w / scale))
    else:  # e4m3: 3 mantissa bits, round to nearest: within 1/16.
      assert np.all(np.abs(q * scale - w) <= np.abs(w) / 16 + scale / 8)
  rollout_cfg, rollout_graphdef, _ = rollout_copy.rollout_model(
      CFG, graphdef, quant=kind)
  assert rollout_cfg.weight_quant == kind
  def logp(g, p):
    return np.asarray(jax.nn.log_softmax(_forward(g, p, layout), -1))
  gap = np.abs(logp(rollout_graphdef, quantized) - logp(graphdef, params))
  mask = np.asarray(_tokens()[2])
  assert 1e-5 < gap[mask].mean() <= bound


def _int8_config():
  return _lora_config(**{"rollout.quantize": "int8", "lora.rank": 0,
                         "train.steps": 2})


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("int8"))
  rl_job.run(_int8_config(), workdir)
  return workdir


@pytest.mark.slow
def test_int8_rollout_job_reports_a_small_logprob_gap(int8_run):
  records = _rl_records(int8_run)
  for step in (1, 2):
    # Mean |sampler - trainer| per token: quantization shows (fp32 rollout
    # copies agree to ~1e-6) but stays within the bound.
    assert 1e-5 < records[step]["rollout/logprob_gap_mean"] <= 0.02, step


@pytest.mark.slow
def test_export_writes_the_merged_policy(lora_run, tmp_path):
  from rlhf_jax import export as export_lib
  from rlhf_jax.models import hf
  workdir, state = lora_run
  done = export_lib.export(workdir, str(tmp_path / "hf"))
  assert (done.step, done.job) == (4, "grpo")
  cfg, graphdef, params = hf.load(done.out)
  assert cfg.lora is None and not lora.has_adapters(params)
  trained = jax.device_get(state.params)
  lora_cfg = cfg.replace(lora=RLJob.from_config(_lora_config()).lora.spec())
  lora_graphdef, _ = model_lib.abstract_params(lora_cfg)
  tokens, positions, mask = _tokens()
  tokens = tokens % cfg.vocab_size
  run = jax.jit(model_lib.forward, static_argnums=0)
  theirs = np.asarray(run(graphdef, params, tokens, positions, mask))
  ours = np.asarray(run(lora_graphdef, trained, tokens, positions, mask))
  # The unmerged policy the run trained, run by the LoRA model.
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_elastic_workers_pull_only_the_adapters(tmp_path):
  """The elastic job (in-process workers) with rank-8 adapters on q k v o:
  a worker gets the base once, then each version's adapters; the merged
  weights it builds sample what the trainer scores."""
  from configs import tiny_grpo_elastic
  c = tiny_grpo_elastic.get_config("runlocal")
  c.rollout.workers.kind = "local"
  c.lora.update(rank=8, alpha=16.0, targets=("q", "k", "v", "o"))
  c.train.update(steps=3, checkpoint_every=10)
  c.eval.every = 10
  rl_job.run(c, str(tmp_path))
  records = _rl_records(str(tmp_path))
  job = RLJob.from_config(c)
  cfg = job.model.model_config(vocab_size=CFG_VOCAB)
  adapters, full = _adapter_bytes(cfg, job.lora.spec()), 4 * cfg.num_params()
  workers = job.rollout.workers.num
  for step in (1, 2, 3):
    r = records[step]
    assert r["workers/pulls"] >= 1, step
    assert r["workers/pull_bytes"] == r["workers/pulls"] * adapters, step
    assert r["workers/pull_fraction"] == pytest.approx(adapters / full)
    # The base goes once to each worker, with its first version.
    assert r["workers/base_bytes"] == (workers * full if step == 1 else 0)
    assert r["rollout/logprob_gap"] < 1e-4, step
  assert adapters / full < 0.05


@pytest.mark.slow
def test_adapters_export_as_peft_and_start_a_run(lora_run, tmp_path):
  """Oracle: PEFT's W + (lora_alpha / r) B A on the exported base's torch
  tensors equals the merged export; the adapters load back unchanged."""
  from safetensors.numpy import load_file
  from rlhf_jax import export as export_lib
  from rlhf_jax.errors import CheckpointError
  from rlhf_jax.models import hf_adapters
  workdir, state = lora_run
  out = str(tmp_path / "split")
  export_lib.export(workdir, out, adapters=True)
  merged = export_lib.export(workdir, str(tmp_path / "merged")).out
  base = load_file(f"{out}/base/model.safetensors")
  pairs = load_file(f"{out}/adapter/adapter_model.safetensors")
  want = load_file(f"{merged}/model.safetensors")
  with open(f"{out}/adapter/adapter_config.json") as f:
    import json
    config = json.load(f)
  scale = config["lora_alpha"] / config["r"]
  assert len(pairs) == 2 * 7 * 2  # Two layers, seven projections, A and B.
  for name, w in base.items():
    stem = "base_model.model." + name[:-len(".weight")]
    if stem + ".lora_A.weight" in pairs:
      w = w + scale * (pairs[stem + ".lora_B.weight"]
                       @ pairs[stem + ".lora_A.weight"])
    np.testing.assert_allclose(w, want[name], rtol=0, atol=2e-6,
                               err_msg=name)
  # Loaded back: the trained adapters, bit for bit.
  trained, _ = lora.split(jax.device_get(state.params))
  c = _lora_config(**{"lora.init_from": f"{out}/adapter"})
  job = rl_job.build(c)
  started, _ = lora.split(job.policy.trained_params(job.params))
  for x, y in zip(jax.tree.leaves(trained), jax.tree.leaves(started)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Adapters of another shape: one line at build, before any work.
  c = _lora_config(**{"lora.init_from": f"{out}/adapter", "lora.rank": 8})
  with pytest.raises(CheckpointError, match="are rank 16, alpha 32.0"):
    rl_job.build(c)
  assert hf_adapters.read_spec(f"{out}/adapter").rank == 16


@pytest.mark.slow
def test_peft_applies_the_exported_adapters_as_the_merged_export(
    lora_run, tmp_path):
  """The adapters exported with `--adapters`, loaded by `peft` itself onto
  the exported base in `transformers`, give the logits of the merged
  export (and so of the policy the run trained)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from rlhf_jax import export as export_lib
  workdir, _ = lora_run
  split = str(tmp_path / "split")
  export_lib.export(workdir, split, adapters=True)
  merged = export_lib.export(workdir, str(tmp_path / "merged")).out

  def causal_lm(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager").eval()

  with_adapters = peft.PeftModel.from_pretrained(
      causal_lm(f"{split}/base"), f"{split}/adapter").eval()
  base = causal_lm(f"{split}/base")
  tokens, _, mask = _tokens()
  vocab = base.config.vocab_size
  inputs = dict(input_ids=torch.tensor(np.asarray(tokens) % vocab),
                attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long))
  with torch.no_grad():
    ours, want, plain = (m(**inputs).logits.float().numpy() for m in (
        with_adapters, causal_lm(merged), base))
  valid = np.asarray(mask)
  assert np.abs(want - plain)[valid].max() > 1e-3  # The adapters matter.
  np.testing.assert_allclose(ours[valid], want[valid], rtol=0, atol=1e-4)


def _at_eta_zero(c, *, on_workers: bool = False):
  """`c` as async RL at eta = 0: batch b waits for version b - 1, as in
  the synchronous job, so the two sample the same tokens. The rollout
  decodes on half the devices, or on 2 in-process elastic workers."""
  c.asynchronous = typed_config.config_dict(
      sections.Async, enabled=True, max_staleness=0, switch_after_groups=0)
  if on_workers:
    c.rollout.workers.update(num=2, theta=2, poll_steps=2)
  return c


def _assert_same_job(ours: dict, theirs: dict, steps: int) -> None:
  """The same samples (rewards, lengths, to the bit) and the same updates
  to fp32 rounding (an async trainer whose rollout has devices of its own
  trains on 4 of the 8)."""
  assert sorted(ours) == sorted(theirs)
  for step in range(1, steps + 1):
    assert ours[step]["async/staleness_max"] == 0
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
      assert ours[step][key] == theirs[step][key], (step, key)
    for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/kl",
                "rollout/logprob_gap_mean"):
      assert abs(ours[step][key] - theirs[step][key]) <= (
          1e-5 * abs(theirs[step][key]) + 1e-6), (
              step, key, ours[step][key], theirs[step][key])
  assert ours[steps]["eval/accuracy"] == theirs[steps]["eval/accuracy"]
  assert all(theirs[s]["train/grad_norm"] > 1e-3
             for s in range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.parametrize("on_workers", [False, True],
                         ids=["own_devices", "workers"])
def test_async_lora_job_at_eta_zero_equals_the_synchronous_one(
    lora_run, on_workers, tmp_path):
  """Async RL with a LoRA policy: its rollout's copy has the adapters
  merged in, and elastic workers pull each version's adapters and the
  base once (they merge for themselves), as in the synchronous job."""
  c = _at_eta_zero(_lora_config(), on_workers=on_workers)
  rl_job.run(c, str(tmp_path))
  ours = _rl_records(str(tmp_path))
  _assert_same_job(ours, _rl_records(lora_run[0]), steps=4)
  if on_workers:  # Totals since the start.
    job = RLJob.from_config(c)
    cfg = job.model.model_config(vocab_size=CFG_VOCAB)
    adapters = _adapter_bytes(cfg, job.lora.spec())
    full = 4 * cfg.num_params()
    # At eta = 0 the rollout waits for version s while step s logs: each
    # of the 2 workers has pulled versions 0 .. s-1 once, as adapters,
    # and the base once.
    for step in range(1, 5):
      r = ours[step]
      assert r["workers/pulls"] == 2 * step, (step, r["workers/pulls"])
      assert r["workers/pull_bytes"] == r["workers/pulls"] * adapters, step
      assert r["workers/base_bytes"] == 2 * full, step
    assert adapters / full < 0.2


@pytest.mark.slow
def test_async_int8_rollout_at_eta_zero_equals_the_synchronous_one(
    int8_run, tmp_path):
  """Async RL with an int8 rollout copy: its devices decode with the
  weights the trainer publishes, quantized, as the synchronous job's
  rollout does (the same samples, the same sampler/trainer gap)."""
  rl_job.run(_at_eta_zero(_int8_config()), str(tmp_path))
  _assert_same_job(_rl_records(str(tmp_path)), _rl_records(int8_run),
                   steps=2)
