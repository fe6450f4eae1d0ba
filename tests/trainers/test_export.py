"""`python -m rlhf_jax.export`: a run's policy as a Hugging Face checkpoint.

The slow tests run configs/gsm8k_grpo.py:runlocal (a tiny random Qwen2 HF
checkpoint, 2 GRPO steps) once, export it, and check the export against the
policy the run returned: the same tensors, the same logits in transformers.
The fast ones export hand-written workdirs (char-tokenizer jobs) and check
the one-line errors.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from configs import gsm8k_grpo, tiny_grpo, tiny_ppo, tiny_rm
from rlhf_jax import export as export_lib
from rlhf_jax import trainers
from rlhf_jax.checkpoint import Checkpointer
from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import CheckpointError, ConfigError, MissingInputError
from rlhf_jax.models import hf, hf_config
from rlhf_jax.models import model as model_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _arrays(params) -> dict:
  """{path: numpy array} of an nnx.State of params."""
  return {"/".join(map(str, k)): np.asarray(v.get_value())
          for k, v in nnx.to_flat_state(params)}


def _assert_same(a, b):
  a, b = _arrays(a), _arrays(b)
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _batch(vocab: int, B=3, T=24):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
  lengths = np.array([T, 17, 5])[:B]
  mask = np.arange(T)[None] < lengths[:, None]
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  return tokens, positions, mask, lengths


def _logits(cfg, params, tokens, positions, mask):
  graphdef, _ = model_lib.abstract_params(cfg)
  return np.asarray(jax.jit(model_lib.forward, static_argnums=0)(
      graphdef, params, tokens, positions, mask))


# ------------------------------------------------ gsm8k_grpo:runlocal (slow)
@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(workdir, the policy params the run ended with, on the host)."""
  workdir = str(tmp_path_factory.mktemp("gsm8k") / "run")
  state = trainers.run(gsm8k_grpo.get_config("runlocal"), workdir)
  return workdir, jax.device_get(state.params)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
  """The latest step exported with the defaults (the checkpoint's fp32)."""
  out = str(tmp_path_factory.mktemp("export") / "hf")
  return export_lib.export(run[0], out)


def _model_dir(workdir):
  return os.path.join(workdir, "runlocal_assets", "model")


@pytest.mark.slow
def test_export_holds_the_trained_policy_and_tokenizer(run, exported):
  workdir, trained = run
  steps = gsm8k_grpo.get_config("runlocal").train.steps
  assert (exported.step, exported.job, exported.dtype) == (steps, "grpo",
                                                           "float32")
  cfg, _, params = hf.load(exported.out)
  _assert_same(params, trained)
  assert cfg == hf_config.load_config(_model_dir(workdir))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(exported.out, name), "rb") as f, open(
        os.path.join(_model_dir(workdir), name), "rb") as g:
      assert f.read() == g.read(), name


@pytest.mark.slow
def test_transformers_logits_equal_the_checkpointed_policy(run, exported):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  workdir, trained = run
  cfg = hf_config.load_config(_model_dir(workdir))
  tokens, positions, mask, lengths = _batch(cfg.vocab_size)
  ours = _logits(cfg, trained, tokens, positions, mask)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      exported.out, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(mask, dtype=torch.long)
                   ).logits.float().numpy()
  assert np.abs(ours).max() > 0.1  # Not a vacuous comparison.
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(ours[b, :n], theirs[b, :n], atol=1e-5, rtol=0)
  # The copied tokenizer opens in transformers as the source's does. (Not
  # compared with our HFTokenizer: transformers 5 rebuilds a Qwen2
  # tokenizer's pre-tokenizer, which splits digits, unlike this tiny
  # tokenizer.json; the source directory behaves the same.)
  text = "What is 3 + 4?\n#### 7"
  ids = [transformers.AutoTokenizer.from_pretrained(d).encode(
      text, add_special_tokens=False) for d in (exported.out,
                                                _model_dir(workdir))]
  assert ids[0] == ids[1] and len(ids[0]) > 3


@pytest.mark.slow
def test_training_changed_the_exported_params(run, exported, tmp_path):
  workdir, _ = run
  first = export_lib.export(workdir, str(tmp_path / "step0"), step=0)
  assert first.step == 0
  _, _, initial = hf.load(_model_dir(workdir))
  _, _, at_step0 = hf.load(first.out)
  _assert_same(at_step0, initial)  # Step 0: no SFT, the HF checkpoint.
  _, _, final = hf.load(exported.out)
  a, b = _arrays(final), _arrays(initial)
  changed = [k for k in a if np.abs(a[k] - b[k]).max() > 1e-6]
  assert len(changed) == len(a), sorted(set(a) - set(changed))


@pytest.mark.slow
def test_bfloat16_export(run, tmp_path):
  workdir, trained = run
  done = export_lib.export(workdir, str(tmp_path / "bf16"), dtype="bfloat16")
  with open(os.path.join(done.out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  _, _, params = hf.load(done.out)
  got, want = _arrays(params), _arrays(trained)
  for k, v in want.items():
    assert got[k].dtype == ml_dtypes.bfloat16, k
    np.testing.assert_array_equal(got[k], v.astype(ml_dtypes.bfloat16), k)


# ------------------------------------------- hand-written workdirs (fast)
def _fake_workdir(path, config, key="policy", step=3, seed=1):
  """A workdir of `config` (as `loop.workdir_outputs` saves it) with one
  checkpoint of random policy params under `key`; returns those params."""
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  cfg = typed_config.from_dict(sections.Model, config.model, "model"
                           ).model_config(vocab_size=CharTokenizer().vocab_size)
  _, params = model_lib.init_params(cfg, seed)
  ckpt = Checkpointer(os.path.join(path, "checkpoints"))
  ckpt.save(step, {key: {"params": params}, "ref": params}, {"step": step})
  ckpt.close()
  return cfg, jax.device_get(params)


@pytest.mark.parametrize("job", ["grpo", "ppo"])
def test_char_tokenizer_job_writes_weights_and_config(job, tmp_path):
  config, key = {"grpo": (tiny_grpo.get_config("runlocal"), "policy"),
                 "ppo": (tiny_ppo.get_config("runlocal"), "actor")}[job]
  workdir = str(tmp_path / "run")
  cfg, params = _fake_workdir(workdir, config, key)
  done = export_lib.export(workdir, str(tmp_path / "hf"))
  assert (done.step, done.job, done.tokenizer_dir) == (3, job, None)
  assert sorted(os.listdir(done.out)) == ["config.json", "model.safetensors"]
  with open(os.path.join(done.out, "config.json")) as f:
    written = json.load(f)
  assert (written["eos_token_id"], written["pad_token_id"]) == (2, 0)
  loaded_cfg, _, loaded = hf.load(done.out)
  assert loaded_cfg == cfg.replace(attention="auto", scan_layers=True)
  _assert_same(loaded, params)


def test_cli_prints_what_it_wrote(tmp_path):
  workdir = str(tmp_path / "run")
  _fake_workdir(workdir, tiny_grpo.get_config("runlocal"))
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.export", f"--workdir={workdir}",
       f"--out={tmp_path / 'hf'}", "--step=3", "--dtype=bfloat16"],
      cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == [
      f"exported step 3 of {workdir} (grpo policy, bfloat16) to "
      f"{tmp_path / 'hf'}", export_lib.CHAR_TOKENIZER_NOTE]


@pytest.mark.parametrize("case", ["no_workdir", "rm_job"])
def test_cli_bad_input_is_one_line(case, tmp_path):
  workdir = str(tmp_path / "run")
  if case == "rm_job":
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(tiny_rm.get_config("runlocal").to_json_best_effort())
  out = subprocess.run(
      [sys.executable, "-m", "rlhf_jax.export", f"--workdir={workdir}",
       f"--out={tmp_path / 'hf'}"],
      cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
  assert {"no_workdir": "does not exist",
          "rm_job": "holds a 'rm' job"}[case] in lines[0]
  assert not os.path.exists(tmp_path / "hf")


def _config_only(path, config):
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write(config.to_json_best_effort())


@pytest.mark.parametrize("case, error, match", [
    ("no_workdir", MissingInputError, "does not exist"),
    ("no_config", MissingInputError, "has no config.json"),
    ("rm_job", CheckpointError, r"holds a 'rm' job.*\['grpo', 'ppo'\]"),
    ("no_checkpoint", MissingInputError, "no checkpoint in"),
    ("no_step", MissingInputError, r"no checkpoint of step 7.*steps: \[3\]"),
    ("out_not_empty", ConfigError, "is not empty"),
    ("other_shape", CheckpointError, "does not match the saved config"),
    ("model_path_gone", MissingInputError, "config.model.path="),
    ("bad_dtype", ConfigError, "--dtype='float16'"),
])
def test_errors(case, error, match, tmp_path):
  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  kw = {}
  config = tiny_grpo.get_config("runlocal")
  if case == "no_config":
    os.makedirs(workdir)
  elif case == "rm_job":
    _config_only(workdir, tiny_rm.get_config("runlocal"))
  elif case == "no_checkpoint":
    _config_only(workdir, config)
  elif case == "model_path_gone":
    config = gsm8k_grpo.get_config("runlocal")
    config.model.path = str(tmp_path / "gone")
    _config_only(workdir, config)
  elif case != "no_workdir":
    _fake_workdir(workdir, config)
  if case == "no_step":
    kw["step"] = 7
  elif case == "out_not_empty":
    os.makedirs(out)
    open(os.path.join(out, "x"), "w").close()
  elif case == "other_shape":  # The config says 3 layers, the checkpoint 2.
    config.model.overrides.num_layers = 3
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort())
  elif case == "bad_dtype":
    kw["dtype"] = "float16"
  with pytest.raises(error, match=match):
    export_lib.export(workdir, out, **kw)
