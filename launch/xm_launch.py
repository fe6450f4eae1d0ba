r"""XManager launcher: the same `python -m rlhf_jax.main` command, as XM jobs.

`xmanager` (pip install xmanager) is optional: it is imported only to
launch; `--dry_run` prints the jobs without it.

Executors:
  local   this machine; `--num_processes=N` runs N CPU processes as one
          multi-host job (the commands of launch/local_multiprocess.py).
  vertex  one Vertex AI custom job: the repo packaged as a Python container
          (`--base_image`), `--accelerator=TYPE=COUNT` (xm.JobRequirements,
          e.g. a100=8, tpu_v3=8). One host; for TPU slices use
          launch/gcp_tpu_vm.py or GKE (docs/running_at_scale.md).

  xmanager launch launch/xm_launch.py -- --executor=local --num_processes=2 \
      -- --config=configs/tiny_grpo.py:runlocal --workdir=/tmp/xm_run
  python launch/xm_launch.py --executor=vertex --accelerator=a100=8 \
      --dry_run -- --config=configs/gsm8k_grpo.py --workdir=/mnt/shared/run1
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from absl import app, flags

if __package__ in (None, ""):  # `xmanager launch launch/xm_launch.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
from launch import local_multiprocess  # noqa: E402  pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXECUTORS = ("local", "vertex")

_EXECUTOR = flags.DEFINE_enum("executor", "local", EXECUTORS, "Where to run.")
_TITLE = flags.DEFINE_string("experiment_title", "rlhf_jax",
                             "XManager experiment title.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "local: processes of one multi-host job.")
_DEVICES = flags.DEFINE_integer(
    "devices_per_process", 4, "local, num_processes > 1: CPU devices each.")
_ACCELERATOR = flags.DEFINE_string(
    "accelerator", "", "vertex: TYPE=COUNT of xm.JobRequirements, e.g. a100=8")
_BASE_IMAGE = flags.DEFINE_string(
    "base_image", "python:3.11", "vertex: base image of the container.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "Print the jobs; needs no xmanager.")


@dataclasses.dataclass(frozen=True)
class JobPlan:
  """One XM job: where, with which environment, which command."""
  name: str
  executor: str
  command: list[str]
  env: dict
  requirements: dict

  def describe(self) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
    req = ",".join(f"{k}={v}" for k, v in self.requirements.items())
    return (f"[{self.executor}{' ' + req if req else ''}] {self.name}: "
            f"{env + ' ' if env else ''}{shlex.join(self.command)}")


def requirements(spec: str) -> dict:
  """"a100=8" -> {"a100": 8} (keyword arguments of xm.JobRequirements)."""
  if not spec:
    return {}
  kind, sep, count = spec.partition("=")
  if not sep or not count.isdigit() or not kind:
    raise ValueError(f"--accelerator={spec!r}: expected TYPE=COUNT, e.g. "
                     "a100=8 or tpu_v3=8")
  return {kind.lower(): int(count)}


def plan(executor: str, main_args: list[str], *, num_processes: int = 1,
         devices_per_process: int = 4, accelerator: str = "",
         port: int | None = None) -> list[JobPlan]:
  """The jobs of one experiment; the trainer command is the same as by hand."""
  if not any(a.startswith("--config") for a in main_args):
    raise ValueError("pass the trainer flags after --, e.g. "
                     "-- --config=configs/tiny_grpo.py:runlocal")
  if executor not in EXECUTORS:
    raise ValueError(f"--executor={executor!r}; known: {EXECUTORS}")
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if executor == "vertex":
    if num_processes != 1:
      raise ValueError("--executor=vertex runs one host; multi-host TPU "
                       "slices go through launch/gcp_tpu_vm.py or GKE")
    return [JobPlan("trainer", "vertex",
                    ["python", "-m", "rlhf_jax.main", *main_args], {},
                    requirements(accelerator))]
  if accelerator:
    raise ValueError("--accelerator is for --executor=vertex")
  if num_processes == 1:
    return [JobPlan("trainer", "local",
                    [sys.executable, "-m", "rlhf_jax.main", *main_args], {},
                    {})]
  port = port or local_multiprocess.free_port()
  cmds = local_multiprocess.commands(main_args, num_processes, port)
  env = {"JAX_NUM_CPU_DEVICES": str(devices_per_process),
         "JAX_PLATFORMS": "cpu"}
  return [JobPlan(f"process_{i}", "local", cmd, env, {})
          for i, cmd in enumerate(cmds)]


def _import_xmanager():
  try:
    from xmanager import xm, xm_local  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(
        "launch/xm_launch.py needs the optional `xmanager` package to launch "
        "(pip install xmanager); --dry_run works without it") from e
  return xm, xm_local


def launch(jobs: list[JobPlan], title: str, base_image: str) -> None:
  """Creates the XManager experiment and adds one job group."""
  xm, xm_local = _import_xmanager()
  with xm_local.create_experiment(experiment_title=title) as experiment:
    if jobs[0].executor == "vertex":
      spec = xm.PythonContainer(
          path=REPO, base_image=base_image,
          entrypoint=xm.ModuleName("rlhf_jax.main"))
      executor_spec, executor = xm_local.Vertex.Spec(), xm_local.Vertex(
          requirements=xm.JobRequirements(**jobs[0].requirements))
      args = lambda job: job.command[3:]  # After `python -m rlhf_jax.main`.
    else:
      spec = xm.Binary(path=sys.executable)
      executor_spec, executor = xm_local.Local.Spec(), xm_local.Local()
      args = lambda job: job.command[1:]  # After the interpreter.
    [executable] = experiment.package([xm.Packageable(
        executable_spec=spec, executor_spec=executor_spec)])
    experiment.add(xm.JobGroup(**{
        job.name: xm.Job(executable=executable, executor=executor,
                         args=args(job), env_vars=job.env)
        for job in jobs}))


def main(argv):
  main_args = list(argv[1:])
  try:
    jobs = plan(_EXECUTOR.value, main_args,
                num_processes=_NUM_PROCESSES.value,
                devices_per_process=_DEVICES.value,
                accelerator=_ACCELERATOR.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  for job in jobs:
    print(job.describe(), flush=True)
  if not _DRY_RUN.value:
    launch(jobs, _TITLE.value, _BASE_IMAGE.value)


if __name__ == "__main__":
  app.run(main)
