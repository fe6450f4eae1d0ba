"""Agent functions run in worker processes, not in the job's.

  workers = AgentWorkers("configs.tiny_agent_api:calc_agent", processes=2,
                         timeout_s=60)
  reward = workers(Endpoint(base_url, api_key), prompt, metadata)  # blocks
  workers.close()

A user's agent (`agent(client, prompt, metadata) -> reward`, as for
`agent.agent_fn`) is Python that parses, plans and calls tools: in the
job's process it shares the interpreter lock with the driver that feeds
the devices, and a crash in it (a segfault in a tool's extension, an
`os._exit`) would take the job down. Here each of `processes` workers
imports the agent's module and the `openai` client once, then runs every
episode handed to it in a thread of its own; the agent talks to the
endpoint exactly as in-process (its client's key names the episode).

Protocol: the job writes one JSON line per episode to a worker's stdin
({"id", "base_url", "api_key", "prompt", "metadata"}); the worker answers
on a pipe of its own ({"id", "reward"} or {"id", "error"}), so what the
agent prints goes to the job's stderr and cannot garble the answers.

Failures are the episode's, never the step's: an agent that raises fails
its episode; one that has not returned within `timeout_s` of its start
fails it, as a program past its timeout does (its thread runs on until
its requests are refused: a thread cannot be killed); a worker that dies
fails the episodes it ran, and the next episode starts a new worker. Workers are children of the job and die with
it (the parent-death signal, `agent_env._BOOT`, set by a thread that lives
as long as they do) or when their stdin closes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import threading
from typing import Mapping

from rlhf_jax.envs import agent_env


class _Worker:
  """One worker process and the episodes it is running."""

  def __init__(self, agent_fn: str):
    read_fd, write_fd = os.pipe()
    env = dict(os.environ,
               # The job's import path, so `agent_fn`'s module resolves as
               # it did in the job (`configs.…` from the working directory).
               PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    self.proc = subprocess.Popen(
        [sys.executable, "-c", agent_env._BOOT, str(os.getpid()),  # pylint: disable=protected-access
         sys.executable, "-m", "rlhf_jax.envs.agent_worker", agent_fn,
         str(write_fd)],
        env=env, stdin=subprocess.PIPE, stdout=sys.stderr.fileno(),
        pass_fds=(write_fd,), text=True, start_new_session=True)
    os.close(write_fd)
    self._answers = os.fdopen(read_fd, "r")
    self.pending: dict[int, concurrent.futures.Future] = {}
    self.lock = threading.Lock()
    self.alive = True
    threading.Thread(target=self._read, daemon=True,
                     name=f"agent-worker-{self.proc.pid}").start()

  def submit(self, episode: int, request: dict) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    with self.lock:
      if not self.alive:
        raise RuntimeError("agent worker exited")
      self.pending[episode] = future
      try:
        self.proc.stdin.write(json.dumps(dict(request, id=episode)) + "\n")
        self.proc.stdin.flush()
      except (BrokenPipeError, ValueError, OSError):
        self.pending.pop(episode)
        self.alive = False
        raise RuntimeError("agent worker exited") from None
    return future

  def _read(self) -> None:
    for line in self._answers:
      try:
        answer = json.loads(line)
        episode = answer["id"]
      except (ValueError, TypeError, KeyError):  # Not the worker's protocol.
        self.proc.kill()
        break
      with self.lock:
        future = self.pending.pop(episode, None)
      if future is not None:
        future.set_result(answer)
    code = self.proc.wait()
    with self.lock:
      self.alive = False
      orphans, self.pending = list(self.pending.values()), {}
    for future in orphans:
      future.set_exception(RuntimeError(f"agent worker exited ({code})"))

  def close(self) -> None:
    with self.lock:
      self.alive = False
      try:
        self.proc.stdin.close()  # The worker's loop ends; it exits.
      except OSError:
        pass
    try:
      self.proc.wait(5)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


class AgentWorkers:
  """`agent_fn`'s episodes on `processes` worker processes (module doc).
  A callable like `agent_env.ExecutableAgent`: (endpoint, prompt,
  metadata) -> reward, for `AgentEnv(client_factory=Endpoint)`."""

  def __init__(self, agent_fn: str, *, processes: int, timeout_s: float):
    if processes < 1:
      raise ValueError(f"processes={processes}: at least 1")
    self.agent_fn, self.timeout_s = agent_fn, timeout_s
    self._workers: list[_Worker | None] = [None] * processes
    self._ids = itertools.count()
    self._lock = threading.Lock()
    # Workers are started from this one thread, alive as long as they are:
    # the parent-death signal fires when the *thread* that started a
    # process ends (an episode's would, with its episode).
    self._starter = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="agent-worker-starter")

  def _worker(self) -> _Worker:
    """The live worker with the fewest episodes; dead ones are replaced."""
    with self._lock:
      for i, w in enumerate(self._workers):
        if w is None or not w.alive:
          self._workers[i] = self._starter.submit(_Worker,
                                                  self.agent_fn).result()
      return min(self._workers, key=lambda w: len(w.pending))

  def __call__(self, endpoint: agent_env.Endpoint, prompt: str,
               metadata: Mapping) -> float:
    worker, episode = self._worker(), next(self._ids)
    future = worker.submit(episode, dict(
        base_url=endpoint.base_url, api_key=endpoint.api_key, prompt=prompt,
        metadata=json.loads(json.dumps(dict(metadata), default=str))))
    try:
      answer = future.result(self.timeout_s)
    except concurrent.futures.TimeoutError:
      with worker.lock:  # Its late answer, if any, is dropped.
        worker.pending.pop(episode, None)
      raise TimeoutError(f"the agent made no answer in {self.timeout_s:g} s"
                         ) from None
    if "error" in answer:
      raise RuntimeError(answer["error"])
    return answer["reward"]

  def close(self) -> None:
    with self._lock:
      workers, self._workers = self._workers, [None] * len(self._workers)
    for w in workers:
      if w is not None:
        w.close()
    self._starter.shutdown()
