"""Multi-turn, tool-using rollouts (rlhf_jax/envs/): the environment's
tokens stay out of the loss, a trajectory through `Episodes` equals the
same one re-prefilled at every turn, recorded tool outputs are replayed,
the calculator and the call formats, the tool task's data, the config
checks, and kill-and-resume of the tiny_tool job mid-episode."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import resume
from configs import tiny_tool
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.data.batching import sft_batch
from rlhf_jax.data.tasks import AdditionTask
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.samples import Request, Sample
from rlhf_jax.engine.multiturn import MultiTurnDriver
from rlhf_jax.engine.engine import Engine
from rlhf_jax.envs.environment import Step
from rlhf_jax.envs.episodes import Episodes, ReplayLog
from rlhf_jax.envs.tools import Calculator, QwenFormat, TaggedFormat, ToolEnv
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl import aggregation, batch as batch_lib, packing
from rlhf_jax.rewards import verifiable
import multiturn_cases as mt
from fakes import TINY_CFG as CFG

TOK = CharTokenizer()


# ------------------------------------------------------------- the loss
def _sample(pid, idx, n, env):
  """A response of n tokens whose positions `env` the environment wrote."""
  return Sample(pid, idx, np.arange(3, 7, dtype=np.int32),
                list(range(10, 10 + n)), [-0.5] * n, [-0.5] * n, "stop", 0,
                env_mask=[i in env for i in range(n)])


def test_environment_tokens_are_out_of_the_loss_in_every_layout():
  samples = [_sample(0, 0, 9, {3, 4, 5}), _sample(0, 1, 4, set()),
             _sample(1, 0, 6, {1}), _sample(1, 1, 7, {2, 3, 4, 5})]
  want = [np.array([i not in env for i in range(n)], np.float32)
          for n, env in ((9, {3, 4, 5}), (4, ()), (6, {1}), (7, {2, 3, 4, 5}))]
  rep = batch_lib.pack(samples, 4, 12).arrays["loss_mask"]
  grouped = batch_lib.pack(samples, 4, 12, group_size=2).arrays["loss_mask"]
  for b, w in enumerate(want):
    np.testing.assert_array_equal(rep[b, 3:3 + 12][:len(w)], w)
    assert rep[b].sum() == w.sum()
    np.testing.assert_array_equal(grouped[b // 2, b % 2, :len(w)], w)
    assert grouped[b // 2, b % 2].sum() == w.sum()
  slots = packing.Slots(64, 1, 1, 1)
  for g in (0, 2):
    arrays = batch_lib.pack(samples, 4, 12, group_size=g,
                            slots=slots).arrays
    for b, w in enumerate(want):
      at = arrays["seq"] == b
      np.testing.assert_array_equal(arrays["loss_mask"][at], w)
      assert set(arrays["seq_len"][at]) == {w.sum()}
  # A gapped row is still one sequence for the per-sequence means.
  loss = np.ones_like(rep)
  num, den = aggregation.seq_mean_token_mean_terms(loss, rep)
  assert float(den) == 4 and float(num) == pytest.approx(4.0)


# ------------------------------------------------ turns through Episodes
class LengthEnv:
  """Answers a turn with its length (digits) for two turns, then ends."""
  calls = 0

  def reset(self, prompt, metadata):
    self.turns = 0

  def close(self):
    pass

  def step(self, action):
    LengthEnv.calls += 1
    self.turns += 1
    if self.turns > 2:
      return Step(None, reward=0.25, done=True)
    return Step(str(len(action) % 100), tool_call=True)


def _oracle_reply():
  """The same environment written independently: replies by sample."""
  seen = {}

  def reply(request, j, tokens, logp=None):
    del logp
    last = seen.get((request.prompt_id, j), (0, 0))
    turns, start = last[0] + 1, last[1]
    if turns > 2:
      return None
    text = "(" + str(len(TOK.decode(tokens[start:], stop_at_eos=False))
                     % 100) + ")"
    extra = TOK.encode(text)
    seen[request.prompt_id, j] = turns, len(tokens) + len(extra)
    return extra
  return reply


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


def _run_episodes(model, mesh8, episodes):
  graphdef, params = model
  layout = mesh_lib.rollout_layout(mesh8, tensor=2)
  engine = Engine(CFG, graphdef, layout, num_slots=8,
                       samples_per_group=2, prefill_buckets=(16,),
                       sampling=mt.GREEDY, page_size=4, num_pages=200,
                       prefill_batch=2)
  driver = MultiTurnDriver(engine, mesh_lib.to_layout(params, layout),
                           reply=episodes)
  out = {}
  for s in driver.run(mt.requests()):
    episodes.finish(s)
    out[s.key] = s
  return out


def test_episodes_turns_equal_reprefill_at_every_turn(model, mesh8, mesh1):
  episodes = Episodes(LengthEnv, TOK, TaggedFormat(), max_turns=4)
  episodes.begin(1)
  got = _run_episodes(model, mesh8, episodes)
  want = mt.oracle(model, mesh_lib.rollout_layout(mesh1),
                    reply=_oracle_reply())
  assert got.keys() == want.keys()
  for k, s in got.items():
    assert (s.tokens, s.env_mask, s.finish_reason) == want[k], k
  m = episodes.metrics()
  calls = sum(any(mask) for _, mask, _ in want.values())
  assert calls >= 3 and m["rollout/tool_call_rate"] == calls / len(want)
  # The reward comes with the third turn's `done`: stopped samples only.
  assert all(s.env_reward == 0.25 * (s.finish_reason == "stop")
             for s in got.values())


def test_episode_turns_rewards_and_turn_budget():
  req = Request(99, np.array([5, 6, 7], np.int32), 1)
  episodes = Episodes(LengthEnv, TOK, TaggedFormat(), max_turns=4)
  episodes.begin(None)
  tokens = [10, 11]
  first = episodes(req, 0, tokens)
  assert first == TOK.encode("(2)")
  tokens += first + [12, 13, 14]
  assert episodes(req, 0, tokens) == TOK.encode("(3)")
  assert episodes(req, 0, tokens + TOK.encode("(3)") + [15]) is None
  sample = _sample(99, 0, 3, set())
  episodes.finish(sample)
  assert sample.env_reward == 0.25
  short = Episodes(LengthEnv, TOK, TaggedFormat(), max_turns=2)
  short.begin(None)
  assert short(req, 1, [10]) == TOK.encode("(1)")
  assert short(req, 1, [10] + TOK.encode("(1)") + [11]) is None  # Budget.
  short.finish(_sample(99, 1, 5, set()))
  m = {**episodes.metrics(), **{"cut": short.metrics()[
      "rollout/turn_budget_cut"]}}
  assert (m["rollout/turns_per_episode"], m["rollout/tool_calls_per_episode"],
          m["rollout/env_reward"], m["cut"]) == (3, 2, 0.25, 1)


def test_a_rerun_step_replays_recorded_tool_outputs(model, mesh8, tmp_path):
  """Step 7's answers are logged; a rerun of step 7 (after a crash) gets
  them back without calling the environment; step 8 calls it."""
  LengthEnv.calls = 0
  first = Episodes(LengthEnv, TOK, TaggedFormat(), max_turns=4,
                   log=ReplayLog(str(tmp_path), keep_steps=2))
  first.begin(7)
  ran = _run_episodes(model, mesh8, first)
  calls = LengthEnv.calls
  assert calls > 0

  class Forgetful(LengthEnv):  # Different answers: replay must not call it.
    def step(self, action):
      raise AssertionError("a recorded answer was asked again")

  again = Episodes(Forgetful, TOK, TaggedFormat(), max_turns=4,
                   log=ReplayLog(str(tmp_path), keep_steps=2))
  again.begin(7)
  rerun = _run_episodes(model, mesh8, again)
  assert {k: s.tokens for k, s in rerun.items()} == {
      k: s.tokens for k, s in ran.items()}
  assert again.metrics()["rollout/replayed_answers"] == calls
  with pytest.raises(AssertionError, match="asked again"):
    again.begin(8)
    _run_episodes(model, mesh8, again)
  again.log.begin(11)  # Steps older than 11 - keep_steps are dropped.
  assert os.listdir(tmp_path) == ["step_11.p0.jsonl"]


# ----------------------------------------------------- tools and formats
def test_calculator_computes_and_refuses_without_raising():
  calc = Calculator()
  assert calc("37*48") == "1776"
  assert calc("(2+3)*-4") == "-20"
  assert calc("7/2") == "3.5" and calc("2**10") == "1024"
  for bad in ("__import__('os').system('true')", "x+1", "len([1])",
              "1/0", "9**9**9", "1+", "'a'*3"):
    assert calc(bad).startswith("error:"), bad


def test_tool_env_answers_calls_errors_and_ends():
  env = ToolEnv({"calc": Calculator()}, TaggedFormat())
  step = env.step("[calc 12*12]")
  assert (step.observation, step.tool_call, step.done) == ("144", True, False)
  assert env.step("144").done  # No call: the episode ends.
  assert env.step("[py 1]").observation.startswith("error: unknown tool")
  off = ToolEnv({"calc": Calculator()}, TaggedFormat(), enabled=False)
  assert off.step("[calc 1+1]").observation == "error: tools are disabled"
  assert TaggedFormat().render("f(x)") == "(fx)"
  assert TaggedFormat().final("[calc 3*4](12)12") == "12"
  assert TaggedFormat().final("12") == "12"


def test_qwen_format_reads_json_calls_and_writes_tool_turns():
  fmt, tools = QwenFormat(), {"calc": Calculator()}
  call = ('I will compute.<tool_call>\n{"name": "calc", "arguments": '
          '{"expression": "6*7"}}\n</tool_call>')
  assert fmt.parse(call, tools) == ("calc", "6*7")
  assert fmt.parse('Sure.\n{"name": "calc"}', tools) == ("calc", "")
  assert fmt.parse("The answer is 42.", tools) is None
  assert fmt.parse("<tool_call>{oops}</tool_call>", tools)[0] == ""
  env = ToolEnv(tools, fmt)
  assert env.step(call).observation == "42"
  text = fmt.render("42")
  assert text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42")
  assert text.endswith("<|im_start|>assistant\n")
  assert fmt.final("a" + text + "The answer is 42.") == (
      "<|im_end|>\n<|im_start|>assistant\nThe answer is 42.")


# --------------------------------------------------------- the tool task
def test_tool_task_demos_train_the_call_not_the_reply():
  task = AdditionTask(max_digits=2, min_digits=2, operator="*",
                      reverse_answer=False, tool_demo_fraction=0.5)
  b = sft_batch(task, TOK, 0, 16)
  demos = 0
  for row in range(16):
    ex = task.sft_example(row)
    text = TOK.decode(b.inputs_BxL[row])
    assert int(ex.answer) == ex.a * ex.b
    trained = "".join(TOK.decode([t]) if m else "_" for t, m in zip(
        b.targets_BxL[row], b.mask_BxL[row]))
    if ex.tool_demo:
      demos += 1
      call = f"[calc {ex.a}*{ex.b}]"
      assert text == f"{ex.a}*{ex.b}={call}({ex.answer}){ex.answer}"
      assert trained.strip("_") == (
          call + "_" * (len(ex.answer) + 2) + ex.answer)
    else:
      assert text == f"{ex.a}*{ex.b}={ex.answer}"
      assert trained.strip("_") == ex.answer
  assert 3 <= demos <= 13
  got = verifiable.arithmetic_correct(
      ["12*34=", "12*34=", "12*34=", "5+6="],
      ["[calc 12*34](408)408", "408", "[calc 12*34](408)407", "11"],
      [{"reverse_answer": False}] * 4)
  assert got == [1.0, 1.0, 0.0, 1.0]


# ---------------------------------------------------------- config checks
@pytest.mark.parametrize("key,value,match", [
    ("rollout.workers.num", 2, "workers"),
    ("agent.format", "json", "agent.format"),
    ("agent.tools", ("calc", "abacus"), "unknown tool 'abacus'"),
    ("agent.agent_fn", "configs.tiny_agent_api", "agent_fn.*module:function"),
    ("agent.agent_fn", "configs.tiny_agent_api:nothing",
     "agent_fn.*cannot load it"),
    ("agent.agent_cmd", " ", "agent_cmd.*empty command line"),
    ("agent.agent_timeout_s", 0.0, "agent_timeout_s.*> 0"),
    ("agent.python_timeout_s", 0.0, "python_timeout_s.*> 0"),
])
def test_agent_config_errors_name_the_key(key, value, match):
  c = resume.override(tiny_tool.get_config("runlocal"), **{key: value})
  with pytest.raises(ConfigError, match=match):
    job = RLJob.from_config(c)
    checks.check_rl_job(job, job="grpo", prompt_len=7, num_devices=8)
    from rlhf_jax.envs import episodes  # The tools are made at build.
    episodes.from_config(job.agent, TOK)


def test_an_agent_is_a_function_or_a_program_not_both():
  from configs import tiny_agent_api
  c = resume.override(tiny_agent_api.get_config("runlocal"),
                      **{"agent.agent_cmd": "python agent.py"})
  with pytest.raises(ConfigError, match="agent_fn or agent_cmd, not both"):
    RLJob.from_config(c)


# ------------------------------------------------------ kill and resume
def _records(workdir):
  return {s: {k: v for k, v in r.items()
              if not k.startswith("perf/") and k not in (
                  "phase", "rollout/replayed_answers")}
          for s, r in resume.rl_records(workdir).items()}


@pytest.mark.slow
def test_sigkill_mid_episode_then_rerun_equals_uninterrupted(tmp_path):
  """SIGKILL while step 3's episodes are under way (its tool answers are
  being logged; the last checkpoint is step 2); the rerun replays the
  logged answers and writes the uninterrupted run's metrics."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def cmd(workdir):
    return [sys.executable, "-m", "rlhf_jax.main",
            "--config=configs/tiny_tool.py:runlocal", f"--workdir={workdir}",
            "--config.train.steps=4"]

  reference = str(tmp_path / "reference")
  out = subprocess.run(cmd(reference), cwd=resume.REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(cmd(workdir), cwd=resume.REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  log = os.path.join(workdir, "episodes", "step_3.p0.jsonl")
  deadline = time.time() + 300
  while proc.poll() is None and not (
      os.path.exists(log) and os.path.getsize(log) > 0):
    assert time.time() < deadline, "step 3 never started its episodes"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", "4"))
  out = subprocess.run(cmd(workdir), cwd=resume.REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from step" in out.stderr
  resumed, want = _records(workdir), _records(reference)
  assert sorted(resumed) == sorted(want) == list(range(5))
  for step in (3, 4):
    assert resumed[step] == pytest.approx(want[step], rel=1e-6), step
  assert resume.rl_records(workdir)[3]["rollout/replayed_answers"] >= 1


# ------------------------------------------------------ the long-tail path
@pytest.mark.slow
def test_episodes_on_the_long_tail_path_equal_plain_continuous_batching():
  """configs/tiny_tool.py:runlocal with the long-tail policies (length-
  aware placement, tail consolidation moving live episodes) samples the
  same trajectories as plain continuous batching on the paged engine."""
  from rlhf_jax.rollout.base import generate
  from rlhf_jax.rollout.local import LocalRollout
  from rlhf_jax.trainers import rl_job

  c = tiny_tool.get_config("runlocal")
  c.rollout.long_tail.update(enabled=True, consolidate_below=0.6)
  job = rl_job.build(c)
  ours = job.sampler
  ours.episodes.make_env = LengthEnv  # Answers any turn, twice.
  plain = LocalRollout(ours.engines, episodes=Episodes(
      LengthEnv, TOK, TaggedFormat(), max_turns=4))
  params = job.colocation.rollout_copy(job.params)
  prompts = next(job.iterator)
  got = {}
  for name, rollout in (("ours", ours), ("plain", plain)):
    rollout.set_weights(params, 0)
    got[name] = generate(rollout, prompts, c.rollout.samples_per_row, seed=3,
                         step=1)
  a, b = got["ours"], got["plain"]
  assert [s.key for s in a.samples] == [s.key for s in b.samples]
  for x, y in zip(a.samples, b.samples):
    assert (x.tokens, x.env_mask, x.finish_reason) == (
        y.tokens, y.env_mask, y.finish_reason), x.key
    np.testing.assert_allclose(x.logp_raw, y.logp_raw, atol=1e-5)
  assert a.metrics["rollout/consolidations"] >= 1
  assert a.metrics["rollout/turns_per_episode"] == b.metrics[
      "rollout/turns_per_episode"] > 1.2
