"""The job's rollout, built once from the `rollout` section.

  rollout = build(c.rollout, cfg, graphdef, rollout_layout, stop_ids)

`rollout.workers.num == 0`: a `LocalRollout` on the trainer's mesh (with
the common prefix and the long-tail policies as its parameters); otherwise
an `ElasticRollout` on the workers, seeded by that `LocalRollout` when
`rollout.workers.seed` is on. Config checks: `config/checks.py`.
"""

from __future__ import annotations

from typing import Callable

from rlhf_jax.config.sections import Rollout as RolloutSection
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.engine_set import EngineSet
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.envs import episodes as episodes_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel.layout import Layout
from rlhf_jax.rollout import elastic
from rlhf_jax.rollout.engines import engines
from rlhf_jax.rollout.base import Rollout
from rlhf_jax.rollout.local import LocalRollout
from rlhf_jax.timeline import Timeline


def eval_rollout(ro: RolloutSection, num_rows: int, cfg: ModelConfig,
                 graphdef, layout: Layout, stop_tokens=(),
                 episodes=None, *, num_samples: int = 1,
                 temperature: float = 0.0,
                 top_logprobs: int = 0) -> LocalRollout:
  """Held-out evaluation on the paged engine (multi-turn with `episodes`):
  greedy, one sample a row, or `num_samples` a row at `temperature` (the
  rollout's top_p and top_k); `top_logprobs` as `engines`."""
  if temperature:
    sampling = SamplingParams(temperature=temperature, top_p=ro.top_p,
                              top_k=ro.top_k, max_new_tokens=ro.max_new_tokens,
                              stop_tokens=tuple(stop_tokens))
  else:
    sampling = SamplingParams(temperature=0.0,
                              max_new_tokens=ro.max_new_tokens,
                              stop_tokens=tuple(stop_tokens))
  return LocalRollout(EngineSet(
      cfg, graphdef, layout,
      rows_per_replica=num_rows // layout.mesh.shape["data"],
      samples_per_row=num_samples, prefill_buckets=tuple(ro.prefill_buckets),
      sampling=sampling, top_logprobs=top_logprobs,
      paged=dict(page_size=ro.page_size, num_pages=0, num_slots=0,
                 decode_window=ro.decode_window)), episodes=episodes)


def build(ro: RolloutSection, cfg: ModelConfig, graphdef, layout: Layout,
          stop_tokens, *, rollout_tensor: int = 1,
          timeline: Timeline | None = None,
          train_time: Callable[[int], float | None] | None = None,
          lora_spec=None, episodes=None,
          record_routes: bool = False, top_logprobs: int = 0) -> Rollout:
  """The job's rollout (see the module doc).

  Args:
    ro: the rollout section.
    cfg, graphdef: the policy model.
    layout: the trainer's rollout layout.
    stop_tokens: sampling stops at these tokens.
    rollout_tensor: the rollout layout's tensor size.
    timeline: where the long-tail policies' per-replica spans go.
    train_time: step -> the trainer's train seconds (seed window cap).
    lora_spec: a LoRA policy's adapters: elastic workers pull only those.
    episodes: multi-turn rollouts' environments (`envs/episodes.py`).
    record_routes: the engines record an MoE's experts (routing replay).
    top_logprobs: the engines record each drawn token's likeliest
      alternatives (an agent endpoint's `top_logprobs`).
  """
  local = LocalRollout(engines(ro, cfg, graphdef, layout, stop_tokens,
                               record_routes=record_routes,
                               top_logprobs=top_logprobs),
                       tail=ro.long_tail, timeline=timeline,
                       episodes=episodes)
  if not ro.workers.num:
    return local
  return elastic.build(
      ro, cfg, stop_tokens, rollout_tensor=rollout_tensor,
      local=local if ro.workers.seed else None, train_time=train_time,
      common_prefix=local.common_prefix if ro.max_common_length else None,
      lora_spec=lora_spec, record_routes=record_routes)


def engine(ro: RolloutSection, cfg: ModelConfig, graphdef, layout: Layout,
           stop_tokens=()) -> Engine:
  """The paged engine on every replica of `layout` (the generation demo)."""
  return engines(ro, cfg, graphdef, layout, stop_tokens).engine()


def for_job(c, cfg: ModelConfig, graphdef, layout: Layout, tokenizer,
            stop_tokens, clock, lora_spec=None
            ) -> tuple[Rollout, LocalRollout, LocalRollout | None]:
  """(the job's rollout, its greedy eval rollout, its sampled eval rollout
  or None without `eval.num_samples`) from the sections `c`
  (`config.sections.RLJob`); per-replica spans and the seed window's
  train time come from the job's `clock` (`step_clock.StepClock`). With
  `c.agent.enabled` all are multi-turn, their turns also ending at the
  format's stops."""
  server = runner = None
  if c.agent.enabled and c.agent.through_endpoint:
    # One endpoint and one agent runner (its workers) for all rollouts.
    server, runner = _agent_server(c), episodes_lib.agent_runner(c.agent)
  top = c.agent.top_logprobs if server is not None else 0
  episodes = episodes_lib.from_config(c.agent, tokenizer, server, runner)
  if episodes is not None:
    stop_tokens = tuple(dict.fromkeys((*stop_tokens, *episodes.stop_ids())))
  sampled = None
  if c.eval.num_samples:
    sampled = eval_rollout(
        c.rollout, c.eval.num_rows, cfg, graphdef, layout, stop_tokens,
        episodes=episodes_lib.from_config(c.agent, tokenizer, server,
                                          runner),
        num_samples=c.eval.num_samples, temperature=c.eval.temperature,
        top_logprobs=top)
  rollout = build(c.rollout, cfg, graphdef, layout, stop_tokens,
                  rollout_tensor=c.mesh.rollout_tensor,
                  timeline=clock.timeline,
                  train_time=clock.phase_seconds, lora_spec=lora_spec,
                  episodes=episodes, record_routes=c.rl.routing_replay,
                  top_logprobs=top)
  if server is not None:  # It serves the eval rollouts' agents too.
    rollout.agent_server, rollout.agent_runner = server, runner[0]
  return (rollout,
          eval_rollout(c.rollout, c.eval.num_rows, cfg, graphdef, layout,
                       stop_tokens, episodes=episodes_lib.from_config(
                           c.agent, tokenizer, server, runner),
                       top_logprobs=top),
          sampled)


def _agent_server(c):
  """The job's OpenAI-compatible endpoint (`serving/`), started, for the
  agents of `c.agent.agent_fn` or `.agent_cmd`: its chat template (`agent.chat_template`,
  else the tagged format's), the tool format, the tools' argument names
  and the rollout's sampling. Requests asking other sampling are refused;
  the eval rollouts sample with the eval's settings."""
  from rlhf_jax.envs import tools as tools_lib  # pylint: disable=g-import-not-at-top
  from rlhf_jax.serving.chat import ChatRenderer, TAGGED_TEMPLATE  # pylint: disable=g-import-not-at-top
  from rlhf_jax.serving.openai_server import AgentServer  # pylint: disable=g-import-not-at-top
  a, ro = c.agent, c.rollout
  # A thread per open request: one for every episode that can be live at
  # once (the train rollout's samples, and the eval's), so none waits for
  # a thread while the driver waits for it.
  episodes = (ro.num_rows * ro.samples_per_row
              + c.eval.num_rows * max(1, c.eval.num_samples))
  return AgentServer(
      ChatRenderer(a.chat_template or TAGGED_TEMPLATE),
      tools_lib.FORMATS[a.format](),
      tools_lib.make_tools(a.tools),
      SamplingParams(temperature=ro.temperature, top_k=ro.top_k,
                     top_p=ro.top_p),
      max_open_requests=max(64, episodes),
      top_logprobs=a.top_logprobs).start()

