"""An agent the user wrote against the OpenAI API as a multi-turn
environment: its requests to the job's endpoint (`serving/openai_server.py`)
are the episode's turns.

  server = AgentServer(renderer, fmt, tools, sampling)   # 127.0.0.1
  episodes = Episodes(lambda: AgentEnv(server, agent), tokenizer, fmt, ...)
  driver = MultiTurnDriver(engine, params, reply=episodes)   # as for tools

`agent(client, prompt, metadata) -> reward` runs in a thread of its own per
episode with an `openai.OpenAI` client whose key names the episode. The
driver samples the model's first turn at once; when a turn ends (a stop
token) `AgentEnv.hand` hands its text to the agent's waiting request and
the sample parks (`engine/multiturn.PARK`: its slot and KV kept, the other
samples decoding on) until `poll` has the agent's next move:

- another request, whose rendered messages extend the conversation: the
  new text (a tool's reply, the next user message) is appended, already in
  the chat format (`Step.rendered`), and decoding goes on;
- the agent returns: the episode ends with its reward (`env_reward`, the
  "env" reward function): the one it posted to the endpoint's
  `/v1/rlhf_jax/reward` if it did (the last), else its return value;
- the agent raises, or makes no move within `timeout_s`: the episode ends
  as failed, reward 0 (`tool_error` counts it).

So the tokens, masks and log-probs are those of the in-process path
(`envs/tools.ToolEnv`) for the same conversation. A request whose history
does not extend the episode's (an edited earlier turn) is refused; the
agent sees an HTTP error. `step` (hand, then wait) is the same move for a
caller that waits.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from absl import logging

from rlhf_jax.envs.environment import Step
from rlhf_jax.errors import ConfigError

# (client, prompt text, metadata) -> reward.
Agent = Callable[[Any, str, Mapping], float]


class HistoryError(ValueError):
  """A request whose messages do not extend the episode's conversation."""


class SessionClosed(RuntimeError):
  """A request for an episode that has ended."""


class NoReward(RuntimeError):
  """An agent program that printed no reward (it may have posted one)."""


class AgentSession:
  """One episode's rendezvous between the driver's thread (model turns)
  and the server's (the agent's requests). `text` is the conversation the
  agent has seen: the prompt, the turns handed to it, the messages it
  added; a request must extend it."""

  def __init__(self, episode_id: str, prompt: str, *, timeout_s: float,
               started: bool = True):
    self.id, self.text, self.timeout_s = episode_id, prompt, timeout_s
    # False while the agent waits for its turn to run (a concurrency
    # limit): no move is due from it yet.
    self._started = started
    self.requests = 0
    self.closed = False
    self._cv = threading.Condition()
    # (text, finish reason, [(token text, log-prob[, alternatives])] or
    # None; alternatives: [(text, log-prob)], `Episodes`' top_logprobs)
    self._turn: tuple[str, str, list | None] | None = None
    self._new: str | None = None               # Rendered, not yet appended.
    self._reward: float | None = None          # The agent returned.
    self._failure: str | None = None           # The agent raised.
    self.posted: float | None = None           # POST /v1/rlhf_jax/reward.
    self._delivered = False                    # The reward reached `poll`.
    self._deadline = 0.0                       # Of the agent's next move.
    self._wake: threading.Event | None = None  # Set at each move.

  # ---------------------------------------------- the server's thread
  def exchange(self, rendered: str) -> tuple[str, str, list | None]:
    """The agent's whole conversation `rendered` by the chat template ->
    the model's next turn (text, finish reason: "stop", or "length" when
    the episode ended without one; its tokens as (text, log-prob[,
    alternatives]), None when there are none)."""
    with self._cv:
      if self.closed:
        raise SessionClosed(f"episode {self.id} has ended")
      if not rendered.startswith(self.text):
        raise HistoryError(
            f"episode {self.id}: the messages do not extend the "
            "conversation so far (an earlier turn was changed); start a "
            "new episode instead")
      new = rendered[len(self.text):]
      if self.requests == 0 and new:
        raise HistoryError(f"episode {self.id}: the first request must be "
                           "the prompt's messages alone")
      if self.requests > 0 and not new:
        raise HistoryError(f"episode {self.id}: the request adds no message "
                           "after the model's turn")
      self.requests += 1
      if new:
        self._new, self.text = new, rendered
        self._cv.notify_all()
        if self._wake is not None:
          self._wake.set()
      if not self._cv.wait_for(lambda: self._turn is not None or self.closed,
                               timeout=self.timeout_s):
        raise TimeoutError(f"episode {self.id}: no model turn within "
                           f"{self.timeout_s:g} s")
      if self._turn is None:  # Ended (the token budget) before a turn.
        return "", "length", None
      turn, self._turn = self._turn, None
      self.text += turn[0]  # What the agent has now seen.
      return turn

  def post_reward(self, reward: float) -> None:
    """The agent's reward sent to the endpoint: it wins over the value the
    agent returns (the last one posted counts). Refused once the episode
    or its agent has ended."""
    with self._cv:
      if (self.closed or self._reward is not None
          or self._failure is not None):
        raise SessionClosed(f"episode {self.id} has ended")
      self.posted = float(reward)

  # ---------------------------------------------- the agent's thread
  def finish(self, reward: float | None = None,
             failure: str | None = None, *,
             unless_posted: bool = False) -> None:
    """The agent ended: with its return value (a posted reward wins; None
    counts 0), or failed (`failure` says why; with `unless_posted`, only
    if it posted no reward)."""
    with self._cv:
      if failure is not None and not (unless_posted
                                      and self.posted is not None):
        self._failure = failure
      elif self.posted is not None:
        self._reward = self.posted
      else:
        self._reward = 0.0 if reward is None else float(reward)
      self._cv.notify_all()
      if self._wake is not None:
        self._wake.set()

  # ---------------------------------------------- the driver's thread
  def hand(self, action: str, logprobs: list | None = None,
           wake: threading.Event | None = None) -> None:
    """Hands the model's turn (and its tokens' (text, log-prob)) to the
    agent; `poll` gives its next move, and `wake` is set when it makes
    one."""
    with self._cv:
      self._turn = (action, "stop", logprobs)  # `text` takes it when delivered.
      self._wake = wake
      self._deadline = time.monotonic() + self.timeout_s
      self._cv.notify_all()

  def _moved(self) -> bool:
    return (self._new is not None or self._reward is not None
            or self._failure is not None)

  def poll(self) -> Step | None:
    """The agent's move after the turn handed, as a Step: the new
    messages, its reward, or a failure (it raised, or made no move within
    `timeout_s`); None while it thinks."""
    with self._cv:
      if self._new is not None:
        new, self._new = self._new, None
        return Step(new, tool_call=True, rendered=True)
      if self._reward is not None:
        self._delivered = True
        return Step(None, reward=self._reward, done=True)
      if self._failure is None and (not self._started
                                    or time.monotonic() < self._deadline):
        return None
      self._delivered = True  # A failed episode's reward is 0.
      why = self._failure or f"no move in {self.timeout_s:g} s"
    logging.warning("agent episode %s failed: %s", self.id, why)
    return Step(None, reward=0.0, done=True, tool_error=True)

  def turn(self, action: str, logprobs: list | None = None) -> Step:
    """`hand`, then waits (up to `timeout_s`) for the agent's move."""
    self.hand(action, logprobs)
    with self._cv:
      if not self._cv.wait_for(self._moved, timeout=self.timeout_s):
        self._deadline = 0.0  # Timed out, to the clock's last tick.
    return self.poll()

  def begin(self) -> None:
    """The agent starts running (it waited under a concurrency limit):
    its move is due within `timeout_s` from now."""
    with self._cv:
      self._started = True
      self._deadline = time.monotonic() + self.timeout_s

  def unclaimed(self) -> float:
    """The posted reward if no move of the agent's ending the episode
    carried it to the driver (`turn`), else 0."""
    with self._cv:
      return self.posted if (self.posted is not None
                             and not self._delivered) else 0.0

  def close(self) -> None:
    """Ends the episode: a waiting request gets finish reason "length",
    later ones are refused."""
    with self._cv:
      self.closed = True
      self._cv.notify_all()


_EPISODE_IDS = itertools.count()


class AgentEnv:
  """The environment of one episode driven by `agent` through `server`
  (module doc). `client_factory(base_url, api_key)` makes the agent's
  client (default: `openai.OpenAI`, no retries)."""

  def __init__(self, server, agent: Agent, *, timeout_s: float = 60.0,
               client_factory: Callable[[str, str], Any] | None = None,
               limit: threading.Semaphore | None = None):
    self.server, self.agent, self.timeout_s = server, agent, timeout_s
    self.limit = limit  # Shared by the episodes: agents running at once.
    self.client_factory = client_factory or _openai_client
    self.session: AgentSession | None = None
    self.thread: threading.Thread | None = None

  def reset(self, prompt: str, metadata: Mapping) -> None:
    self.session = AgentSession(f"e{next(_EPISODE_IDS)}", prompt,
                                timeout_s=self.timeout_s,
                                started=self.limit is None)
    client = self.client_factory(self.server.url,
                                 self.server.open(self.session))
    self.thread = threading.Thread(
        target=self._run, args=(client, prompt, dict(metadata)),
        name=f"agent-{self.session.id}", daemon=True)
    self.thread.start()

  def _run(self, client, prompt, metadata) -> None:
    if self.limit is None:
      self._play(client, prompt, metadata)
      return
    with self.limit:  # Its sample stays parked meanwhile.
      if not self.session.closed:
        self.session.begin()
        self._play(client, prompt, metadata)

  def _play(self, client, prompt, metadata) -> None:
    try:
      reward = self.agent(client, prompt, metadata)
    except NoReward as e:  # Fine if it posted one.
      self.session.finish(failure=f"{e} and posted none", unless_posted=True)
    except Exception as e:  # pylint: disable=broad-except
      self.session.finish(failure=f"{type(e).__name__}: {e}")
    else:
      self.session.finish(reward)

  takes_logprobs = True  # `Episodes` hands each turn's tokens' log-probs.

  def step(self, action: str, logprobs: list | None = None) -> Step:
    """The agent's move after `action`, waiting for it (`Env`'s call)."""
    return self._ended(self.session.turn(action, logprobs))

  # Without waiting: `Episodes` parks the sample until `poll` answers.
  def hand(self, action: str, logprobs: list | None = None,
           wake: threading.Event | None = None) -> None:
    self.session.hand(action, logprobs, wake)

  def poll(self) -> Step | None:
    step = self.session.poll()
    return None if step is None else self._ended(step)

  def _ended(self, step: Step) -> Step:
    if step.done:
      self.close()
    return step

  def unclaimed_reward(self) -> float:
    """A reward the agent posted in an episode that ended without the
    agent's last move (the token or turn budget cut it); else 0."""
    return self.session.unclaimed() if self.session is not None else 0.0

  def close(self) -> None:
    """Ends the episode without waiting for the agent (the driver's thread
    calls it): the agent's later requests are refused, so it ends on its
    own; its thread is a daemon."""
    if self.session is not None:
      self.server.close(self.session)


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """What an executable agent gets instead of a client."""
  base_url: str
  api_key: str


class ExecutableAgent:
  """An agent that is a program: `command` (an argv list) runs once per
  episode with the endpoint in its environment, the variables the
  `openai` client reads (OPENAI_BASE_URL, OPENAI_API_KEY: the episode's
  key) and RLHF_JAX_PROMPT, RLHF_JAX_METADATA (JSON), RLHF_JAX_EPISODE.
  Its reward is the last line of its standard output, a number, or the
  one it posted to the endpoint (`POST /v1/rlhf_jax/reward`, which wins);
  a program that exits non-zero, ends with neither or outlives
  `timeout_s` fails its episode. It dies with the job (Linux: the parent-death signal) and is
  killed when its episode times out."""

  def __init__(self, command: Sequence[str], *, timeout_s: float):
    self.command, self.timeout_s = list(command), timeout_s

  def __call__(self, endpoint: Endpoint, prompt: str,
               metadata: Mapping) -> float:
    env = dict(os.environ, OPENAI_BASE_URL=endpoint.base_url,
               OPENAI_API_KEY=endpoint.api_key, RLHF_JAX_PROMPT=prompt,
               RLHF_JAX_METADATA=json.dumps(dict(metadata), default=str),
               RLHF_JAX_EPISODE=endpoint.api_key.rpartition(".")[2])
    # A session of its own (its whole group is killed at the timeout),
    # started through `_BOOT` (no preexec_fn: this process has threads).
    proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(os.getpid()),
                             *self.command],
                            env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
      out, err = proc.communicate(timeout=self.timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      raise TimeoutError(f"{self.command[0]} ran past {self.timeout_s:g} s"
                         ) from None
    if proc.returncode:
      tail = (err.strip().splitlines() or [""])[-1]
      raise RuntimeError(f"{self.command[0]} exited {proc.returncode}: "
                         f"{tail}")
    lines = out.strip().splitlines()
    try:
      return float(lines[-1])
    except (IndexError, ValueError):
      raise NoReward(f"{self.command[0]} printed no reward (its last line "
                     "must be a number)") from None


# Sets the parent-death signal (Linux prctl PR_SET_PDEATHSIG = 1: SIGKILL
# when the job's thread that started it ends, so with the job), then
# becomes the agent program. A job that died before the signal was set
# (its pid is argv[1]; the orphan's parent is another process by then)
# ends the program here.
_BOOT = ("import ctypes, os, signal, sys\n"
         "try:\n"
         "  ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)\n"
         "except OSError:\n"
         "  pass\n"
         "if os.getppid() != int(sys.argv[1]):\n"
         "  os._exit(1)\n"
         "os.execvp(sys.argv[2], sys.argv[2:])\n")


def load_agent(path: str) -> Agent:
  """The agent function `path` names ("module:function")."""
  module, _, name = path.partition(":")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"config.agent.agent_fn={path!r}: cannot load it "
                      f"({type(e).__name__}: {e})") from None
  if not callable(fn):
    raise ConfigError(f"config.agent.agent_fn={path!r} is not a function")
  return fn


_SHARED_HTTP = None
_SHARED_HTTP_LOCK = threading.Lock()


def _openai_client(base_url: str, api_key: str):
  """An `openai.OpenAI` client for one episode (its key), on the process's
  one connection pool: a client with a pool of its own costs ~20 ms of
  CPU (its TLS context), ~10 s for 512 episodes; the shared one, kept
  alive, also spares a TCP handshake a request. Closing a client (`with
  client:`) leaves the pool open for the other episodes."""
  import httpx  # pylint: disable=g-import-not-at-top
  import openai  # pylint: disable=g-import-not-at-top
  global _SHARED_HTTP  # pylint: disable=global-statement
  with _SHARED_HTTP_LOCK:
    if _SHARED_HTTP is None:

      class _Shared(openai.DefaultHttpxClient):
        def close(self):  # Shared: the process's exit closes it.
          pass

      # trust_env=False: no proxy from the environment between the agent
      # and the endpoint on loopback. No connection cap: every live
      # episode may hold a request open (the model's turn).
      _SHARED_HTTP = _Shared(trust_env=False, limits=httpx.Limits(
          max_connections=None, max_keepalive_connections=1024))
  return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                       http_client=_SHARED_HTTP)
