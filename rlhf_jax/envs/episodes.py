"""One rollout's episodes, as the reply of `engine/multiturn.MultiTurnDriver`.

  episodes = Episodes(make_env, tokenizer, fmt, max_turns=4)
  episodes.begin(step)                 # before a rollout
  driver = MultiTurnDriver(engine, params, reply=episodes)
  for sample in driver.run(requests):
    episodes.finish(sample)            # env_reward, turn metrics

Each sample is an episode with its own environment, made at its first
stop token. A model turn is the text sampled since the last observation;
the environment's observation is rendered by the chat format and
tokenized, and the driver appends those tokens (their KV after the
sample's own, nothing prefilled again). An episode ends when the
environment says done, or after `max_turns` model turns (the turn
budget; the token budget is the driver's, replies included). An agent
(`agent_env.AgentEnv`) answers later: its sample parks (the driver's
`PARK`) and `ready` hands its answer over once it has moved; the other
samples decode meanwhile.

Replay: with a `ReplayLog` every environment answer is written (and
flushed) as it happens, keyed by (step, prompt id, sample index, turn).
A step run again after a crash (resume from the last checkpoint) reads
the answers back instead of calling the environment: tool outputs with
timeouts or outside state are not deterministic, the recorded ones are.
Environments that keep state across turns get no `step` call for a
replayed turn, so replay suits stateless tools (every `ToolEnv`);
`replayable=False` (an agent behind the endpoint, whose own program keeps
the conversation) runs the environments again instead.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import threading
from typing import Callable

import numpy as np

from rlhf_jax.engine.multiturn import PARK
from rlhf_jax.engine.state import split_top
from rlhf_jax.envs.environment import Env, Step
from rlhf_jax.errors import DataError


@dataclasses.dataclass
class _Episode:
  env: Env
  start: int = 0       # Index of the current turn's first token.
  turns: int = 0       # Model turns answered so far.
  calls: int = 0
  errors: int = 0
  reward: float = 0.0
  cut: bool = False    # Ended by the turn budget.


class ReplayLog:
  """Environment answers of the steps since the last checkpoint, on disk
  (`<directory>/step_<k>.p<process>.jsonl`, one line per answer)."""

  def __init__(self, directory: str, *, keep_steps: int, process: int = 0):
    self.directory, self.keep, self.process = directory, keep_steps, process
    self._file = None
    self.recorded: dict[tuple[int, int, int], Step] = {}
    os.makedirs(directory, exist_ok=True)

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, f"step_{step}.p{self.process}.jsonl")

  def begin(self, step: int) -> None:
    """Loads what an earlier run of `step` recorded; drops old steps."""
    self.close()
    for path in glob.glob(os.path.join(self.directory, "step_*.jsonl")):
      m = re.fullmatch(r"step_(\d+)\.p\d+\.jsonl", os.path.basename(path))
      if m and int(m[1]) < step - self.keep:
        os.remove(path)
    self.recorded = {}
    path = self._path(step)
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            r = json.loads(line)
          except ValueError:  # The line a crash cut short.
            continue
          self.recorded[r["p"], r["s"], r["t"]] = Step(
              r["o"], r["r"], r["d"], r["c"], r["e"], r.get("g", False))
    self._file = open(path, "a")

  def put(self, key: tuple[int, int, int], step: Step) -> None:
    p, s, t = key
    self._file.write(json.dumps(dict(
        p=p, s=s, t=t, o=step.observation, r=step.reward, d=step.done,
        c=step.tool_call, e=step.tool_error, g=step.rendered)) + "\n")
    self._file.flush()  # A kill keeps every answer written so far.

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


class Episodes:
  """The environments of one rollout's samples; see the module doc."""

  def __init__(self, make_env: Callable[[], Env], tokenizer, fmt, *,
               max_turns: int, log: ReplayLog | None = None,
               replayable: bool = True):
    self.make_env, self.tokenizer, self.fmt = make_env, tokenizer, fmt
    self.max_turns, self.log, self.replayable = max_turns, log, replayable
    self.metadata: dict[int, dict] = {}
    self.begin(None)

  @property
  def _replay(self) -> ReplayLog | None:
    """The log answers are written to and replayed from: none when the
    environments are not `replayable`, whatever `log` is."""
    return self.log if self.replayable else None

  def stop_ids(self) -> tuple[int, ...]:
    """The tokens that end a turn besides the tokenizer's own stops."""
    return self.fmt.stop_ids(self.tokenizer)

  def begin(self, step: int | None, prompts=None) -> None:
    """Starts a rollout (`step`: where the replay log keys it; `prompts`:
    a PromptBatch whose metadata the environments get)."""
    self._live: dict[tuple[int, int], _Episode] = {}
    # Handed a turn, their answer not read yet: (episode, tokens so far).
    self._parked: dict[tuple[int, int], tuple[_Episode, int]] = {}
    self._wake = threading.Event()  # Set when a parked one's env moves.
    self._done: list[_Episode] = []
    self.replayed = 0
    self.metadata = ({int(p): m for p, m in zip(prompts.prompt_ids,
                                                prompts.metadata)}
                     if prompts is not None else {})
    if self._replay is not None and step is not None:
      self._replay.begin(step)

  def __call__(self, request, sample_idx: int, tokens: list,
               logp: list | None = None, top: list | None = None):
    """The driver's reply: tokens to append, None (the sample ends), or
    `PARK` for an environment that answers later (`hand`, then `poll`:
    an agent; `ready` has its answer). An environment with
    `takes_logprobs` also gets the turn's tokens, each as (its text, its
    log-prob), and with `top` (the engine's `top_logprobs`) a third item:
    the likeliest tokens where it was drawn, [(text, log-prob)]."""
    key = request.prompt_id, sample_idx
    ep = self._live.get(key)
    if ep is None:
      ep = self._live[key] = _Episode(self.make_env())
      ep.env.reset(self._decode(request.tokens),
                   self.metadata.get(request.prompt_id, {}))
    result = (self._replay.recorded.get((*key, ep.turns))
              if self._replay else None)
    if result is not None:
      self.replayed += 1
      return self._answer(key, ep, result, len(tokens), record=False)
    turn, logprobs = self._decode(tokens[ep.start:]), None
    if getattr(ep.env, "takes_logprobs", False) and logp is not None:
      logprobs = [(self._decode([t]), float(lp))
                  for t, lp in zip(tokens[ep.start:], logp[ep.start:])]
      if top is not None:
        logprobs = [(*lp, self._alternatives(row))
                    for lp, row in zip(logprobs, top[ep.start:])]
    if hasattr(ep.env, "poll"):  # An agent: it answers when it has moved.
      ep.env.hand(turn, logprobs, wake=self._wake)
      self._parked[key] = ep, len(tokens)
      return PARK
    result = (ep.env.step(turn) if logprobs is None
              else ep.env.step(turn, logprobs=logprobs))
    return self._answer(key, ep, result, len(tokens))

  def ready(self, timeout: float = 0.0) -> list:
    """The parked episodes whose environments have answered (the driver's
    `PARK` protocol): [((prompt id, sample index), tokens or None)];
    waits up to `timeout` seconds for an answer when none has come."""
    if timeout > 0:
      self._wake.wait(timeout)
    self._wake.clear()  # Before polling: a later move sets it again.
    out = []
    for key, (ep, n) in list(self._parked.items()):
      result = ep.env.poll()
      if result is not None:
        del self._parked[key]
        out.append((key, self._answer(key, ep, result, n)))
    return out

  def _answer(self, key, ep: _Episode, result: Step, n: int, *,
              record: bool = True):
    """The tokens to append after the environment's `result` for the turn
    ending at token `n` (None: the episode ends); the turn's metrics."""
    if record and self._replay is not None:
      self._replay.put((*key, ep.turns), result)
    ep.turns += 1
    ep.reward += result.reward
    ep.calls += result.tool_call
    ep.errors += result.tool_error
    if result.done or result.observation is None:
      return None
    if ep.turns >= self.max_turns:
      ep.cut = True
      return None
    extra = self._encode(result.observation if result.rendered
                         else self.fmt.render(result.observation))
    ep.start = n + len(extra)
    return extra

  def finish(self, sample) -> None:
    """Closes the sample's episode: its `env_reward`, the metrics."""
    ep = self._live.pop(sample.key, None) or _Episode(None)
    if ep.env is not None:
      ep.env.close()
      # An agent's reward posted before a budget cut ended its episode.
      ep.reward += getattr(ep.env, "unclaimed_reward", lambda: 0.0)()
    if sample.finish_reason == "length":
      ep.turns += 1  # The turn the token budget cut.
    sample.env_reward = ep.reward
    self._done.append(ep)

  def metrics(self) -> dict[str, float]:
    n = max(1, len(self._done))
    eps = self._done
    return {
        "rollout/turns_per_episode": sum(e.turns for e in eps) / n,
        "rollout/tool_calls_per_episode": sum(e.calls for e in eps) / n,
        "rollout/tool_call_rate": sum(e.calls > 0 for e in eps) / n,
        "rollout/tool_errors": float(sum(e.errors for e in eps)),
        "rollout/turn_budget_cut": float(sum(e.cut for e in eps)),
        "rollout/env_reward": sum(e.reward for e in eps) / n,
        "rollout/replayed_answers": float(self.replayed)}

  def _alternatives(self, row) -> list | None:
    """A `state.top_columns` row as [(token text, log-prob)]."""
    if row is None:
      return None
    ids, logps = split_top(np.asarray(row))
    return [(self._decode([int(i)]), float(lp)) for i, lp in zip(ids, logps)]

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(ids, stop_at_eos=False)

  def _encode(self, text: str) -> list[int]:
    try:
      return list(self.tokenizer.encode(text))
    except DataError:  # Characters the tiny vocabulary lacks: dropped.
      out = []
      for ch in text:
        try:
          out += self.tokenizer.encode(ch)
        except DataError:
          pass
      return out


def agent_runner(agent):
  """(what each `AgentEnv` runs, its client factory) for the `agent`
  section's agent: its function in the job's threads (`agent_fn`), in
  `agent_workers` worker processes (`envs/agent_workers.py`), or a program
  per episode (`agent_cmd`). Workers need `close()` (the rollout's)."""
  import shlex  # pylint: disable=g-import-not-at-top
  from rlhf_jax.envs import agent_env  # pylint: disable=g-import-not-at-top
  if agent.agent_cmd:
    return (agent_env.ExecutableAgent(shlex.split(agent.agent_cmd),
                                      timeout_s=agent.agent_timeout_s),
            agent_env.Endpoint)
  fn = agent_env.load_agent(agent.agent_fn)  # Bad paths fail here, once.
  if not agent.agent_workers:
    return fn, None
  from rlhf_jax.envs import agent_workers  # pylint: disable=g-import-not-at-top
  return (agent_workers.AgentWorkers(agent.agent_fn,
                                     processes=agent.agent_workers,
                                     timeout_s=agent.agent_timeout_s),
          agent_env.Endpoint)


def from_config(agent, tokenizer, server=None, runner=None
                ) -> Episodes | None:
  """The `Episodes` of the `agent` section (None when off): a `ToolEnv`
  per sample with the named tools, in the named format; with
  `agent.agent_fn` or `.agent_cmd`, an `AgentEnv` per sample whose agent
  talks to `server` (`serving/openai_server.AgentServer`, the job's), run
  by `runner` (`agent_runner`'s; made here when not given)."""
  from rlhf_jax.envs import tools as tools_lib  # pylint: disable=g-import-not-at-top
  if not agent.enabled:
    return None
  if agent.through_endpoint:
    from rlhf_jax.envs import agent_env  # pylint: disable=g-import-not-at-top
    fn, client = runner or agent_runner(agent)
    limit = (threading.BoundedSemaphore(agent.max_running)
             if agent.max_running else None)
    return Episodes(
        lambda: agent_env.AgentEnv(server, fn,
                                   timeout_s=agent.agent_timeout_s,
                                   client_factory=client, limit=limit),
        tokenizer, tools_lib.FORMATS[agent.format](),
        max_turns=agent.max_turns,
        # The agent holds the conversation: a turn answered from the log
        # would leave it waiting for that turn while the driver goes on.
        # A resumed step runs its agents again.
        replayable=False)
  limits = None
  if "python" in agent.tools:
    from rlhf_jax.envs import sandbox  # pylint: disable=g-import-not-at-top
    limits = sandbox.SandboxLimits(timeout_s=agent.python_timeout_s,
                                   memory_mb=agent.python_memory_mb)
  tools = tools_lib.make_tools(agent.tools, python_limits=limits)
  fmt = tools_lib.FORMATS[agent.format]()
  return Episodes(
      lambda: tools_lib.ToolEnv(tools, fmt, enabled=not agent.disable_tools),
      tokenizer, fmt, max_turns=agent.max_turns)
