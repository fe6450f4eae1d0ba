r"""Exports the trained policy of a GRPO / PPO workdir as an HF checkpoint.

python -m rlhf_jax.export --workdir=workdirs/gsm8k_grpo --out=/ckpt/gsm8k_rl \
    [--step=N] [--dtype=bfloat16|float32]

Reads the job's `config.json` and, from the latest (or `--step`)
checkpoint, only the policy's params (an Orbax partial restore onto the
host CPU): no mesh, engine, optimizer or reference is built. The model
config comes from the `config.json` of `config.model.path` (the HF
checkpoint the run started from; its tokenizer, chat template and
generation config are copied too) or, for a random-init job, from the
preset and overrides with the built-in character tokenizer's vocabulary;
that tokenizer has no HF form, so only weights and config.json are written.
A LoRA policy (`config.lora.rank > 0`) is written merged, W + (alpha/r) A B
(`models/lora.py`), or with `--adapters` as `OUT/base` (the frozen base, an
HF checkpoint) and `OUT/adapter` (the adapters in the PEFT format,
`models/hf_adapters.py`; `config.lora.init_from` starts a run from them).
The output opens with transformers' `from_pretrained` (and vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags

from rlhf_jax import cli
from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import CheckpointError, ConfigError, MissingInputError
from rlhf_jax.models import hf, hf_adapters, hf_config, lora
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig

# Where each job keeps its policy in the checkpoint's dict of states.
POLICY_KEYS = {"grpo": "policy", "ppo": "actor"}
# config.json keys of the source checkpoint that `ModelConfig` does not
# track, carried into the export.
_CARRIED = ("max_position_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
CHAR_TOKENIZER_NOTE = (
    "note: this job used the built-in character tokenizer "
    "(rlhf_jax/data/tokenizer.py), which has no Hugging Face form: only "
    "weights and config.json were written, so feed token ids, not text")


@dataclasses.dataclass(frozen=True)
class Exported:
  """What `export` wrote."""
  out: str
  step: int
  job: str
  dtype: str
  tokenizer_dir: str | None   # None: the character tokenizer (not written).


@dataclasses.dataclass(frozen=True)
class _Source:
  """The policy's model config, tokenizer and carried config.json keys."""
  cfg: ModelConfig
  tokenizer_dir: str | None
  carried: dict


def read_config(workdir: str) -> dict:
  """The job's saved config.json (a plain dict)."""
  if not os.path.isdir(workdir):
    raise MissingInputError(f"workdir {workdir!r} does not exist")
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise MissingInputError(
        f"{workdir!r} has no config.json: not the workdir of a "
        "`python -m rlhf_jax.main` run")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def model_source(saved: dict) -> _Source:
  """The policy's ModelConfig as the job built it
  (`models/checkpoint_or_preset.py`)."""
  try:
    m = typed_config.from_saved(sections.Model, saved["model"], "model")
  except sections.ConfigError as e:
    raise ConfigError(f"the saved config.json: {e}") from None
  if m.path:
    if not os.path.exists(os.path.join(m.path, "config.json")):
      raise MissingInputError(
          f"config.model.path={m.path!r} (the HF checkpoint the run started "
          "from) has no config.json any more: export needs its model config "
          "and tokenizer; restore that directory")
    source = hf_config.read_json(os.path.join(m.path, "config.json"))
    cfg = hf_config.from_hf(source, dtype=m.param_dtype,
                            compute_dtype=m.compute_dtype)
    carried = {k: source[k] for k in _CARRIED if k in source}
    return _Source(cfg, m.path, carried)
  kind = saved["data"]["kind"]
  if kind != "addition":  # `data/sources.py`: only it has no HF tokenizer.
    raise ConfigError(f"config.model.path is empty and config.data.kind="
                      f"{kind!r}: cannot tell the policy's vocabulary")
  tok = CharTokenizer()
  cfg = m.model_config(vocab_size=tok.vocab_size)
  return _Source(cfg, None, {"bos_token_id": tok.bos_id,
                             "eos_token_id": tok.eos_id,
                             "pad_token_id": tok.pad_id})


def _names(path) -> tuple:
  """A key path as names: a Param's `.value` and a dict's ['value'] agree."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(
      k, "idx", k)))) for k in path)


def _manager(directory: str) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory, item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                "meta": ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=False))


def _check_shapes(saved_tree, abstract, where: str) -> None:
  """The checkpoint's params have the model config's names and shapes."""
  saved = {_names(p): (tuple(v.shape), np.dtype(v.dtype)) for p, v in
           jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  want = {_names(p): (tuple(v.shape), np.dtype(v.dtype)) for p, v in
          jax.tree_util.tree_flatten_with_path(abstract)[0]}
  bad = [n for n in sorted(set(saved) | set(want))
         if saved.get(n) != want.get(n)]
  if bad:
    raise CheckpointError(
        f"{where} does not match the saved config's model: "
        f"{'/'.join(bad[0])} is {saved.get(bad[0])} (shape, dtype) in the "
        f"checkpoint, {want.get(bad[0])} in the config")


def restore_params(directory: str, key: str, cfg: ModelConfig,
                   step: int | None = None):
  """(step, params) of `state[key].params` on the host CPU device.

  Args:
    directory: the workdir's `checkpoints/` (an Orbax CheckpointManager).
    key: the policy's entry in the dict of states ("policy", "actor").
    cfg: the policy's ModelConfig (names, shapes, dtypes).
    step: a checkpointed step; None is the latest.

  Returns:
    (step, params) as an nnx.State, which `hf.save` writes.
  """
  if not os.path.isdir(directory):
    raise MissingInputError(f"no checkpoint in {directory!r} yet")
  manager = _manager(directory)
  try:
    return _restore(manager, directory, key, cfg, step)
  finally:
    manager.close()


def _restore(manager, directory: str, key: str, cfg: ModelConfig,
             step: int | None):
  """`restore_params` with an open manager."""
  steps = sorted(manager.all_steps())
  if not steps:
    raise MissingInputError(f"no checkpoint in {directory!r} yet")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise MissingInputError(f"no checkpoint of step {step} in "
                            f"{directory!r}; its steps: {steps}")
  where = f"checkpoint {directory}/{step}"
  tree = manager.item_metadata(step)["state"].tree
  if key not in tree or "params" not in tree[key]:
    raise CheckpointError(f"{where} has no {key!r} params; its states: "
                          f"{sorted(tree)}")
  _, abstract = model_lib.abstract_params(cfg)
  _check_shapes(tree[key]["params"], abstract, where)
  # Straight into host memory (the CPU device), whatever the saved mesh.
  cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  item = {key: {"params": abstract}}
  args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(
      sharding=cpu, dtype=x.dtype, global_shape=x.shape), item)
  try:
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                     partial_restore=True)))
  except (ValueError, KeyError, FileNotFoundError) as e:
    raise CheckpointError(f"cannot read the policy from {where}: {e}") from e
  return step, out.state[key]["params"]


def export(workdir: str, out: str, *, step: int | None = None,
           dtype: str | None = None, adapters: bool = False) -> Exported:
  """Writes the policy of `workdir`'s checkpoint as an HF checkpoint.

  Args:
    workdir: a GRPO or PPO workdir (config.json, checkpoints/).
    out: a new or empty output directory.
    step: the checkpointed step; None is the latest.
    dtype: "bfloat16" or "float32"; None keeps the checkpoint's dtype.
    adapters: a LoRA policy as `out/base` + `out/adapter` (PEFT), not
      merged.

  Returns:
    What was written (`Exported`).

  Raises:
    MissingInputError: no workdir, config.json, checkpoint or step.
    CheckpointError: not a policy job (e.g. "rm"), or a checkpoint that does
      not match its config.
    ConfigError: a bad `dtype` or `out`, or a model with no HF form.
  """
  workdir, out = os.path.abspath(workdir), os.path.abspath(out)
  if dtype not in (None, "bfloat16", "float32"):
    raise ConfigError(f"--dtype={dtype!r}: use bfloat16 or float32")
  saved = read_config(workdir)
  job = saved.get("job")  # A file on disk, not a locked config.
  if job not in POLICY_KEYS:
    raise CheckpointError(
        f"{workdir!r} holds a {job!r} job, which has no policy to export; "
        f"export works for {sorted(POLICY_KEYS)} workdirs")
  if os.path.isdir(out) and os.listdir(out):
    raise ConfigError(f"--out={out!r} is not empty; export into a new or "
                      "empty directory")
  source = model_source(saved)
  try:
    hf_config.family(source.cfg)
  except ValueError as e:
    raise ConfigError(f"config.model has no Hugging Face form: {e}") from None
  try:
    spec = typed_config.from_saved(sections.Lora, saved.get("lora", {}),
                               "lora").spec()
  except sections.ConfigError as e:
    raise ConfigError(f"the saved config.json: {e}") from None
  step, params = restore_params(
      os.path.join(workdir, "checkpoints"), POLICY_KEYS[job],
      source.cfg.replace(lora=spec), step)
  dtype = dtype or source.cfg.param_dtype
  if adapters:
    if spec is None:
      raise ConfigError(f"--adapters: {workdir!r} trained every weight "
                        "(config.lora.rank=0); export it without --adapters")
    hf_adapters.save(os.path.join(out, "adapter"),
                     source.cfg.replace(lora=spec), params,
                     base_model=os.path.join(out, "base"))
    out_model, params = os.path.join(out, "base"), lora.split(params)[1]
  else:
    out_model = out
    if spec is not None:
      params = lora.merged(params, spec)
  hf.save(out_model, source.cfg, params, tokenizer_dir=source.tokenizer_dir,
          dtype=dtype, config_overrides=source.carried)
  return Exported(out, step, job, dtype, source.tokenizer_dir)


def main(argv) -> None:
  """The CLI: bad input is one `error: ...` line and exit status 2."""
  del argv
  f = flags.FLAGS
  cli.quiet_third_party(f.verbose)
  # Everything runs on the host: leave a training job's accelerators alone.
  jax.config.update("jax_platforms", "cpu")
  with cli.user_errors(f.verbose):
    done = export(f.workdir, f.out, step=f.step, dtype=f.dtype,
                  adapters=f.adapters)
  print(f"exported step {done.step} of {f.workdir} ({done.job} policy, "
        f"{done.dtype}) to {done.out}")
  if done.tokenizer_dir is None:
    print(CHAR_TOKENIZER_NOTE)
  sys.stdout.flush()


def _define_flags() -> None:
  """Flags of the CLI only (importing this module defines none)."""
  flags.DEFINE_string("workdir", None, "The workdir of a GRPO or PPO run.")
  flags.DEFINE_string("out", None, "New or empty output directory.")
  flags.DEFINE_integer("step", None, "Checkpointed step (default: latest).")
  flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"],
                    "Weight dtype to write (default: the checkpoint's).")
  flags.DEFINE_bool("adapters", False, "A LoRA policy as base/ + adapter/ "
                    "(PEFT) instead of merged.")
  flags.DEFINE_bool("verbose", False, "Tracebacks and third-party logs.")
  flags.mark_flags_as_required(["workdir", "out"])


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=cli.parse_flags)
