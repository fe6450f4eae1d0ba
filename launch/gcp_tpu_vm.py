r"""Runs the trainer on a Cloud TPU VM slice with `gcloud` (v4, v5e, v5p, v6e).

Actions (any subset, in this order): create, copy, run, logs, delete.
  create  gcloud compute tpus tpu-vm create (or --spot)
  copy    tar the repo (no .git, workdirs), scp it to every worker, unpack,
          pip install the lock with the TPU extra (`-r requirements.txt -e
          .[tpu]`: the pinned jax and its libtpu), then `--setup`, on every
          worker
  run     start `python -m rlhf_jax.main <flags> --distributed=on` on every
          worker (--worker=all) in the background; JAX finds the other hosts
          itself (Cloud TPU auto-detection), logs go to <remote_dir>/run.log
  logs    stream that log from one worker (--log_worker, default 0)
  delete  delete the TPU VM

  python -m launch.gcp_tpu_vm --name=rl --zone=us-east5-b \
      --accelerator_type=v5litepod-16 --version=v2-alpha-tpuv5-lite \
      --actions=create,copy,run,logs -- \
      --config=configs/gsm8k_grpo.py --workdir=/mnt/gcs/rl/run1
  ... --dry_run   # prints exactly these gcloud commands, runs nothing

The workdir must be one directory every host sees (a gcsfuse-mounted
bucket, Filestore/NFS): all hosts write checkpoint shards there.

TPU7x (Ironwood) and later are not served by the Cloud TPU API (`tpu-vm`
commands); run those on GKE (xpk) or as Compute Engine managed instance
groups, with the same trainer command on every host (docs/running_at_scale.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

ACTIONS = ("create", "copy", "run", "logs", "delete")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TPU generations the Cloud TPU API (tpu-vm) does not create.
_NOT_TPU_VM = ("tpu7", "ironwood")


def _scope(a) -> list[str]:
  out = [f"--zone={a.zone}"]
  if a.project:
    out.append(f"--project={a.project}")
  return out


def _ssh(a, command: str, worker: str = "all") -> list[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", a.name, *_scope(a),
          f"--worker={worker}", f"--command={command}"]


def trainer_command(a) -> str:
  """The shell line every worker runs (the same on each host)."""
  main = shlex.join([a.python, "-m", "rlhf_jax.main", *a.main_args,
                     "--distributed=on"])
  # run.log sits in remote_dir, where the `logs` action reads it.
  return f"cd {a.remote_dir} && nohup {main} > run.log 2>&1 < /dev/null &"


def commands(a) -> list[list[str]]:
  """Every command of the requested actions, in order."""
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  archive = f"/tmp/{a.name}_rlhf_jax.tgz"
  out = []
  for action in a.actions:
    if action == "create":
      out.append([*tpu, "create", a.name, *_scope(a),
                  f"--accelerator-type={a.accelerator_type}",
                  f"--version={a.version}", *(["--spot"] if a.spot else [])])
    elif action == "copy":
      out.append(["tar", "czf", archive, "--exclude=.git",
                  "--exclude=workdirs", "--exclude=__pycache__", "-C",
                  a.repo, "."])
      out.append([*tpu, "scp", archive, f"{a.name}:{archive}", *_scope(a),
                  "--worker=all"])
      setup = (f"mkdir -p {a.remote_dir} && tar xzf {archive} -C "
               f"{a.remote_dir} && cd {a.remote_dir} && {a.python} -m pip "
               "install -q -r requirements.txt -e '.[tpu]'")
      if a.setup:
        setup += f" && {a.setup}"
      out.append(_ssh(a, setup))
    elif action == "run":
      out.append(_ssh(a, trainer_command(a)))
    elif action == "logs":
      out.append(_ssh(a, f"tail -n +1 -F {a.remote_dir}/run.log",
                      worker=str(a.log_worker)))
    elif action == "delete":
      out.append([*tpu, "delete", a.name, *_scope(a), "--quiet"])
  return out


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--name", required=True, help="TPU VM name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--accelerator_type", default="v5litepod-16")
  p.add_argument("--version", default="v2-alpha-tpuv5-lite",
                 help="TPU software version (runtime image)")
  p.add_argument("--spot", action="store_true")
  p.add_argument("--actions", default="create,copy,run,logs",
                 help=f"comma-separated subset of {','.join(ACTIONS)}")
  p.add_argument("--repo", default=REPO, help="local checkout to copy")
  p.add_argument("--remote_dir", default="rlhf_jax",
                 help="directory on each worker (relative to $HOME)")
  p.add_argument("--python", default="python3")
  p.add_argument("--setup", default=None,
                 help="shell run on every worker after the install "
                 "(default: none)")
  p.add_argument("--log_worker", type=int, default=0)
  p.add_argument("--dry_run", action="store_true",
                 help="print the commands, run nothing")
  p.add_argument("main_args", nargs=argparse.REMAINDER,
                 help="-- then the rlhf_jax.main flags")
  a = p.parse_args(argv)
  if a.main_args[:1] == ["--"]:
    a.main_args = a.main_args[1:]
  a.actions = [x for x in a.actions.split(",") if x]
  unknown = sorted(set(a.actions) - set(ACTIONS))
  if unknown or not a.actions:
    p.error(f"--actions: unknown {unknown}; choose from {ACTIONS}")
  a.actions = [x for x in ACTIONS if x in a.actions]
  if a.accelerator_type.lower().startswith(_NOT_TPU_VM):
    p.error(f"--accelerator_type={a.accelerator_type}: TPU7x and later are "
            "not available through the Cloud TPU API (tpu-vm); use GKE (xpk) "
            "or Compute Engine managed instance groups, see "
            "docs/running_at_scale.md")
  if "run" in a.actions and not any(
      x.startswith("--config") for x in a.main_args):
    p.error("the run action needs the trainer flags after --, e.g. "
            "-- --config=configs/gsm8k_grpo.py --workdir=/mnt/gcs/run1")
  return a


def main(argv: list[str] | None = None) -> int:
  a = parse(sys.argv[1:] if argv is None else argv)
  for cmd in commands(a):
    print(shlex.join(cmd), flush=True)
    if a.dry_run:
      continue
    code = subprocess.call(cmd)
    if code:
      print(f"launch: command failed with exit code {code}: "
            f"{shlex.join(cmd)}", file=sys.stderr)
      return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
