"""Entry point: `python -m rlhf_jax.main --config=configs/<name>.py[:args]`.

Intentionally short: flags, config, distributed init, then one `run` call.
Multi-host: start one process per host with the same command plus
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, or
`--distributed=on` where JAX detects the cluster (Cloud TPU VMs, SLURM, GKE);
see docs/running_at_scale.md and launch/.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from rlhf_jax import cli, compile_cache, distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (with optional :arg).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, metrics and plots go; a run in an "
    "existing workdir resumes from its last checkpoint.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", distributed.MODES,
    "Start jax.distributed: 'on' (auto-detects Cloud TPU/SLURM/GKE when the "
    "flags below are unset), 'off', or 'auto' (when the flags below or "
    "JAX_COORDINATOR_ADDRESS are set).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (multi-host).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes).")
_CACHE = flags.DEFINE_string(
    "compilation_cache", "auto", "JAX's persistent compilation cache: 'auto' "
    "(<workdir>/xla_cache on GPU/TPU, off on CPU), 'off', or a directory; "
    "a resumed job and the workers it starts load what was compiled before "
    "(rlhf_jax/compile_cache.py).")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Tracebacks for errors in the config, data or "
    "checkpoints, and other libraries' INFO logs (Orbax, JAX).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  cli.quiet_third_party(_VERBOSE.value)
  with cli.user_errors(_VERBOSE.value):
    # Before any JAX computation: the backend must see every host.
    distributed.initialize(_DISTRIBUTED.value, _COORDINATOR.value,
                           _NUM_PROCESSES.value, _PROCESS_ID.value)
  import jax  # pylint: disable=g-import-not-at-top

  from rlhf_jax import trainers  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  workdir = os.path.abspath(_WORKDIR.value or os.path.join(
      "workdirs", config.name))
  logging.info("process %d/%d, devices: %s", jax.process_index(),
               jax.process_count(), jax.devices())
  with cli.user_errors(_VERBOSE.value):
    cache = compile_cache.setup(_CACHE.value, workdir)
    trainers.run(config, workdir)
  if cache:
    logging.info(compile_cache.summary(cache))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
