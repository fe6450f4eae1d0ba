"""Async GRPO: eta = 0 is the synchronous job, no sample is staler than
eta, kill -9 and rerun reproduce the uninterrupted run, bad combinations
are refused in one line."""

import os
import signal
import subprocess
import sys
import time

import math
import types

import numpy as np
import pytest

import fakes
import resume
from configs import tiny_grpo, tiny_grpo_async
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob
from rlhf_jax.sched import staleness
from rlhf_jax.trainers import rl_job
from rlhf_jax.trainers import async_split

STEPS = {"train.steps": 6, "eval.every": 3, "train.checkpoint_every": 2}


def _async_config(**extra):
  return resume.override(tiny_grpo_async.get_config("runlocal"),
                         **{**STEPS, **extra})


def _records(workdir):
  return {k[1]: v for k, v in resume.records(workdir).items()
          if k[0] == "rl"}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
  """eta = 1 on 8 devices: the rollout on 4, the trainer on 4."""
  workdir = str(tmp_path_factory.mktemp("async"))
  rl_job.run(_async_config(), workdir)
  return workdir


@pytest.mark.slow  # A whole job (7 steps): 49.7 s alone on 2 cores.
def test_no_sample_is_staler_than_eta(async_run):
  records = _records(async_run)
  assert sorted(records) == list(range(7))
  for step in range(1, 7):
    r = records[step]
    assert r["async/staleness_max"] <= 1, (step, r)
    assert r["rollout/stale_dropped"] == 0
    assert r["rollout/mismatch_alarm"] == 0
    assert r["rollout/weight_version"] == step - 1
  # Not vacuous: from step 2 on, part of each batch is one version old
  # (drawn before the trainer's last update, finished after it).
  for step in range(2, 7):
    assert records[step]["async/off_policy_samples"] > 0, step
    assert records[step]["async/switches"] == 1, step
  assert records[1]["async/staleness_max"] == 0  # Version 0 only.
  assert records[6]["rollout/reward_mean"] > 0


@pytest.mark.slow
def test_sigkill_then_rerun_reproduces_the_uninterrupted_run(async_run,
                                                             tmp_path):
  """Killed once the step-2 checkpoint (with batches 3 and 4 in flight) is
  down; the rerun continues from it and writes the same records."""
  workdir = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "rlhf_jax.main",
         "--config=configs/tiny_grpo_async.py:runlocal",
         f"--workdir={workdir}"] + [f"--config.{k}={v}"
                                    for k, v in STEPS.items()]
  proc = subprocess.Popen(cmd, cwd=resume.REPO, env=env,
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not resume.has_record(workdir, "rl", 3) and proc.poll() is None:
    assert time.time() < deadline, "no step 3"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", "6"))
  out = subprocess.run(cmd, cwd=resume.REPO, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from step" in out.stderr
  resumed, reference = _records(workdir), _records(async_run)
  assert sorted(resumed) == list(range(7))
  for step in range(3, 7):
    assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step


@pytest.mark.slow
def test_eta_zero_equals_the_synchronous_job(tmp_path):
  """eta = 0: batch b waits for version b - 1, as the synchronous job
  does. Both warm-start on all 8 devices; the synchronous job then decodes
  and trains on all 8, the async one on 4 each: the same samples (rewards,
  lengths) and the same updates to fp32 rounding."""
  steps = {"train.steps": 4, "eval.every": 2}
  sync = resume.override(tiny_grpo.get_config("runlocal"), **steps)
  sync.rl.importance_weight = "tis"
  rl_job.run(sync, str(tmp_path / "sync"))
  rl_job.run(_async_config(**steps, **{"asynchronous.max_staleness": 0}),
           str(tmp_path / "async"))
  a, b = _records(str(tmp_path / "async")), _records(str(tmp_path / "sync"))
  for step in range(1, 5):
    assert a[step]["async/staleness_max"] == 0
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/kl"):
      assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]) \
          + 1e-6, (step, key, a[step][key], b[step][key])
  assert a[4]["eval/accuracy"] == b[4]["eval/accuracy"]
  assert all(b[s]["train/grad_norm"] > 1e-3 for s in range(1, 5))


@pytest.mark.slow
def test_eta_zero_with_dynamic_sampling_equals_the_synchronous_job(tmp_path):
  """DAPO's dynamic sampling (up to 3 rounds a step): at eta = 0 the async
  rollout's thread refills each batch on the step's weights from the same
  stream, so the rounds, the groups kept, their samples and the updates
  are the synchronous job's (`rollout/dynamic_sampling.collect`)."""
  steps = {"train.steps": 3, "eval.every": 3, "rl.dynamic_sampling": True,
           "rl.dynamic_max_rounds": 3}
  sync = resume.override(tiny_grpo.get_config("runlocal"), **steps)
  sync.rl.importance_weight = "tis"
  rl_job.run(sync, str(tmp_path / "sync"))
  rl_job.run(_async_config(**steps, **{"asynchronous.max_staleness": 0}),
             str(tmp_path / "async"))
  a, b = _records(str(tmp_path / "async")), _records(str(tmp_path / "sync"))
  for step in range(1, 4):
    assert a[step]["async/staleness_max"] == 0
    for key in ("rollout/sampling_rounds", "rollout/informative_groups",
                "rollout/informative_frac", "rollout/reward_mean",
                "rollout/response_len_mean"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("rewards/addition", "rewards/digit_accuracy"):  # Summed
      # over the rounds' groups in another order.
      assert a[step][key] == pytest.approx(b[step][key], rel=1e-12), key
    for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/kl"):
      assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]) \
          + 1e-6, (step, key, a[step][key], b[step][key])
  # Not vacuous: a step refilled (constant groups set aside).
  assert max(b[s]["rollout/sampling_rounds"] for s in range(1, 4)) >= 2
  assert min(b[s]["rollout/informative_frac"] for s in range(1, 4)) < 1
  assert a[3]["eval/accuracy"] == b[3]["eval/accuracy"]


@pytest.mark.slow
def test_eta_zero_on_workers_equals_the_synchronous_job_on_workers(tmp_path):
  """Elastic workers as the async rollout (2 in-process workers; the
  trainer keeps all 8 devices): at eta = 0 the same samples and updates
  as the synchronous job whose rollout runs on the same workers."""
  steps = {"train.steps": 3, "eval.every": 3}
  workers = dict(num=2, theta=2, poll_steps=2)
  sync = resume.override(tiny_grpo.get_config("runlocal"), **steps)
  sync.rl.importance_weight = "tis"
  sync.rollout.workers.update(**workers)
  rl_job.run(sync, str(tmp_path / "sync"))
  c = _async_config(**steps, **{"asynchronous.max_staleness": 0})
  c.rollout.workers.update(**workers)
  rl_job.run(c, str(tmp_path / "async"))
  a, b = _records(str(tmp_path / "async")), _records(str(tmp_path / "sync"))
  for step in range(1, 4):
    assert a[step]["async/staleness_max"] == 0
    assert a[step]["workers/alive"] == b[step]["workers/alive"] == 2
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("train/loss", "train/kl", "train/grad_norm"):
      assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]) \
          + 1e-6, (step, key, a[step][key], b[step][key])
  assert a[3]["eval/accuracy"] == b[3]["eval/accuracy"]


@pytest.mark.slow
def test_eta_zero_with_a_common_prefix_equals_the_synchronous_job(tmp_path):
  """configs/gsm8k_grpo.py:runlocal (a ChatML system turn in front of
  every prompt, stored once): at eta = 0 async RL stores the prefix the
  synchronous job stores and gives its samples and updates."""
  from configs import gsm8k_grpo
  from rlhf_jax import typed_config
  from rlhf_jax.config import sections
  from rlhf_jax.data import sources

  def config(asynchronous, workdir):
    c = sources.prepare(gsm8k_grpo.get_config("runlocal"), workdir)
    c = resume.override(c, **{"train.steps": 3, "eval.every": 3})
    c.rl.importance_weight = "tis"
    if asynchronous:
      c.asynchronous = typed_config.config_dict(
          sections.Async, enabled=True, max_staleness=0,
          switch_after_groups=0)
    return c

  for name in ("sync", "async"):
    workdir = str(tmp_path / name)
    rl_job.run(config(name == "async", workdir), workdir)
  a, b = _records(str(tmp_path / "async")), _records(str(tmp_path / "sync"))
  for step in range(1, 4):
    assert a[step]["async/staleness_max"] == 0
    assert a[step]["rollout/common_prefix_len"] == b[step][
        "rollout/common_prefix_len"] >= 16
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("train/loss", "train/kl", "train/grad_norm"):
      assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]) \
          + 1e-6, (step, key, a[step][key], b[step][key])
  assert all(b[s]["train/grad_norm"] > 1e-3 for s in range(1, 4))


@pytest.mark.parametrize("key,value,message", [
    ("rl.stream", True, "with config.rl.stream: not implemented"),
    ("asynchronous.rollout_devices", 8, "the rollout takes 8 of 8 devices"),
])
def test_config_errors(key, value, message):
  c = _async_config(**{key: value})
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    checks.check_rl_job(RLJob.from_config(c), job="grpo", prompt_len=8,
                        num_devices=8)


@pytest.mark.parametrize("a,b,n,m", [(3.0, 1.0, 8, 1), (1.0, 3.0, 64, 2),
                                     (5.0, 2.0, 64, 8), (1.0, 1.0, 16, 4)])
def test_rollout_split_balances_the_two_parts(a, b, n, m):
  """Rollout a / r seconds, training b / (n - r): the two balance at
  r* = n a / (a + b); the rule picks the better multiple of m beside it."""
  rollout_s, train_s = (lambda r: a / r), (lambda t: b / t)
  r_star = n * a / (a + b)
  beside = {max(m, m * math.floor(r_star / m)),
            min(n - m, m * math.ceil(r_star / m))}
  want = min(beside, key=lambda r: (max(rollout_s(r), train_s(n - r)), r))
  assert staleness.rollout_split(range(m, n, m), n, rollout_s,
                                 train_s) == want


def test_cost_model_split_builds_the_job():
  """rollout_devices=-1: the job builds with the split the cost model
  gives, the rollout on its devices and the trainer on the rest; an
  unknown device kind is refused in one line."""
  c = _async_config(**{"asynchronous.rollout_devices": -1})
  job = rl_job.build(c)
  r = job.c.asynchronous.rollout_devices
  assert 0 < r < 8
  assert job.rollout.layout.mesh.devices.size == r
  assert job.train_layout.mesh.devices.size == 8 - r
  odd = types.SimpleNamespace(platform="gpu", device_kind="Mystery X1")
  with pytest.raises(ConfigError, match="no hardware profile for device "
                     "kind 'Mystery X1'"):
    async_split.with_cost_model_split(job.c, job.cfg, [odd] * 8, 8)


def test_workers_as_the_rollout_keep_the_whole_mesh_for_training():
  """With elastic workers decoding, the trainer's batch checks count all 8
  devices (no split), and the seed window, which decodes on the trainer's
  devices, is refused in one line."""
  c = _async_config()
  c.rollout.workers.update(num=2)
  checks.check_rl_job(RLJob.from_config(c), job="grpo", prompt_len=8,
                      num_devices=8)
  c.rollout.workers.update(seed=True)
  with pytest.raises(ConfigError, match=r"rollout.workers.seed: not "
                     r"implemented \(the trainer's devices only train\)"):
    checks.check_rl_job(RLJob.from_config(c), job="grpo", prompt_len=8,
                        num_devices=8)


# ---- [algos]: staleness does not bias training toward short responses.
# Discard-and-requeue of stale samples trains short responses more often:
# the long samples span more weight switches, so they are the stale ones.
# Here a batch is drawn only within eta and its unfinished samples go on at
# a switch ("continue": tokens kept, KV recomputed; "restart": their tokens
# dropped and sampled again), so the drop rule (`keep_mask`, through
# `Asynchronous.trainable`) has nothing to drop.
LENGTH_STEPS = 6


def _lengths_run(eta: int, in_flight: str = "continue"):
  """({(step, prompt, sample): (response length, versions its tokens
  span, kept)}, the async metrics summed over steps) of the async step
  rollout over LENGTH_STEPS steps, driven as the RL step drives it
  (to_rollout, groups, trainable, end_step) with the initial weights
  published as every version: the sampled tokens then depend on neither
  eta nor the switches (placement-independent sampling); the versions
  do."""
  from rlhf_jax.trainers.rl_job import build
  c = _async_config(**{
      "asynchronous.max_staleness": eta, "asynchronous.in_flight": in_flight,
      "asynchronous.switch_after_groups": 1, "sft.steps": 0,
      "train.steps": LENGTH_STEPS, "train.prompts_per_step": 4,
      "rollout.samples_per_row": 4,
      # Long enough that a random model's lengths spread: <eos> ends some
      # samples after a few tokens, others reach the cap.
      "rollout.max_new_tokens": 24, "rollout.max_seq_len": 40})
  job = build(c)
  ro = job.rollout
  states = fakes.first_states(job)
  ro.start(0, states, {})
  rows, totals = {}, {}
  try:
    for step in range(1, LENGTH_STEPS + 1):
      weights = ro.to_rollout(states, step)
      samples = [s for g in ro.groups(step, None) for s in g.samples]
      keep, _ = ro.trainable(samples, weights.version)
      for k, v in ro.end_step().items():
        totals[k] = totals.get(k, 0.0) + v
      for s, kept in zip(samples, keep):
        rows[step, s.prompt_id, s.sample_idx] = (
            len(s.tokens), max(s.token_versions) - min(s.token_versions),
            bool(kept))
  finally:
    ro.close()
  return rows, totals


def _mean(values) -> float:
  values = list(values)
  return sum(values) / len(values)


@pytest.fixture(scope="module")
def synchronous_lengths():
  return _lengths_run(eta=0)[0]


def test_staleness_does_not_shorten_the_trained_responses(
    synchronous_lengths):
  """eta = 2 with the drop rule: on a workload where the long samples are
  the stale ones (shown first: the samples whose tokens span a weight
  switch are longer than those that do not), the mean trained response
  length is within 5 % of eta = 0's; training only the samples that span
  no switch (what discarding stale samples does) shortens it by more."""
  rows, totals = _lengths_run(eta=2)
  assert sorted(rows) == sorted(synchronous_lengths)
  assert totals["async/staleness_max"] > 0  # Samples of older weights.
  spanning = [n for n, span, _ in rows.values() if span > 0]
  within = [n for n, span, _ in rows.values() if span == 0]
  assert len(spanning) >= 8 and len(within) >= 8, (len(spanning),
                                                   len(within))
  assert _mean(spanning) > 1.2 * _mean(within), (_mean(spanning),
                                                 _mean(within))
  sync_mean = _mean(n for n, _, kept in synchronous_lengths.values()
                    if kept)
  ours = _mean(n for n, _, kept in rows.values() if kept)
  assert abs(ours - sync_mean) <= 0.05 * sync_mean, (ours, sync_mean)
  assert all(kept for _, _, kept in rows.values())  # Nothing dropped.
  # The check can fail: a discard of the stale samples trains shorter ones.
  assert _mean(within) < 0.95 * sync_mean, (_mean(within), sync_mean)


def test_restarted_samples_do_not_shorten_the_trained_responses(
    synchronous_lengths):
  """eta = 2 with `in_flight="restart"` (a cut sample's tokens are dropped
  and it is sampled again, a requeue): the mean trained response length is
  within 5 % of eta = 0's, restarts included."""
  rows, totals = _lengths_run(eta=2, in_flight="restart")
  assert totals["async/restarted_tokens"] > 0
  sync_mean = _mean(n for n, _, kept in synchronous_lengths.values()
                    if kept)
  ours = _mean(n for n, _, kept in rows.values() if kept)
  assert abs(ours - sync_mean) <= 0.05 * sync_mean, (ours, sync_mean)


def _prefixed_batches():
  """Batch b's 2 prompts: batches 1 and 2 share a 20-token prefix,
  batch 3 only its first 17 tokens, batch 4 nothing."""
  from rlhf_jax.samples import PromptBatch
  rng = np.random.default_rng(5)
  common = rng.integers(4, 64, 20).astype(np.int32)
  heads = {1: common, 2: common, 3: np.concatenate([common[:17], [0]]),
           4: np.zeros(0, np.int32)}
  for b in range(1, 5):
    # Own tokens start with 1 and 2: the prompts of a batch part there.
    rows = [np.concatenate([heads[b], [1 + i], rng.integers(4, 64, 3)])
            .astype(np.int32) for i in range(2)]
    width = max(len(r) for r in rows)
    yield PromptBatch(np.array([2 * b, 2 * b + 1], np.int32),
                      np.stack([np.pad(r, (0, width - len(r))) for r in rows]),
                      np.array([len(r) for r in rows], np.int32),
                      ["", ""], [{}, {}])


def test_async_rollout_stores_the_prefix_its_batches_share(tiny_model):
  """Async RL with `rollout.max_common_length`: the run stores the prefix
  its prompts share once; a batch that shares less reopens the run on a
  new driver storing that much (its in-flight samples recomputed), and
  the samples are those of a rollout storing none."""
  from rlhf_jax.engine.engine_set import EngineSet
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.rollout.asynchronous import AsyncRollout, PagedBackend
  import jax
  graphdef, params = tiny_model
  layout = fakes.rollout_layout8(2)
  params = jax.device_put(params, layout.param_shardings(params))

  class Recording(PagedBackend):
    def open(self, *args, common=None):  # What each driver's engine stores.
      driver = super().open(*args, common=common)
      self.stored.append(driver.engine.common_prefix_tokens.size)
      return driver

  out = {}
  for cap in (24, 0):
    backend = Recording(EngineSet(
        fakes.TINY_CFG, graphdef, layout, rows_per_replica=1,
        samples_per_row=2, prefill_buckets=(8, 32),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        max_common_length=cap,
        paged=dict(num_slots=4, page_size=4, num_pages=96)))
    backend.stored = []
    ar = AsyncRollout(backend, _prefixed_batches(), num_samples=2, seed=3,
                      eta=1, switch_after_groups=1, in_flight="continue",
                      last_step=4)
    ar.start(params, 0, first_step=1)
    try:
      batches = {}
      for step in range(1, 5):
        if step > 1:
          ar.publish(params, step - 1)
        batches[step] = ar.take(step).samples
    finally:
      ar.close()
    out[cap] = batches, backend.stored
  (stored_batches, stored), (plain_batches, plain) = out[24], out[0]
  assert set(plain) == {0}
  # Opened storing none; 20 from batch 1; 17 once batch 3 joins; none
  # once batch 4 does (each value in turn, switches keep the value).
  assert [n for i, n in enumerate(stored)
          if i == 0 or n != stored[i - 1]] == [0, 20, 17, 0], stored
  for step in range(1, 5):
    ours, theirs = stored_batches[step], plain_batches[step]
    assert [s.key for s in ours] == [s.key for s in theirs]
    for a, b in zip(ours, theirs):
      assert a.tokens == b.tokens, (step, a.key)
      np.testing.assert_allclose(a.logp, b.logp, atol=1e-5)
      assert a.token_versions == b.token_versions, (step, a.key)


def _prompt_stream(n: int = 2):
  """Batches of n prompts (ids 0, 1, 2, ... in stream order), without end."""
  from rlhf_jax.samples import PromptBatch
  rng = np.random.default_rng(11)
  for first in range(0, 10**6, n):
    rows = rng.integers(4, 64, (n, 5)).astype(np.int32)
    yield PromptBatch(np.arange(first, first + n, dtype=np.int32), rows,
                      np.full(n, 5, np.int32), [""] * n, [{}] * n)


class _FirstTokenScorer:
  """A host scorer (RewardScorer's interface): 1 where a sample's first
  token is a multiple of 4 (a group of 2 is informative 3 times in 8);
  every group scored goes into `scored` (copies share it)."""

  def __init__(self):
    self.scored = []
    self.reset()

  def reset(self):
    self.count = 0

  def score(self, group, prompts):
    del prompts
    rewards = np.array([float(s.tokens[0] % 4 == 0) for s in group],
                       np.float32)
    self.scored.append(([s.key for s in group], group[0].seed, rewards))
    self.count += len(group)
    return rewards

  def metrics(self):
    return {"rewards/scored": float(self.count)}


def _dynamic_rollout(tiny_model, stream, scorer, max_rounds):
  from rlhf_jax.engine.engine_set import EngineSet
  from rlhf_jax.engine.sampling import SamplingParams
  from rlhf_jax.rollout.asynchronous import AsyncRollout, PagedBackend
  from rlhf_jax.rollout.dynamic_sampling import Refill
  import jax
  graphdef, params = tiny_model
  layout = fakes.rollout_layout8(2)
  params = jax.device_put(params, layout.param_shardings(params))
  backend = PagedBackend(EngineSet(
      fakes.TINY_CFG, graphdef, layout, rows_per_replica=1,
      samples_per_row=2, prefill_buckets=(8,),
      sampling=SamplingParams(temperature=1.0, max_new_tokens=3),
      paged=dict(num_slots=8, page_size=4, num_pages=64)))
  return params, AsyncRollout(
      backend, stream, num_samples=2, seed=3, eta=1, switch_after_groups=1,
      in_flight="continue", last_step=6,
      refill=Refill(scorer, max_rounds))


def test_async_dynamic_sampling_refills_and_resumes_as_uninterrupted(
    tiny_model):
  """Async RL with DAPO's dynamic sampling (eta = 1): the rollout's thread
  scores each round as it finishes and refills a batch from the stream
  until it holds N informative groups, at most 2 rounds; each batch
  trains the first N informative groups its rounds gave, in order (the
  rest: a repeat, masked). Resumed from the snapshot of step 3's
  checkpoint (the iterator where it was; a batch's rounds in flight), the
  rollout gives the uninterrupted run's batches 4 to 6."""
  import json
  consumed, snap_step = [0], 3

  def counted(stream):
    for batch in stream:
      consumed[0] += 1
      yield batch

  scorer = _FirstTokenScorer()
  params, ar = _dynamic_rollout(tiny_model, counted(_prompt_stream()), scorer,
                                max_rounds=2)
  ar.start(params, 0, first_step=1)
  try:
    batches, snap = {}, None
    for step in range(1, 7):
      if step > 1 and step - 1 != snap_step:  # That one went with the snap.
        ar.publish(params, step - 1)
      batches[step] = ar.take(step)
      if step == snap_step:
        snap = json.loads(json.dumps(ar.publish(params, step, snapshot=True)))
        at_snapshot = consumed[0]
        ar.release()
  finally:
    ar.close()
  # Per batch, the groups scored for it in order (their seed says which).
  from rlhf_jax.rollout.base import step_seed
  rounds_seen = 0
  for step, batch in batches.items():
    pool = [(keys, r) for keys, seed, r in scorer.scored
            if seed == step_seed(3, step)]
    informative = [(keys, r) for keys, r in pool if r.max() > r.min()]
    assert len(pool) % 2 == 0 and 1 <= len(pool) // 2 <= 2, (step, len(pool))
    # Full once 2 are informative: no round past the one that filled it.
    assert len(informative) < 2 or len(
        [g for g in pool[:len(pool) - 2] if g[1].max() > g[1].min()]) < 2
    rounds_seen = max(rounds_seen, len(pool) // 2)
    got = [[s.key for s in batch.samples[i:i + 2]] for i in (0, 2)]
    for slot in range(2):
      if slot < len(informative):
        assert got[slot] == informative[slot][0], (step, slot)
        np.testing.assert_array_equal(batch.rewards[2 * slot:2 * slot + 2],
                                      informative[slot][1])
        assert batch.valid[2 * slot:2 * slot + 2].all()
      else:  # Out of rounds: a repeat of a kept group, not trained.
        assert not batch.valid[2 * slot:2 * slot + 2].any()
    assert batch.scored["rollout/sampling_rounds"] == len(pool) // 2
    assert batch.scored["rollout/informative_groups"] == min(
        len(informative), 2)
  # Not vacuous: some batch was refilled, one ran out of rounds.
  assert rounds_seen == 2
  assert any(not batch.valid.all() for batch in batches.values())
  # The snapshot caught a batch between rounds: one scored, one decoding.
  assert [len(p["rewards"]) for p in snap["pools"].values()] == [1], snap

  stream = _prompt_stream()
  for _ in range(at_snapshot):
    next(stream)
  params, resumed = _dynamic_rollout(tiny_model, stream, _FirstTokenScorer(),
                                     max_rounds=2)
  resumed.start(params, snap_step, first_step=snap_step + 1, snapshot=snap)
  try:
    for step in range(snap_step + 1, 7):
      if step > snap_step + 1:
        resumed.publish(params, step - 1)
      ours, theirs = resumed.take(step), batches[step]
      assert [s.key for s in ours.samples] == [
          s.key for s in theirs.samples], step
      for a, b in zip(ours.samples, theirs.samples):
        assert a.tokens == b.tokens and a.token_versions == b.token_versions
        np.testing.assert_allclose(a.logp, b.logp, atol=1e-5)
      np.testing.assert_array_equal(ours.rewards, theirs.rewards)
      np.testing.assert_array_equal(ours.valid, theirs.valid)
      assert ours.scored == theirs.scored, step
  finally:
    resumed.close()
