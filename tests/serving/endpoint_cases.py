"""What the agent endpoint's tests share (tests/serving/): the tiny tool
task's conversations, an endpoint on loopback, and a rollout of agent
episodes through it next to the in-process `ToolEnv` path it must equal."""

import dataclasses
import os

import numpy as np
import openai

from fakes import TINY_CFG as CFG
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.multiturn import MultiTurnDriver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.envs.agent_env import AgentEnv
from rlhf_jax.envs.episodes import Episodes
from rlhf_jax.envs.tools import Calculator, TaggedFormat
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.samples import Request
from rlhf_jax.serving.chat import ChatRenderer, TAGGED_TEMPLATE
from rlhf_jax.serving.openai_server import AgentServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TOK = CharTokenizer()
FMT = TaggedFormat()
TOOLS = {"calc": Calculator()}
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=64,
                         stop_tokens=(TOK.eos_id, *FMT.stop_ids(TOK)))
GREEDY = dataclasses.replace(SAMPLED, temperature=0.0)
PROMPTS, G = 16, 4  # 64 episodes at once.


def tool_requests(prompts=PROMPTS, g=G):
  return [Request(i, TOK.encode(f"{10 + 7 * i}*{3 + i}="), g, seed=5)
          for i in range(prompts)]


def openai_client(server, key):
  return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0,
                       http_client=openai.DefaultHttpxClient(trust_env=False))


def start_endpoint(sampling, top_logprobs=0):
  return AgentServer(ChatRenderer(TAGGED_TEMPLATE), FMT, TOOLS,
                     sampling, top_logprobs=top_logprobs).start()


def rollout(model, mesh8, sampling, make_env, prompts=PROMPTS, g=G,
            top_logprobs=0):
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  # Pages of 16 (a sample's 64 tokens fill up to 5): each bound of the
  # decode step takes one or two sizes over the rollout, one compile each.
  # With pages of 4 the own-page bound took three and the module compiled
  # 23 decode programs (37.0 s alone; 25.3 s with 16, 2026-12-02). Paging
  # itself is tests/engine/'s subject.
  engine = Engine(CFG, graphdef, layout, num_slots=max(prompts * g, 8),
                  samples_per_group=g, prefill_buckets=(16,),
                  sampling=sampling, page_size=16, num_pages=256,
                  prefill_batch=4, top_logprobs=top_logprobs)
  episodes = Episodes(make_env, TOK, FMT, max_turns=4)
  episodes.begin(None)
  driver = MultiTurnDriver(engine, mesh_lib.to_layout(params, layout),
                           reply=episodes)
  out = {}
  for s in driver.run(tool_requests(prompts, g)):
    episodes.finish(s)
    out[s.key] = s
  return out, episodes.metrics(), driver


def same_logp(got, want) -> bool:
  """Log-probs equal but for the last bits: a sample parked while its
  agent thinks decodes in other company than in-process, and XLA:CPU's
  decode program for another number of listed slots may round its last
  bit differently (the tokens, whose draws do not depend on the batch,
  are equal exactly)."""
  return len(got) == len(want) and np.allclose(got, want, rtol=1e-5,
                                                atol=1e-6)


def through_endpoint(model, mesh8, sampling, agent, *, timeout_s=60,
                     client_factory=None, top_logprobs=0, limit=None,
                     **sizes):
  """The rollout with `agent` driving every episode through a fresh
  endpoint, stopped after: (samples, metrics, driver, server, the envs)."""
  server = start_endpoint(sampling, top_logprobs)
  envs = []

  def make_env():
    envs.append(AgentEnv(server, agent, timeout_s=timeout_s,
                         client_factory=client_factory, limit=limit))
    return envs[-1]

  try:
    got, metrics, driver = rollout(model, mesh8, sampling, make_env,
                                   top_logprobs=top_logprobs, **sizes)
  finally:
    server.stop()  # Also ends the episodes a token budget cut.
  return got, metrics, driver, server, envs
