r"""Converts a llama.cpp GGUF file into a Hugging Face checkpoint directory.

python -m rlhf_jax.convert_gguf --gguf=FILE --out=DIR

Llama architecture, byte-level BPE vocabulary, F32/F16/BF16/Q8_0/Q4_0/Q4_1
tensors (`models/from_gguf.py` says what is written and why); needs `pip
install 'rlhf_jax[gguf]'`. Anything it does not cover is one line.
"""

import os

from absl import app, flags

from rlhf_jax import cli
from rlhf_jax.errors import UserError
from rlhf_jax.models import from_gguf

_GGUF = flags.DEFINE_string("gguf", None, "The .gguf file.")
_OUT = flags.DEFINE_string("out", None, "The HF directory to write.")


def main(argv):
  del argv
  if not _GGUF.value or not _OUT.value:
    cli.fail("--gguf and --out are both required")
  try:
    cfg = from_gguf.convert(_GGUF.value, os.path.abspath(_OUT.value))
  except UserError as e:
    cli.fail(str(e))
  print(f"wrote {_OUT.value}: {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}")


if __name__ == "__main__":
  app.run(main)
