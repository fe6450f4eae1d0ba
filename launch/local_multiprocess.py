r"""Runs N trainer processes on this machine as one multi-host JAX job.

Each process gets `--devices_per_process` CPU devices (JAX_NUM_CPU_DEVICES),
the same `python -m rlhf_jax.main ...` command plus its coordinator flags,
and a log file `<log_dir>/process_<i>.log`. If one process fails, the others
are stopped and the launcher exits non-zero naming the process and its log.

  python -m launch.local_multiprocess --num_processes=2 \
      --devices_per_process=4 --log_dir=/tmp/logs -- \
      --config=configs/tiny_grpo.py:runlocal --workdir=workdirs/mp
  ... --dry_run   # prints the commands, starts nothing
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

_FAILED = 1
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


# The processes share this machine: the coordinator is on loopback only.
LOOPBACK = "127.0.0.1"


def free_port() -> int:
  """A TCP port that was free a moment ago (bound by process 0 next)."""
  with socket.socket() as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


def process_env(base: dict, devices: int, port: int | None = None) -> dict:
  """`base` with `devices` CPU devices and no inherited device-count flag;
  with `port`, process 0's coordinator binds to loopback only (JAX's
  default is every interface, [::]:port)."""
  env = dict(base, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
  if port is not None:
    env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{LOOPBACK}:{port}"
  xla = _DEVICE_COUNT_FLAG.sub("", base.get("XLA_FLAGS", "")).strip()
  if xla:
    env["XLA_FLAGS"] = xla
  else:
    env.pop("XLA_FLAGS", None)
  return env


def commands(main_args: list[str], num_processes: int, port: int,
             python: str = sys.executable) -> list[list[str]]:
  """The trainer command of each process."""
  return [[python, "-m", "rlhf_jax.main", *main_args,
           f"--coordinator_address={LOOPBACK}:{port}",
           f"--num_processes={num_processes}", f"--process_id={i}"]
          for i in range(num_processes)]


def _describe(code: int) -> str:
  if code < 0:
    return f"was killed by signal {signal.Signals(-code).name}"
  return f"exited with code {code}"


def _tail(path: str, lines: int = 20) -> str:
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-lines:])


def _stop(procs, grace_s: float) -> None:
  """SIGTERM (the trainer checkpoints), then SIGKILL whatever still runs."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.time() + grace_s
  for p in procs:
    try:
      p.wait(max(deadline - time.time(), 0.01))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def run(cmds: list[list[str]], envs: list[dict], log_dir: str, *,
        grace_s: float = 5.0, poll_s: float = 0.2) -> int:
  """Starts every command, waits; returns 0 if all succeed, else 1."""
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = [], []
  for i, (cmd, env) in enumerate(zip(cmds, envs)):
    logs.append(os.path.join(log_dir, f"process_{i}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                    stderr=subprocess.STDOUT))
    print(f"process {i}: pid {procs[-1].pid}, log {logs[-1]}", flush=True)
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        others = [p for p in procs if p.poll() is None]
        _stop(others, grace_s)
        # Every process found failed in this poll is named (one dying can
        # make its peers fail within the same poll interval).
        for i in failed:
          print(f"launch: process {i} (pid {procs[i].pid}) "
                f"{_describe(codes[i])}; stopped the {len(others)} other "
                f"running process(es). Log: {logs[i]}\n--- last lines of "
                f"{logs[i]} ---\n{_tail(logs[i])}", file=sys.stderr,
                flush=True)
        return _FAILED
      if all(c == 0 for c in codes):
        print(f"launch: all {len(procs)} processes finished; logs in "
              f"{log_dir}", flush=True)
        return 0
      time.sleep(poll_s)
  except KeyboardInterrupt:
    print("launch: interrupted; stopping every process (they checkpoint "
          "on SIGTERM)", file=sys.stderr, flush=True)
    _stop(procs, grace_s=60.0)
    return _FAILED


def parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4)
  parser.add_argument("--port", type=int, default=0,
                      help="coordinator port (0 = pick a free one)")
  parser.add_argument("--log_dir", default="workdirs/launch_logs")
  parser.add_argument("--grace_s", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL on failure")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the commands and exit")
  parser.add_argument("main_args", nargs=argparse.REMAINDER,
                      help="-- then the rlhf_jax.main flags")
  args = parser.parse_args(argv)
  if args.main_args[:1] == ["--"]:
    args.main_args = args.main_args[1:]
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  if not any(a.startswith("--config") for a in args.main_args):
    parser.error("pass the trainer flags after --, e.g. "
                 "-- --config=configs/tiny_grpo.py:runlocal")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  port = args.port or free_port()
  cmds = commands(args.main_args, args.num_processes, port)
  envs = [process_env(dict(os.environ), args.devices_per_process, port)
          for _ in cmds]
  if args.dry_run:
    for i, cmd in enumerate(cmds):
      log = os.path.join(args.log_dir, f"process_{i}.log")
      print(f"JAX_NUM_CPU_DEVICES={args.devices_per_process} "
            f"JAX_PLATFORMS=cpu JAX_COORDINATOR_BIND_ADDRESS={LOOPBACK}:{port} "
            f"{shlex.join(cmd)} > {shlex.quote(log)} 2>&1")
    return 0
  return run(cmds, envs, args.log_dir, grace_s=args.grace_s)


if __name__ == "__main__":
  sys.exit(main())
