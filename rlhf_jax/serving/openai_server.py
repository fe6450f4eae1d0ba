"""The rollout's OpenAI-compatible endpoint, for agents written against the
`openai` client (`envs/agent_env.py` turns their requests into turns).

  server = AgentServer(ChatRenderer(template), fmt, tools, sampling).start()
  key = server.open(session)        # the key the episode's agent gets
  ...; server.close_all(); server.stop()

aiohttp serves it from a thread of its own, on 127.0.0.1 and a free port by
default. Routes: `GET /v1/models`, `POST /v1/chat/completions` (messages
rendered by the chat template; the model's turn comes back as content and
`tool_calls`, parsed by the tool format), `POST /v1/completions` (the
prompt is the conversation's text as is), and `POST /v1/rlhf_jax/reward`
(`{"reward": x}`: the episode's reward, winning over what the agent
returns; for agents that cannot return one, or compute it elsewhere). Not streaming. `logprobs` when
asked (chat: `logprobs: true`; completions: `logprobs: 0`): each token of
the model's turn with its log-prob under the distribution the job sampled
from (`Sample.logp`, the sampler's), the turn's stop token included; and
with `top_logprobs: n` (chat) or `logprobs: n` (completions), each token's
n likeliest tokens under the policy itself (temperature 1, unfiltered:
`logp_raw`'s distribution), up to the K the engine records
(`agent.top_logprobs`; more is refused with 400).

Security: every request carries `Authorization: Bearer <run key>.<episode>`,
the run key fresh and random per server; anything else is refused with 401
and one log line. Bodies over `max_request_bytes` are refused by aiohttp.
Sampling is the job's: a request asking for another `temperature`, `top_p`,
`top_k`, or `n` > 1 is refused (400) rather than silently overridden.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import itertools
import math
import secrets
import threading
import time
from typing import Mapping

from absl import logging

from rlhf_jax.envs.agent_env import AgentSession, HistoryError, SessionClosed
from rlhf_jax.serving.chat import ChatRenderer, MessageError, assistant_message

_CALL_IDS = itertools.count()


class AgentServer:
  """See the module doc. `sampling`: the job's `SamplingParams`."""

  def __init__(self, renderer: ChatRenderer, fmt, tools: Mapping, sampling,
               *, model_name: str = "policy", host: str = "127.0.0.1",
               port: int = 0, max_request_bytes: int = 1 << 20,
               max_open_requests: int = 512, top_logprobs: int = 0):
    self.renderer, self.fmt, self.tools = renderer, fmt, dict(tools)
    self.sampling, self.model_name = sampling, model_name
    self.host, self.port = host, port
    self.max_request_bytes = max_request_bytes
    self.max_open_requests = max_open_requests
    self.top_logprobs = top_logprobs  # Alternatives the engine records.
    self._key = secrets.token_hex(16)
    self._sessions: dict[str, AgentSession] = {}
    self._lock = threading.Lock()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self.refused = 0

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}/v1"

  # ------------------------------------------------------------ sessions
  def open(self, session: AgentSession) -> str:
    """Registers `session`; returns the API key its agent uses."""
    with self._lock:
      self._sessions[session.id] = session
    return f"{self._key}.{session.id}"

  def close(self, session: AgentSession) -> None:
    session.close()
    with self._lock:
      self._sessions.pop(session.id, None)

  def close_all(self) -> None:
    """Ends every episode still open (the rollout is over)."""
    with self._lock:
      sessions, self._sessions = list(self._sessions.values()), {}
    for s in sessions:
      s.close()

  # --------------------------------------------------------- lifecycle
  def start(self) -> "AgentServer":
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    app = web.Application(client_max_size=self.max_request_bytes)
    app.router.add_get("/v1/models", self._models)
    app.router.add_post("/v1/chat/completions", self._chat)
    app.router.add_post("/v1/completions", self._completions)
    app.router.add_post("/v1/rlhf_jax/reward", self._reward)
    self._loop = asyncio.new_event_loop()
    # Each open request waits in a thread for its model turn: enough of
    # them that no episode's request waits for another's to end.
    self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
        max_workers=self.max_open_requests, thread_name_prefix="agent-req"))
    runner = web.AppRunner(app, access_log=None)
    self._loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, self.host, self.port)
    self._loop.run_until_complete(site.start())
    self.port = runner.addresses[0][1]
    self._runner = runner
    self._thread = threading.Thread(target=self._loop.run_forever,
                                    name="agent-server", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self.close_all()
    if self._loop is None:
      return
    asyncio.run_coroutine_threadsafe(self._runner.cleanup(),
                                     self._loop).result(10)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(10)
    self._loop.close()
    self._loop = None

  # ---------------------------------------------------------- requests
  def _session(self, request) -> AgentSession:
    auth = request.headers.get("Authorization", "")
    token = auth[7:] if auth.startswith("Bearer ") else ""
    key, _, episode = token.rpartition(".")
    with self._lock:
      session = self._sessions.get(episode)
    if not hmac.compare_digest(key.encode(), self._key.encode()):
      raise _Refused(401, "a missing or wrong API key")
    if session is None:
      raise _Refused(404, f"episode {episode!r} is not open")
    return session

  def _check_sampling(self, body: Mapping) -> None:
    s = self.sampling
    asked = {"temperature": (body.get("temperature"), s.temperature),
             "top_p": (body.get("top_p"), s.top_p),
             "top_k": (body.get("top_k"), s.top_k),
             "n": (body.get("n"), 1)}
    for name, (value, ours) in asked.items():
      if value is not None and float(value) != float(ours):
        raise _Refused(400, f"{name}={value}: this job samples with "
                       f"{name}={ours} (the job's sampling settings govern)")
    if body.get("stream"):
      raise _Refused(400, "stream=true is not supported")

  async def _models(self, request):
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    try:
      self._session(request)
    except _Refused as e:
      return self._refusal(request, e)
    return web.json_response({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": 0,
         "owned_by": "rlhf_jax"}]})

  async def _reward(self, request):
    """`{"reward": <number>}`: the episode's reward, instead of what the
    agent returns (`AgentSession.post_reward`)."""
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    try:
      session = self._session(request)
      body = await _json_object(request)
      reward = body.get("reward")
      try:  # A huge int overflows a float.
        ok = (not isinstance(reward, bool)
              and isinstance(reward, (int, float))
              and math.isfinite(float(reward)))
      except OverflowError:
        ok = False
      if not ok:
        raise _Refused(400, f'the body must be {{"reward": <a finite '
                       f'number>}}, not {body!r:.100}')
      try:
        session.post_reward(reward)
      except SessionClosed as e:  # As for an episode no longer open.
        raise _Refused(404, str(e)) from None
    except _Refused as e:
      return self._refusal(request, e)
    return web.json_response({"episode": session.id, "reward": reward})

  async def _chat(self, request):
    return await self._serve(request, chat=True)

  async def _completions(self, request):
    return await self._serve(request, chat=False)

  async def _serve(self, request, *, chat: bool):
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    try:
      session = self._session(request)
      body = await _json_object(request)
      self._check_sampling(body)
      want_logprobs, top_n = _wants_logprobs(body, chat=chat,
                                             most=self.top_logprobs)
      try:
        if chat:
          text = self.renderer.render(body.get("messages") or [])
        else:
          text = body.get("prompt")
          if not isinstance(text, str):
            raise MessageError("prompt must be one string")
      except MessageError as e:
        raise _Refused(400, str(e)) from None
      try:
        turn, reason, tokens = await asyncio.get_running_loop(
        ).run_in_executor(None, session.exchange, text)
      except HistoryError as e:
        raise _Refused(400, str(e)) from None
      except SessionClosed as e:
        raise _Refused(410, str(e)) from None
      except TimeoutError as e:
        raise _Refused(504, str(e)) from None
    except _Refused as e:
      return self._refusal(request, e)
    created = int(time.time())
    if chat:
      message = assistant_message(turn, self.fmt, self.tools,
                                  f"call_{next(_CALL_IDS)}")
      if reason == "stop" and message.get("tool_calls"):
        reason = "tool_calls"
      choice = {"index": 0, "message": message, "finish_reason": reason,
                "logprobs": _chat_logprobs(tokens, top_n) if want_logprobs
                else None}
      kind = "chat.completion"
    else:
      choice = {"index": 0, "text": turn, "finish_reason": reason,
                "logprobs": _completion_logprobs(tokens, top_n)
                if want_logprobs else None}
      kind = "text_completion"
    return web.json_response({
        "id": f"{session.id}-{session.requests}", "object": kind,
        "created": created, "model": self.model_name, "choices": [choice]})

  def _refusal(self, request, e: "_Refused"):
    from aiohttp import web  # pylint: disable=g-import-not-at-top
    self.refused += 1
    logging.warning("agent endpoint refused %s %s: %s", request.method,
                    request.path, e.message)
    return web.json_response(
        {"error": {"message": e.message, "type": "invalid_request_error",
                   "code": e.status}}, status=e.status)


async def _json_object(request) -> dict:
  """The request's body, which must be a JSON object."""
  try:
    body = await request.json()
  except ValueError:
    raise _Refused(400, "the body is not JSON") from None
  if not isinstance(body, dict):
    raise _Refused(400, "the body must be a JSON object")
  return body


def _wants_logprobs(body: Mapping, *, chat: bool,
                    most: int) -> tuple[bool, int]:
  """(whether the request asks for log-probs, how many alternatives per
  token): chat's `logprobs: true` and `top_logprobs: n`, completions'
  `logprobs: n`. More alternatives than the job records (`most`) are
  refused."""
  asked = body.get("logprobs")
  if chat:
    top = body.get("top_logprobs") or 0
    want = bool(asked)
  elif asked is None or isinstance(asked, bool):
    top, want = 0, bool(asked)
  else:
    top, want = asked, True
  if not isinstance(top, int) or isinstance(top, bool) or top < 0:
    name = "top_logprobs" if chat else "logprobs"
    raise _Refused(400, f"{name}={top!r}: must be a count >= 0")
  if top > most:
    raise _Refused(400, f"{'top_logprobs' if chat else 'logprobs'}={top}: "
                   f"this job records {most} alternatives per token "
                   "(agent.top_logprobs)")
  return want, top


def _alternatives(token, n: int) -> list:
  """The first `n` of a token's recorded alternatives, (text, log-prob)."""
  return list(token[2] or ())[:n] if len(token) > 2 else []


def _chat_logprobs(tokens, top_n: int = 0) -> dict:
  """Chat's `choice.logprobs`: each token of the turn, with its `top_n`
  likeliest alternatives."""
  return {"content": [
      {"token": t[0], "logprob": t[1], "bytes": list(t[0].encode()),
       "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())}
                        for a, lp in _alternatives(t, top_n)]}
      for t in tokens or ()]}


def _completion_logprobs(tokens, top_n: int = 0) -> dict:
  """Completions' `choice.logprobs`: tokens, their log-probs, offsets and
  (`top_n` > 0) each one's alternatives as {text: log-prob}."""
  offsets, at = [], 0
  for t in tokens or ():
    offsets.append(at)
    at += len(t[0])
  return {"tokens": [t[0] for t in tokens or ()],
          "token_logprobs": [t[1] for t in tokens or ()],
          "top_logprobs": [dict(_alternatives(t, top_n))
                           for t in tokens or ()] if top_n else None,
          "text_offset": offsets}


class _Refused(Exception):

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status, self.message = status, message
