"""Entry point: `python -m rlhf_jax.main --config=configs/<name>.py[:args]`.

Intentionally short: flags, config, distributed init, then one `run` call.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (with optional :arg).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, metrics and plots go; a run in an "
    "existing workdir resumes from its last checkpoint.")
flags.mark_flags_as_required(["config"])


class _QuietOrbax(logging.logging.Filter):
  """Orbax logs every save step at INFO; keep its warnings only."""

  def filter(self, record):
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(_QuietOrbax())
  import jax  # After flags, so XLA/JAX env set by launchers takes effect.

  from rlhf_jax import trainers

  config = _CONFIG.value
  workdir = os.path.abspath(_WORKDIR.value or os.path.join(
      "workdirs", config.name))
  logging.info("process %d/%d, devices: %s", jax.process_index(),
               jax.process_count(), jax.devices())
  trainers.run(config, workdir)


if __name__ == "__main__":
  app.run(main)
