"""The environment interface of multi-turn rollouts.

An episode is one sample. Its first observation is the prompt (the data
source's, already tokenized); after each model turn (the text sampled
since the last observation, ending at a stop token: the close of a tool
call or the end of the turn) the environment answers:

  env.reset(prompt, metadata)
  result = env.step(action)  # -> Step(observation, reward, done)

`observation` is text appended to the conversation (the chat format wraps
it, `tools.ToolFormat.render`); `done` ends the sample there. Rewards of
every step add up into the sample's `env_reward`, which the reward
function "env" (`rewards/verifiable.py`) hands to the trainer; the
task's own reward functions score the whole trajectory as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol


@dataclasses.dataclass(frozen=True)
class Step:
  """What the environment answers to one model turn."""
  observation: str | None  # Text to append (None: nothing; needs done).
  reward: float = 0.0
  done: bool = False
  tool_call: bool = False  # The turn called a tool (metrics).
  tool_error: bool = False  # ... and it failed (metrics).
  # The observation is already in the conversation's format (an agent's
  # messages rendered by the chat template, `envs/agent_env.py`), so the
  # tool format does not wrap it again.
  rendered: bool = False


class Env(Protocol):
  """One episode's environment; a fresh one per sample."""

  def reset(self, prompt: str, metadata: Mapping) -> None:
    """Starts the episode whose first observation is `prompt`."""

  def step(self, action: str) -> Step:
    """The answer to one model turn (`action`: its text)."""

  def close(self) -> None:
    """The episode's sample is finished (after its last turn, or cut by
    the token budget): release what the episode holds."""
