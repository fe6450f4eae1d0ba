"""Multi-host runs and launchers: 2 processes x 4 CPU devices match 1 x 8.

The parity and failure tests start real `rlhf_jax.main` processes through
launch/local_multiprocess.py; the GCP and XManager launchers are checked in
dry-run mode (their exact commands).
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import tiny_grpo
from launch import gcp_tpu_vm, local_multiprocess, xm_launch
from rlhf_jax import distributed
from rlhf_jax.trainers import rl_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runlocal, trimmed: 2 RL steps, a small eval set (eval at steps 0 and 2).
# The warm-start's rate is the one this comparison was written with: at the
# default job's 1e-3 (e5c005d) the two runs' step-2 train/approx_kl differed
# by 30% (5.0e-4 vs 7.1e-4), more than reduction order explains; not yet
# understood (a sampled token that flips between the two runs is the
# suspect), and open in docs/results.md's default-job section.
OVERRIDES = {"train.steps": 2, "sft.steps": 4, "sft.log_every": 2,
             "sft.learning_rate": 3e-3,
             "eval.every": 2, "task.num_eval": 16, "eval.batch_size": 16,
             "eval.num_rows": 8}
MAIN_ARGS = ["--config=configs/tiny_grpo.py:runlocal"] + [
    f"--config.{k}={v}" for k, v in OVERRIDES.items()]


def _launcher(args, **kwargs):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-m", "launch.local_multiprocess", *args], cwd=REPO,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      **kwargs)


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  keys = [(r["phase"], r["step"]) for r in records]
  assert len(keys) == len(set(keys)), f"duplicate records (2 writers?): {keys}"
  return {(r.pop("phase"), r.pop("step")): r for r in records}


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  multi = str(tmp_path / "multi")
  proc = _launcher(["--num_processes=2", "--devices_per_process=4",
                    f"--log_dir={tmp_path / 'logs'}", "--",
                    *MAIN_ARGS, f"--workdir={multi}"])
  # Meanwhile (they wait on each other's collectives), the reference run:
  # 1 process x 8 devices (conftest), the same config.
  single = str(tmp_path / "single")
  c = tiny_grpo.get_config("runlocal")
  for key, value in OVERRIDES.items():
    section, name = key.split(".")
    c[section][name] = value
  rl_job.run(c, single)
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, (out, err)
  with open(tmp_path / "logs" / "process_1.log") as f:
    assert "process 1/2" in f.read()

  a, b = _records(multi), _records(single)
  assert sorted(a) == sorted(b)
  assert ("rl", 2) in a and ("sft", 4) in a
  for key, record in b.items():
    assert sorted(a[key]) == sorted(record), key
    for name, value in record.items():
      if name.startswith("perf/"):
        continue
      # fp32: cross-process (gloo) and in-process reductions differ in order.
      assert abs(a[key][name] - value) <= 1e-5 * abs(value) + 1e-6, (
          key, name, a[key][name], value)
  assert a[("rl", 2)]["train/grad_norm"] > 1e-3  # Not vacuous.
  # The data iterator state of each process is in the checkpoint.
  with open(os.path.join(multi, "checkpoints", "2", "meta", "metadata")) as f:
    meta = json.load(f)
  assert len(meta["iterators"]) == 2
  assert meta["iterators"][1]["next_index"] == 16  # 2 steps x 8 prompts.


def test_launcher_fails_clearly_when_a_process_dies(tmp_path):
  logs = tmp_path / "logs"
  proc = _launcher(["--num_processes=2", "--devices_per_process=4",
                    f"--log_dir={logs}", "--grace_s=1", "--", *MAIN_ARGS,
                    f"--workdir={tmp_path / 'wd'}"])
  pids = [int(proc.stdout.readline().split()[3].rstrip(","))
          for _ in range(2)]
  deadline = time.time() + 300
  # Kill process 1 once both have joined the distributed runtime.
  while "process 1/2" not in (logs / "process_1.log").read_text():
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.2)
  os.kill(pids[1], signal.SIGKILL)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 1
  assert (f"process 1 (pid {pids[1]}) was killed by signal SIGKILL; "
          "stopped the ") in err, err
  assert str(logs / "process_1.log") in err
  with pytest.raises(ProcessLookupError):  # Process 0 is gone too.
    os.kill(pids[0], 0)


def test_local_dry_run_commands(capsys):
  assert local_multiprocess.main(["--num_processes=3", "--port=1234",
                                  "--devices_per_process=2", "--dry_run",
                                  "--", *MAIN_ARGS]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3
  for i, line in enumerate(lines):
    words = shlex.split(line)
    # The coordinator on loopback only: its address and where it binds.
    assert words[:3] == ["JAX_NUM_CPU_DEVICES=2", "JAX_PLATFORMS=cpu",
                         "JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:1234"]
    assert words[4:6] == ["-m", "rlhf_jax.main"]
    assert words[6:6 + len(MAIN_ARGS)] == MAIN_ARGS
    assert words[-6:] == ["--coordinator_address=127.0.0.1:1234",
                          "--num_processes=3", f"--process_id={i}", ">",
                          f"workdirs/launch_logs/process_{i}.log", "2>&1"]
  env = local_multiprocess.process_env(
      {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_x=1"}, 2,
      1234)
  assert env["XLA_FLAGS"] == "--xla_x=1" and env["JAX_NUM_CPU_DEVICES"] == "2"
  assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
  with pytest.raises(SystemExit):
    local_multiprocess.parse(["--dry_run"])  # No trainer flags.


def test_gcp_dry_run_commands(capsys):
  args = ["--name=rl", "--zone=us-east5-b", "--project=proj",
          "--accelerator_type=v5litepod-16", "--version=v2-alpha-tpuv5-lite",
          "--actions=delete,run,create,copy,logs", "--dry_run", "--",
          "--config=configs/gsm8k_grpo.py", "--workdir=/mnt/gcs/run 1"]
  assert gcp_tpu_vm.main(args) == 0
  cmds = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
  scope = ["--zone=us-east5-b", "--project=proj"]
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  assert cmds[0] == [*tpu, "create", "rl", *scope,
                     "--accelerator-type=v5litepod-16",
                     "--version=v2-alpha-tpuv5-lite"]
  assert cmds[1][:2] == ["tar", "czf"] and cmds[1][-3:] == [
      "-C", gcp_tpu_vm.REPO, "."]
  assert cmds[2] == [*tpu, "scp", cmds[1][2], f"rl:{cmds[1][2]}", *scope,
                     "--worker=all"]
  assert cmds[3][:-1] == [*tpu, "ssh", "rl", *scope, "--worker=all"]
  # The lock with the TPU extra: the pinned jax and its libtpu.
  assert cmds[3][-1].endswith(
      "pip install -q -r requirements.txt -e '.[tpu]'")
  run = cmds[4]
  assert run[:-1] == [*tpu, "ssh", "rl", *scope, "--worker=all"]
  remote = run[-1].removeprefix("--command=")
  assert remote.startswith("cd rlhf_jax && nohup ")
  trainer = shlex.split(remote.split(" && nohup ")[1].split(" > ")[0])
  assert trainer == ["python3", "-m", "rlhf_jax.main",
                     "--config=configs/gsm8k_grpo.py",
                     "--workdir=/mnt/gcs/run 1", "--distributed=on"]
  assert cmds[5] == [*tpu, "ssh", "rl", *scope, "--worker=0",
                     "--command=tail -n +1 -F rlhf_jax/run.log"]
  assert cmds[6] == [*tpu, "delete", "rl", *scope, "--quiet"]
  assert len(cmds) == 7


@pytest.mark.parametrize("args,message", [
    (["--accelerator_type=tpu7x-64"], "GKE"),
    (["--actions=create,explode"], "unknown"),
    (["--actions=run"], "trainer flags"),
])
def test_gcp_bad_input(args, message, capsys):
  with pytest.raises(SystemExit):
    gcp_tpu_vm.parse(["--name=rl", "--zone=z", *args])
  assert message in capsys.readouterr().err


def test_xmanager_dry_run_commands():
  out = subprocess.run(
      [sys.executable, "launch/xm_launch.py", "--executor=local",
       "--num_processes=2", "--dry_run", "--", *MAIN_ARGS],
      cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
  lines = out.stdout.splitlines()
  assert len(lines) == 2
  port = None
  for i, line in enumerate(lines):
    head, command = line.split(": ", 1)
    assert head == f"[local] process_{i}"
    words = shlex.split(command)
    assert words[:2] == ["JAX_NUM_CPU_DEVICES=4", "JAX_PLATFORMS=cpu"]
    assert words[2:] == local_multiprocess.commands(
        MAIN_ARGS, 2, int(words[-3].rsplit(":", 1)[1]))[i]
    port = port or words[-3]
    assert words[-3] == port  # One coordinator for both processes.

  jobs = xm_launch.plan("vertex", MAIN_ARGS, accelerator="tpu_v3=8")
  assert [j.describe() for j in jobs] == [
      "[vertex tpu_v3=8] trainer: python -m rlhf_jax.main "
      + shlex.join(MAIN_ARGS)]
  for kwargs, message in [
      (dict(executor="vertex", main_args=MAIN_ARGS, accelerator="a100"),
       "TYPE=COUNT"),
      (dict(executor="vertex", main_args=MAIN_ARGS, num_processes=2),
       "one host"),
      (dict(executor="local", main_args=["--workdir=x"]), "--config")]:
    with pytest.raises(ValueError, match=message):
      xm_launch.plan(**kwargs)


def test_xmanager_missing_is_a_clear_error():
  try:
    import xmanager  # noqa: F401  pylint: disable=unused-import
    pytest.skip("xmanager is installed")
  except ImportError:
    pass
  out = subprocess.run(
      [sys.executable, "launch/xm_launch.py", "--", *MAIN_ARGS], cwd=REPO,
      capture_output=True, text=True, timeout=60)
  assert out.returncode != 0
  assert "needs the optional `xmanager` package" in out.stderr


def test_distributed_flags():
  assert not distributed.wanted("auto", None, None, None)
  assert distributed.wanted("auto", "h:1", None, None)
  assert distributed.wanted("auto", None, 2, None)
  assert distributed.wanted("on", None, None, None)
  assert not distributed.wanted("off", "h:1", 2, 0)
  with pytest.raises(ValueError, match="--distributed"):
    distributed.wanted("yes", None, None, None)
  with pytest.raises(ValueError, match="--process_id=2"):
    distributed.initialize("auto", "127.0.0.1:1", 2, 2)
  assert not distributed.initialize("off")


def test_a_coordinator_on_this_host_binds_loopback(monkeypatch):
  # JAX binds [::]:PORT by default; a coordinator every process reaches at
  # a loopback address binds that address (launch/xm_launch.py's local
  # executor goes through here), one on another host keeps the default.
  monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  bind = distributed.loopback_bind_address
  assert bind("127.0.0.1:8476") == "127.0.0.1:8476"
  assert bind("localhost:8476") == "localhost:8476"
  assert bind("[::1]:8476") == "[::1]:8476"
  assert bind("host-0:8476") is None
  assert bind(None) is None
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.5:9")
  assert bind(None) == "127.0.0.5:9"
  monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "127.0.0.1:9")
  assert bind("127.0.0.1:9") is None  # The user's own choice stands.


def test_iterator_state_per_process():
  class It:
    state = None

    def get_state(self):
      return {"next_index": 8}

    def set_state(self, state):
      self.state = state

  it = It()
  meta = distributed.iterator_meta(it)
  assert meta == {"iterator": {"next_index": 8},
                  "iterators": [{"next_index": 8}]}
  distributed.restore_iterator(it, {"iterator": {"next_index": 3}})  # Old.
  assert it.state == {"next_index": 3}
  distributed.restore_iterator(it, {"iterators": [{"next_index": 5}] * 2})
  assert it.state == {"next_index": 5}  # Same global batch on each process.
  with pytest.raises(ValueError, match="original process count"):
    distributed.restore_iterator(
        it, {"iterators": [{"next_index": 5}, {"next_index": 6}]})


def test_put_global_and_to_host(mesh8):
  from jax.sharding import NamedSharding, PartitionSpec
  sharding = NamedSharding(mesh8, PartitionSpec(("data", "fsdp")))
  host = np.arange(16, dtype=np.float32)
  x = distributed.put_global(host, sharding)
  assert x.sharding == sharding
  np.testing.assert_array_equal(distributed.to_host(x), host)
  assert distributed.put_global(x, sharding) is x
  assert jax.process_count() == 1
