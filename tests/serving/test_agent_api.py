"""The OpenAI-compatible agent endpoint (rlhf_jax/serving/,
envs/agent_env.py), with the real `openai` client on loopback: an agent's
episodes give the tokens, masks and log-probs the in-process tool path
gives for the same conversations and seeds; requests without the key, with
an edited history or with the job's sampling overridden are refused; an
agent that crashes ends its episode as failed and the rollout goes on."""

import collections
import json
import sys
import threading
import time

import openai
import pytest

import resume
from configs import tiny_agent_api, tiny_tool
from configs.tiny_agent_api import calc_agent
from endpoint_cases import (FMT, G, GREEDY, PROMPTS, ROOT, SAMPLED, TOK,
                            TOOLS, openai_client, rollout, same_logp,
                            start_endpoint, through_endpoint, tool_requests)
from rlhf_jax.envs.agent_env import (AgentSession, Endpoint, ExecutableAgent,
                                     SessionClosed)
from rlhf_jax.envs.tools import ToolEnv
from rlhf_jax.serving.chat import ChatRenderer, TAGGED_TEMPLATE


# Sampled: 64 concurrent episodes, some calling the tool; greedy (the
# random model calls none): 16.
@pytest.mark.parametrize("sampling,prompts", [(SAMPLED, PROMPTS),
                                              (GREEDY, 4)],
                         ids=["sampled", "greedy"])
def test_agent_episodes_equal_the_in_process_tool_path(tiny_model, mesh8,
                                                       sampling, prompts):
  want, want_metrics, _ = rollout(tiny_model, mesh8, sampling,
                                  lambda: ToolEnv(TOOLS, FMT), prompts)
  got, metrics, driver, server, envs = through_endpoint(
      tiny_model, mesh8, sampling, calc_agent, prompts=prompts)
  assert got.keys() == want.keys() and len(got) == prompts * G
  for k, s in got.items():
    w = want[k]
    assert (s.tokens, s.env_mask, s.finish_reason, s.env_reward) == (
        w.tokens, w.env_mask, w.finish_reason, w.env_reward), k
    assert same_logp(s.logp_raw, w.logp_raw), k
  # Turns, calls, rewards, budget cuts alike; `tool_errors` differs in
  # meaning: a tool's error text is the agent's business here, and the
  # count is of failed episodes (none).
  errors = "rollout/tool_errors"
  assert metrics.pop(errors) == 0 and want_metrics.pop(errors) >= 0
  assert metrics == want_metrics
  # The episodes share decode steps: 36.8 live samples a step of 64
  # (sampled) on a quiet machine, 26.8 under a CI run's load (the agents'
  # threads answer later, so more samples wait parked); an endpoint that
  # served one agent at a time would leave about one live sample a step
  # once the first turns end.
  live_per_step = driver.stats.generated_tokens / driver.stats.steps
  assert live_per_step >= prompts * G / 4, live_per_step
  # Each turn end parked its sample until the agent moved (the driver did
  # not wait for it).
  stopped = sum(s.finish_reason == "stop" for s in got.values())
  assert driver.parkings >= stopped, (driver.parkings, stopped)
  if sampling is SAMPLED:  # Not vacuous: the agents called the tool.
    assert metrics["rollout/tool_call_rate"] > 0.05, metrics
    assert driver.appended_tokens > 0 and driver.turns > 0 and stopped > 0
  for env in envs:  # Every agent returned; none is left waiting.
    env.thread.join(10)
    assert not env.thread.is_alive()
  assert server.refused == 0


class _AskingLogprobs:
  """An `openai` client whose chat calls ask for log-probs (and `top`
  alternatives) and keep what comes back: `turns`, one [(token,
  log-prob)] list per answer; `alternatives`, each token's
  (token, log-prob, [(alternative, log-prob)])."""

  def __init__(self, client, top=0):
    self.client, self.top, self.turns, self.alternatives = client, top, [], []
    self.chat = self.completions = self

  def create(self, **kwargs):
    reply = self.client.chat.completions.create(
        logprobs=True, **(dict(top_logprobs=self.top) if self.top else {}),
        **kwargs)
    content = reply.choices[0].logprobs.content
    self.turns.append([(c.token, c.logprob) for c in content])
    assert all(c.bytes == list(c.token.encode()) for c in content)
    self.alternatives += [(c.token, c.logprob, [(a.token, a.logprob)
                                                for a in c.top_logprobs])
                          for c in content]
    return reply


@pytest.mark.parametrize("top", [0, 3], ids=["logprobs", "top_logprobs"])
def test_logprobs_are_the_samplers_of_each_turns_tokens(tiny_model, mesh8,
                                                        top):
  """An agent asking for log-probs gets each token of each model turn
  with the sampler's log-prob: the sample's `logp` at that turn's tokens
  (the runs between appended replies that end at a stop token), the
  tokens' texts making up the turn's text. (A turn the token budget cut
  reaches the agent as finish reason "length" with no tokens; a sample
  cut in its first turn never starts its agent.) With `top_logprobs=3`
  each token also comes with the policy's 3 likeliest tokens, likeliest
  first; at temperature 1, unfiltered, the sampler's distribution is the
  policy's, so a drawn token among them has its own log-prob there (two
  records taken apart: the draw's and the top-k's; the engine's test
  checks the top-k against a forward pass)."""
  seen = collections.defaultdict(list)  # Prompt -> each episode's turns.
  alternatives = []

  def agent(client, prompt, metadata):
    asking = _AskingLogprobs(client, top)
    seen[prompt].append(asking.turns)
    alternatives.append(asking.alternatives)
    return calc_agent(asking, prompt, metadata)

  got, metrics, _, server, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, agent, top_logprobs=top)
  assert server.refused == 0 and metrics["rollout/tool_errors"] == 0
  by_prompt = collections.defaultdict(list)
  for s in got.values():
    turns, start = [], 0
    for i in range(len(s.tokens) + 1):
      if i == len(s.tokens) or s.env_mask[i]:
        if start < i and s.tokens[i - 1] in SAMPLED.stop_tokens:
          turns.append([(TOK.decode([t], stop_at_eos=False), lp) for t, lp
                        in zip(s.tokens[start:i], s.logp[start:i])])
        start = i + 1
    if turns:
      by_prompt[TOK.decode(tool_requests()[s.prompt_id].tokens)].append(turns)
  answered = {p: [[t for t in turns if t] for turns in episodes]
              for p, episodes in seen.items()}
  assert sorted(answered) == sorted(by_prompt)
  for prompt, episodes in answered.items():
    assert sorted(episodes) == sorted(by_prompt[prompt]), prompt
  # Not vacuous: many turns, tool calls among them (the random model's
  # turns after a tool's reply run into the token budget here).
  assert sum(len(t) for eps in answered.values() for t in eps) >= 32
  assert metrics["rollout/tool_call_rate"] > 0.05
  tokens = [t for episode in alternatives for t in episode]
  if not top:
    assert all(alts == [] for _, _, alts in tokens)
    return
  among = 0
  for token, logprob, alts in tokens:
    assert len(alts) == 3
    logps = [lp for _, lp in alts]
    assert logps == sorted(logps, reverse=True) and logps[0] <= 0.0
    for text, lp in alts:
      if text == token:
        assert lp == pytest.approx(logprob, abs=1e-5)
        among += 1
  assert among > 100, (among, len(tokens))


def test_requests_without_the_key_an_edited_history_or_other_sampling_are_refused():
  server = start_endpoint(SAMPLED)
  try:
    session = AgentSession("e-test", "12*3=", timeout_s=5)
    key = server.open(session)
    run_key = key.rpartition(".")[0]
    for bad in ("", "sk-wrong.e-test", f"{run_key}x.e-test"):
      client = openai_client(server, bad or "none")
      with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai_client(server, key)
    assert [m.id for m in client.models.list()] == ["policy"]
    with pytest.raises(openai.BadRequestError, match="do not extend"):
      client.chat.completions.create(
          model="policy", messages=[{"role": "user", "content": "99="}])
    with pytest.raises(openai.BadRequestError, match="temperature=1.0"):
      client.chat.completions.create(
          model="policy", temperature=0.5,
          messages=[{"role": "user", "content": "12*3="}])
    with pytest.raises(openai.NotFoundError):
      openai_client(server, f"{run_key}.e-none").models.list()
    with pytest.raises(openai.BadRequestError, match="top_logprobs=2"):
      client.chat.completions.create(
          model="policy", logprobs=True, top_logprobs=2,
          messages=[{"role": "user", "content": "12*3="}])
    with pytest.raises(openai.BadRequestError, match="logprobs=1: this job "
                       "records 0"):
      client.completions.create(model="policy", prompt="12*3=", logprobs=1)
    assert server.refused == 8
    # The prompt's own messages wait for the model's turn; the episode
    # ends (no turn) and the request is answered, finish reason "length".
    answer = {}
    t = threading.Thread(target=lambda: answer.update(
        r=client.chat.completions.create(
            model="policy", messages=[{"role": "user",
                                       "content": "12*3="}])))
    t.start()
    while session.requests == 0:
      t.join(0.01)
    server.close(session)
    t.join(10)
    assert answer["r"].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):  # Closed: no longer open.
      client.models.list()
  finally:
    server.stop()


def test_a_crashing_agent_fails_its_episode_and_the_rollout_goes_on(
    tiny_model, mesh8):
  def crashing(client, prompt, metadata):
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": prompt}])
    raise RuntimeError("the agent's own bug")

  got, metrics, _, _, _ = through_endpoint(tiny_model, mesh8, GREEDY,
                                           crashing, timeout_s=30)
  assert len(got) == PROMPTS * G
  # Each episode whose first turn ended at a stop token failed there
  # (reward 0, counted as a tool error); none appended anything.
  stopped = [s for s in got.values() if s.finish_reason == "stop"]
  assert stopped and metrics["rollout/tool_errors"] == len(stopped)
  assert all(s.env_reward == 0.0 and not any(s.env_mask)
             for s in got.values())


def test_an_agent_that_stops_moving_fails_at_its_timeout(tiny_model, mesh8):
  """An agent that takes its first turn and then never moves (a thread,
  stuck) fails its episode once `timeout_s` passes; the rollout ends (no
  step hangs, nothing waits for the stuck thread) and the others go on."""
  release = threading.Event()

  def stuck(client, prompt, metadata):
    messages = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages)
    if reply.choices[0].finish_reason == "tool_calls":
      release.wait(120)  # Stuck in its "tool".
    return calc_agent(client, prompt, metadata)

  t0 = time.monotonic()
  try:
    got, metrics, _, _, _ = through_endpoint(
        tiny_model, mesh8, SAMPLED, stuck, timeout_s=1.5, prompts=4)
  finally:
    release.set()
  assert time.monotonic() - t0 < 60
  assert len(got) == 16
  # The stuck ones (those that called the tool) failed, the rest did not.
  assert 0 < metrics["rollout/tool_errors"] < len(got)
  failed = [s for s in got.values() if s.env_reward == 0.0
            and not any(s.env_mask)]
  assert len(failed) >= metrics["rollout/tool_errors"]


def _post_reward(base_url, api_key, body):
  """POST /v1/rlhf_jax/reward as an agent would: (status, JSON answer)."""
  import httpx  # pylint: disable=g-import-not-at-top
  r = httpx.post(f"{base_url}/rlhf_jax/reward", json=body, trust_env=False,
                 headers={"Authorization": f"Bearer {api_key}"})
  return r.status_code, r.json()


def test_a_posted_reward_is_the_episodes(tiny_model, mesh8, monkeypatch):
  """An agent that posts its reward to the endpoint gets it as the
  episode's, whatever it returns; so does a program that prints none.
  A body without a finite number, a missing key and an ended episode are
  refused."""
  answers = []

  def posting(client, prompt, metadata):
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": prompt}])
    key, url = client.api_key, str(client.base_url).rstrip("/")
    answers.append(_post_reward(url, key, {"reward": "high"}))
    answers.append(_post_reward(url, "wrong." + key.rpartition(".")[2],
                                {"reward": 1.0}))
    answers.append(_post_reward(url, key, {"reward": 1.0}))
    answers.append(_post_reward(url, key, {"reward": len(prompt) / 100}))
    return 999.0  # The posted reward wins.

  got, metrics, _, server, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, posting, timeout_s=30, prompts=4, g=2)
  assert metrics["rollout/tool_errors"] == 0
  # An agent starts at its episode's first stop token (a turn the token
  # budget cut has no agent, and reward 0).
  ran = [s for s in got.values() if s.finish_reason == "stop"]
  assert ran and len(answers) == 4 * len(ran)
  for s in ran:
    prompt = TOK.decode(s.prompt_tokens, stop_at_eos=False)
    assert s.env_reward == pytest.approx(len(prompt) / 100), s.key
  statuses = collections.Counter(status for status, _ in answers)
  assert statuses == {400: len(ran), 401: len(ran), 200: 2 * len(ran)}
  assert server.refused == 2 * len(ran)

  # Posted, then talking until the turn or token budget cuts the episode:
  # the posted reward still counts (the agent's last move never came).
  def posting_then_talking(client, prompt, metadata):
    messages = [{"role": "user", "content": prompt}]
    key, url = client.api_key, str(client.base_url).rstrip("/")
    while True:
      reply = client.chat.completions.create(model="policy",
                                             messages=messages)
      if reply.choices[0].finish_reason == "length":
        return 999.0  # Too late: the episode has ended.
      assert _post_reward(url, key, {"reward": 0.5})[0] == 200
      messages += [reply.choices[0].message.model_dump(exclude_none=True),
                   {"role": "user", "content": "+1="}]

  got, metrics, _, _, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, posting_then_talking, timeout_s=30,
      prompts=4, g=2)
  ran = [s for s in got.values() if any(s.env_mask)]
  assert ran and metrics["rollout/tool_errors"] == 0
  assert all(s.env_reward == 0.5 for s in ran)
  server = start_endpoint(SAMPLED)
  try:
    session = AgentSession("ended", "1+1=", timeout_s=5)
    key = server.open(session)
    assert _post_reward(server.url, key, {"reward": 0.5})[0] == 200
    assert _post_reward(server.url, key, {"reward": 10 ** 400})[0] == 400
    server.close(session)
    assert _post_reward(server.url, key, {"reward": 1.0})[0] == 404
    with pytest.raises(SessionClosed):
      session.post_reward(1.0)
  finally:
    server.stop()

  # A program that posts its reward and prints nothing.
  monkeypatch.setenv("PYTHONPATH", ROOT)
  program = ExecutableAgent([sys.executable, "-c", (
      "import os, httpx, openai\n"
      "c = openai.OpenAI(max_retries=0, http_client=openai.DefaultHttpxClient("
      "trust_env=False))\n"
      "p = os.environ['RLHF_JAX_PROMPT']\n"
      "c.chat.completions.create(model='policy', messages=[{'role': 'user', "
      "'content': p}])\n"
      "httpx.post(os.environ['OPENAI_BASE_URL'] + '/rlhf_jax/reward', "
      "json={'reward': 0.25}, trust_env=False, headers={'Authorization': "
      "'Bearer ' + os.environ['OPENAI_API_KEY']}).raise_for_status()\n")],
                            timeout_s=60)
  got, metrics, _, _, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, program, client_factory=Endpoint,
      prompts=1, g=2)
  assert metrics["rollout/tool_errors"] == 0
  ran = [s for s in got.values() if s.finish_reason == "stop"]
  assert ran and all(s.env_reward == 0.25 for s in ran)
  # One that neither prints nor posts a reward fails its episode.
  silent = ExecutableAgent([sys.executable, "-c", "pass"], timeout_s=60)
  got, metrics, _, _, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, silent, client_factory=Endpoint,
      timeout_s=30, prompts=1, g=2)
  ran = [s for s in got.values() if s.finish_reason == "stop"]
  assert ran and metrics["rollout/tool_errors"] == len(ran)


def test_the_tagged_template_renders_a_call_and_its_reply_as_the_tool_path():
  """An assistant turn ending in a call, as the endpoint returns it, and
  the tool's reply render to the tagged transcript the in-process path
  trains on (`37*48=[calc 37*48](1776)1776`)."""
  from rlhf_jax.serving.chat import assistant_message
  renderer = ChatRenderer(TAGGED_TEMPLATE)
  turn = "=[calc 37*48]"
  message = assistant_message(turn, FMT, TOOLS, "call_0")
  assert message["content"] == "="
  call = message["tool_calls"][0]["function"]
  assert (call["name"], json.loads(call["arguments"])) == (
      "calc", {"expression": "37*48"})
  out = ToolEnv(TOOLS, FMT).step(turn).observation
  text = renderer.render([
      {"role": "user", "content": "37*48"}, message,
      {"role": "tool", "tool_call_id": "call_0", "content": out},
      {"role": "assistant", "content": "1776"}])
  assert text == "37*48" + turn + FMT.render(out) + "1776"
  assert text == "37*48=[calc 37*48](1776)1776"
  # A turn without a call is content alone; a tool reply's parentheses go.
  assert assistant_message("12", FMT, TOOLS, "c") == {"role": "assistant",
                                                      "content": "12"}
  assert renderer.render([{"role": "tool", "content": "f(x)"}]) == "(fx)"


@pytest.mark.slow  # Two jobs: 43 s alone.
def test_the_agent_job_equals_the_tool_job(tmp_path):
  """configs/tiny_agent_api.py:runlocal (the calculator in an `openai`
  agent, through the endpoint, eval included) writes tiny_tool's records:
  the same rewards, turns, losses and held-out accuracy."""
  from rlhf_jax.trainers import rl_job
  # Every warm-start example calls the calculator, so the policy does.
  steps = {"train.steps": 2, "eval.every": 2, "task.tool_demo_fraction": 1.0}
  runs = {}
  for name, module in (("tool", tiny_tool), ("agent", tiny_agent_api)):
    rl_job.run(resume.override(module.get_config("runlocal"), **steps),
               str(tmp_path / name))
    runs[name] = {k: v for k, v in resume.records(
        str(tmp_path / name)).items() if k[0] in ("rl", "eval")}
  assert runs["agent"].keys() == runs["tool"].keys()
  for key, want in runs["tool"].items():
    got = dict(runs["agent"][key])
    # A tool's error text is the agent's business: there it counts
    # failed episodes (none).
    assert got.pop("rollout/tool_errors", 0) == 0
    # The schedule differs, not the samples: a sample parks while its
    # agent thinks, so the decode steps and the pages held at the peak
    # are the driver's own.
    schedule = ("rollout/steps", "rollout/peak_kv_pages",
                "rollout/peak_live_samples")
    want = {k: v for k, v in want.items()
            if k != "rollout/tool_errors" and k not in schedule}
    got = {k: v for k, v in got.items() if k not in schedule}
    assert got == pytest.approx(want, rel=1e-6), key
  # Not vacuous: the policy called the tool through the agent.
  calls = [v for (phase, _), r in runs["agent"].items() if phase == "rl"
           for k, v in r.items() if "tool_call" in k]
  assert calls and max(calls) > 0, runs["agent"]


def test_a_concurrency_limit_runs_at_most_that_many_agents(tiny_model,
                                                          mesh8):
  """`agent.max_running=3`: 16 episodes, never more than 3 agents running
  (reached), each over the limit parked until one ends; the samples are
  the in-process path's all the same."""
  want, _, _ = rollout(tiny_model, mesh8, SAMPLED,
                       lambda: ToolEnv(TOOLS, FMT), prompts=4)
  lock, running, most = threading.Lock(), [0], [0]

  def counted(client, prompt, metadata):
    with lock:
      running[0] += 1
      most[0] = max(most[0], running[0])
    try:
      time.sleep(0.05)  # Long enough for the others to pile up.
      return calc_agent(client, prompt, metadata)
    finally:
      with lock:
        running[0] -= 1

  got, metrics, _, _, _ = through_endpoint(
      tiny_model, mesh8, SAMPLED, counted, prompts=4,
      limit=threading.BoundedSemaphore(3))
  assert most[0] == 3, most
  assert {k: (s.tokens, s.env_mask) for k, s in got.items()} == {
      k: (s.tokens, s.env_mask) for k, s in want.items()}
  assert all(same_logp(s.logp_raw, want[k].logp_raw)
             for k, s in got.items())
  assert metrics["rollout/tool_errors"] == 0
