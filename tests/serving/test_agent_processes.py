"""Agents outside the job's process (envs/agent_env.ExecutableAgent,
envs/agent_workers.py): a program per episode and agent worker processes
give the in-process path's episodes; a program past its timeout is killed;
a worker's agent that raises, hangs or exits fails its episode only; both
die with a SIGKILLed job; a job killed mid-step and run again equals the
uninterrupted run and leaves no agent program running."""

import os
import signal
import subprocess
import sys
import time

import pytest

import resume
from endpoint_cases import (FMT, ROOT, SAMPLED, TOOLS, rollout, same_logp,
                            through_endpoint)
from rlhf_jax.envs.agent_env import Endpoint, ExecutableAgent
from rlhf_jax.envs.agent_workers import AgentWorkers
from rlhf_jax.envs.tools import ToolEnv


def test_an_agent_program_gives_the_in_process_episodes(tiny_model, mesh8,
                                                       monkeypatch):
  """The calculator agent as a program per episode (what `agent.agent_cmd`
  runs: `python -m configs.tiny_agent_api`, the endpoint and prompt in its
  environment, its reward its last output line): the in-process path's
  samples."""
  monkeypatch.setenv("PYTHONPATH", ROOT)
  want, _, _ = rollout(tiny_model, mesh8, SAMPLED,
                       lambda: ToolEnv(TOOLS, FMT), prompts=1, g=2)
  program = ExecutableAgent([sys.executable, "-m", "configs.tiny_agent_api"],
                            timeout_s=60)
  got, _, _, server, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, program, client_factory=Endpoint,
      prompts=1, g=2)
  assert {k: (s.tokens, s.env_mask) for k, s in got.items()} == {
      k: (s.tokens, s.env_mask) for k, s in want.items()}
  assert all(same_logp(s.logp_raw, want[k].logp_raw)
             for k, s in got.items())
  assert server.refused == 0


def test_agent_workers_give_the_in_process_episodes(tiny_model, mesh8):
  """The calculator agent function in 2 worker processes
  (`agent.agent_workers`): the in-process path's samples (16 episodes,
  sampled, some calling the tool)."""
  want, want_metrics, _ = rollout(tiny_model, mesh8, SAMPLED,
                                  lambda: ToolEnv(TOOLS, FMT), prompts=4)
  workers = AgentWorkers("configs.tiny_agent_api:calc_agent", processes=2,
                         timeout_s=60)
  try:
    got, metrics, _, server, _ = through_endpoint(
        tiny_model, mesh8, SAMPLED, workers, client_factory=Endpoint,
        prompts=4)
  finally:
    workers.close()
  assert got.keys() == want.keys() and len(got) == 16
  for k, s in got.items():
    w = want[k]
    assert (s.tokens, s.env_mask, s.env_reward) == (
        w.tokens, w.env_mask, w.env_reward), k
    assert same_logp(s.logp_raw, w.logp_raw), k
  assert metrics["rollout/tool_calls_per_episode"] == want_metrics[
      "rollout/tool_calls_per_episode"] > 0
  assert metrics["rollout/tool_errors"] == 0 and server.refused == 0


def test_agent_workers_fail_an_episode_not_the_job(monkeypatch):
  """The worker processes run the agent away from the job: an agent that
  raises, prints to stdout, never answers or ends its worker fails its
  episode only, and a new worker runs the next one."""
  monkeypatch.syspath_prepend(os.path.dirname(__file__))
  workers = AgentWorkers("worker_agents:by_prompt", processes=1,
                         timeout_s=3)
  endpoint = Endpoint("http://127.0.0.1:9/v1", "key.e0")  # Never called.
  try:
    first = workers(endpoint, "pid", {})
    assert first != os.getpid()  # Another process.
    assert workers(endpoint, "print", {}) == 5.0  # Its prints: not answers.
    with pytest.raises(RuntimeError, match="asked to raise"):
      workers(endpoint, "raise", {})
    assert workers(endpoint, "pid", {}) == first  # The same worker.
    with pytest.raises(RuntimeError, match="agent worker exited"):
      workers(endpoint, "exit", {})
    second = workers(endpoint, "pid", {})
    assert second not in (first, os.getpid())  # A new worker.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
      workers(endpoint, "sleep", {})
    assert 3 <= time.monotonic() - t0 < 10
    assert workers(endpoint, "12.5", {}) == 12.5  # It still serves.
  finally:
    workers.close()
  assert not _alive(int(second))


def test_an_agent_program_past_its_timeout_is_killed(tiny_model, mesh8,
                                                    tmp_path):
  """A program that never answers is killed at its timeout; its episode
  fails (reward 0, a tool error) and the rollout ends."""
  pid_file = tmp_path / "pid"
  program = ExecutableAgent([sys.executable, "-c", (
      "import os, time; open(%r, 'a').write(f'{os.getpid()}\\n'); "
      "time.sleep(600)") % str(pid_file)], timeout_s=1.5)
  got, metrics, _, _, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, program, timeout_s=30,
      client_factory=Endpoint, prompts=1, g=2)
  pids = [int(p) for p in pid_file.read_text().split()]
  assert pids and metrics["rollout/tool_errors"] == len(pids)
  assert all(s.env_reward == 0.0 for s in got.values())
  for pid in pids:  # Killed and reaped.
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


# ------------------------------------------------------ kill and resume
# A job running one episode's agent from a thread, as the rollout does;
# the agent writes its pid to $PID_FILE and sleeps 10 minutes.
_SLEEPING_PROGRAM = """
import sys, threading
from rlhf_jax.envs.agent_env import Endpoint, ExecutableAgent
sleeper = ("import os, time; open(os.environ['PID_FILE'], 'w')"
           ".write(str(os.getpid())); time.sleep(600)")
agent = ExecutableAgent([sys.executable, "-c", sleeper], timeout_s=600)
threading.Thread(target=agent, args=(
    Endpoint("http://127.0.0.1:9/v1", "key.e0"), "prompt", {})).start()
"""
_SLEEPING_WORKER = """
import os, threading
from rlhf_jax.envs.agent_env import Endpoint
from rlhf_jax.envs.agent_workers import AgentWorkers
agent = AgentWorkers("worker_agents:by_prompt", processes=1, timeout_s=600)
threading.Thread(target=agent, args=(
    Endpoint("http://127.0.0.1:9/v1", "key.e0"), "sleep",
    {"pid_file": os.environ["PID_FILE"]})).start()
"""


@pytest.mark.parametrize("job_code", [_SLEEPING_PROGRAM, _SLEEPING_WORKER],
                         ids=["program", "worker"])
def test_an_agent_program_dies_with_the_job(tmp_path, job_code):
  """A job SIGKILLed while an agent program (or an agent worker process)
  runs takes it along (the parent-death signal both are started with),
  even one that would sleep for 10 minutes."""
  pid_file = tmp_path / "pid"
  job = subprocess.Popen(
      [sys.executable, "-c", job_code], cwd=ROOT,
      env=dict(os.environ, PID_FILE=str(pid_file), PYTHONPATH=os.pathsep.join(
          [ROOT, os.path.dirname(__file__)])))
  try:
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()):
      assert job.poll() is None and time.time() < deadline
      time.sleep(0.01)
    program = int(pid_file.read_text())
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.time() + 5
    while _alive(program):
      assert time.time() < deadline, "the agent program outlived the job"
      time.sleep(0.01)
  finally:
    job.kill()
    job.wait()
    if pid_file.exists() and pid_file.read_text() and _alive(
        int(pid_file.read_text())):
      os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie waiting to be reaped does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except OSError:
    return False


def _agent_programs(mark: str) -> list[int]:
  """Pids of the live agent programs of the jobs whose environment holds
  `mark` (they inherit it, and get RLHF_JAX_EPISODE besides)."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    except OSError:  # Gone, or not ours to read.
      continue
    if (_alive(int(pid)) and mark.encode() in env
        and any(v.startswith(b"RLHF_JAX_EPISODE=") for v in env)):
      pids.append(int(pid))
  return pids


@pytest.mark.slow
def test_sigkill_mid_step_then_rerun_equals_uninterrupted(tmp_path):
  """`configs/tiny_agent_api.py:runlocal,program` (an agent program per
  episode) SIGKILLed while step 2's agents run, after the step-1
  checkpoint: no agent program outlives the job (the parent-death signal),
  and the rerun runs step 2's agents again (agent episodes are not
  replayed from a log: the agent holds the conversation) and writes the
  uninterrupted run's records."""
  mark = f"RLHF_JAX_TEST_RUN={tmp_path}"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             RLHF_JAX_TEST_RUN=str(tmp_path))

  def cmd(workdir):
    return [sys.executable, "-m", "rlhf_jax.main",
            "--config=configs/tiny_agent_api.py:runlocal,program",
            f"--workdir={workdir}", "--config.train.steps=2",
            "--config.train.checkpoint_every=1",
            # 8 episodes a step (an agent program each), one update.
            "--config.train.prompts_per_step=4",
            "--config.rollout.samples_per_row=2",
            "--config.rl.num_minibatches=1",
            # Held-out accuracy on 4 prompts, after the warm-start and at
            # the end.
            "--config.task.num_eval=4", "--config.eval.batch_size=4",
            "--config.eval.num_rows=8", "--config.eval.every=100"]

  reference = str(tmp_path / "reference")
  out = subprocess.run(cmd(reference), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(cmd(workdir), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    # Killed once a third agent program of step 2 runs: the first ones
    # have likely answered (a replayed answer would show in the records).
    deadline, seen = time.time() + 300, set()
    while proc.poll() is None and len(seen) < 3:
      assert time.time() < deadline, "step 2's agents never started"
      if (resume.has_record(workdir, "rl", 1)
          and os.path.isdir(os.path.join(workdir, "checkpoints", "1"))):
        seen.update(_agent_programs(mark))
      time.sleep(0.01)
    assert proc.poll() is None, "the job ended before it could be killed"
    assert not resume.has_record(workdir, "rl", 2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # Within a second: an orphaned program would live on until its request
  # failed (importing `openai` alone takes about that long).
  deadline = time.time() + 1
  while _agent_programs(mark):
    assert time.time() < deadline, (
        f"agent programs outlived the job: {_agent_programs(mark)}")
    time.sleep(0.05)
  out = subprocess.run(cmd(workdir), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from step 1" in out.stderr
  assert not _agent_programs(mark)
  want, got = resume.records(reference), resume.records(workdir)
  assert sorted(got) == sorted(want)
  assert "eval/accuracy" in want["rl", 2], want["rl", 2]
  for key in want:
    assert got[key] == pytest.approx(want[key], rel=1e-6), key
  assert not os.path.exists(os.path.join(workdir, "episodes"))
