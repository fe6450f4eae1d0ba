"""[ppo] The PPO job end to end, its targets, the critic and config errors."""

import ast
import json

import numpy as np
import pytest

import resume
from configs import tiny_ppo, tiny_rm
from rlhf_jax.trainers import rl_job
from rlhf_jax.trainers import rm
from rlhf_jax.config import checks
from rlhf_jax.config.sections import ConfigError, RLJob


@pytest.fixture(scope="module")
def rm_workdir(tmp_path_factory):
  """A reward model from tiny_rm:runlocal (a few steps: only shapes matter)."""
  workdir = str(tmp_path_factory.mktemp("rm"))
  config = tiny_rm.get_config("runlocal")
  config.train.steps = 2
  config.eval.every = 2
  rm.run(config, workdir)
  return workdir


def _config(rm_workdir, **extra):
  return resume.override(
      tiny_ppo.get_config(f"runlocal,rm_workdir={rm_workdir}"), **extra)


_rl_records = resume.rl_records


@pytest.mark.slow
def test_runs_and_resumes_after_sigterm_as_if_uninterrupted(rm_workdir,
                                                            tmp_path):
  config = _config(rm_workdir, **{"train.steps": 3, "eval.every": 3})
  reference = str(tmp_path / "reference")
  rl_job.run(config, reference)
  first = _rl_records(reference)
  assert sorted(first) == [0, 1, 2, 3]
  step = first[3]
  for key in ("rollout/reward_mean", "rollout/kl", "train/loss",
              "critic/loss", "critic/value_error", "critic/vf_clip_frac",
              "train/clip_frac", "rewards/addition", "eval/reward_mean",
              "eval/accuracy"):
    assert np.isfinite(step[key]), key
  # The sampler and the learner agree on the log-probs of sampled tokens.
  assert step["rollout/logprob_gap"] < 1e-4

  # SIGTERM after step 1: the run checkpoints the step it is in and
  # stops; the rerun resumes there and writes the uninterrupted metrics.
  workdir = str(tmp_path / "run")
  with resume.SigtermWhen(lambda: resume.has_record(workdir, "rl", 1)
                          ) as sigterm:
    rl_job.run(config, workdir)
  assert sigterm.sent
  assert max(_rl_records(workdir)) < 3
  state = rl_job.run(config, workdir)
  assert int(state.step) == (config.train.steps * config.rl.ppo_epochs *
                             config.rl.num_minibatches)
  resume.assert_same_records(resume.records(workdir),
                             resume.records(reference))


@pytest.mark.slow
def test_lora_actor_and_critic_train_adapters_against_their_bases(
    rm_workdir, tmp_path):
  """PPO with LoRA (rank 4 on q and v): no reference copy is checkpointed,
  the reference is the actor's base (KL 0 until the adapters move), and
  the merged rollout samples what the actor scores. The critic starts as
  the reward model (B zero: the same values) and trains its adapters and
  value head only; a rerun resumes from the checkpoint."""
  config = _config(rm_workdir, **{"train.steps": 3, "eval.every": 3,
                                  "lora.rank": 4, "lora.alpha": 8.0,
                                  "lora.targets": ("q", "v"),
                                  "optim.learning_rate": 1e-2})
  job = rl_job.build(config)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 20, (8, 16)).astype(np.int32)
  batch = job.algorithm.actor.put_batch(dict(
      tokens=tokens, positions=np.tile(np.arange(16, dtype=np.int32), (8, 1)),
      attn_mask=np.arange(16)[None] < rng.integers(4, 17, 8)[:, None]))
  critic = job.algorithm.critic_init(job.algorithm.rm_params)
  np.testing.assert_allclose(job.algorithm.critic_heads.values(critic, batch),
                             job.algorithm.heads.values(job.algorithm.rm_params, batch),
                             rtol=1e-6, atol=1e-6)
  rl_job.run(config, str(tmp_path))
  records = _rl_records(str(tmp_path))
  assert records[1]["rollout/kl"] == 0.0
  assert records[3]["rollout/kl"] > 0.0
  for step in (1, 2, 3):
    assert records[step]["rollout/logprob_gap"] < 1e-4, step
  r = records[3]
  assert 2 * r["memory/trained_param_bytes"] <= r["memory/opt_state_bytes"]
  assert r["memory/opt_state_bytes"] <= 2 * r["memory/trained_param_bytes"] + 64
  assert r["memory/trained_param_bytes"] < r["memory/frozen_param_bytes"] / 20
  # The critic: adapters and the value head train; Adam's two moments.
  assert r["memory/critic_opt_state_bytes"] == pytest.approx(
      2 * r["memory/critic_trained_param_bytes"], abs=64)
  assert (r["memory/critic_trained_param_bytes"]
          < r["memory/critic_frozen_param_bytes"] / 20)
  assert np.isfinite(r["critic/loss"])
  # The checkpoint holds actor and critic, no reference copy.
  with open(tmp_path / "checkpoints" / "3" / "state" / "_METADATA") as f:
    saved = {ast.literal_eval(k)[0] for k in json.load(f)["tree_metadata"]}
  assert saved == {"actor", "critic"}
  # The checkpoint (adapters of both) restores, and the run goes on.
  rl_job.run(resume.override(config, **{"train.steps": 4}), str(tmp_path))
  assert max(_rl_records(str(tmp_path))) == 4


def test_missing_reward_model_names_the_command(tmp_path):
  config = _config(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="configs/tiny_rm.py"):
    rl_job.build(config)


def test_reward_model_of_another_answer_format_is_refused(rm_workdir):
  config = _config(rm_workdir, **{"task.reverse_answer": False})
  with pytest.raises(ConfigError, match="config.task.reverse_answer"):
    rl_job.build(config)


@pytest.mark.parametrize("key,value,message", [
    ("rl.gamma", 1.5, "config.rl.gamma"),
    ("rl.lam", -0.1, "config.rl.lam"),
    ("rl.value_clip", -1.0, "config.rl.value_clip"),
    ("rl.tracked_rewards", ("nope",), "config.rl.tracked_rewards"),
    ("critic.init", "random", "config.critic.init"),
    ("rl.policy_loss", "nope", "config.rl.policy_loss"),
    ("rl.advantage", "grpo", "config.rl.advantage='grpo': the PPO job"),
    ("rl.stream", True, "config.rl.stream is GRPO-only"),
    ("rl.share_prompt", True, "share_prompt=True needs packed rows"),
    ("rl.pack_length", 8, "shorter than one sequence"),
    ("train.prompts_per_step", 3, "data shards"),
])
def test_config_errors(key, value, message):
  c = _config("unused", **{key: value})
  with pytest.raises(ConfigError, match=message):
    checks.check_rl_job(RLJob.from_config(c), job="ppo", prompt_len=7,
                        num_devices=8)


def _critic_fixture():
  """A critic learner (clipped value loss, 2 micro-batches, 8 devices), its
  value head, its first state and one batch with fixed returns."""
  from rlhf_jax.data.tokenizer import CharTokenizer
  from rlhf_jax.models import reward_model
  from rlhf_jax.models.config import ModelConfig
  from rlhf_jax.parallel import mesh as mesh_lib
  from rlhf_jax.scoring.heads import ScalarHead
  from rlhf_jax.rl import objectives
  from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer

  cfg = ModelConfig.tiny(vocab_size=CharTokenizer().vocab_size, num_layers=1,
                         embed_dim=32, num_heads=2, num_kv_heads=1,
                         head_dim=16, mlp_dim=64)
  layout = mesh_lib.train_layout(mesh_lib.make_mesh(fsdp=-1))
  graphdef, params = reward_model.init_params(cfg, 0, layout)
  rng = np.random.default_rng(0)
  B, T = 16, 10
  tokens = rng.integers(3, 40, size=(B, T)).astype(np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 3:8] = 1
  arrays = dict(tokens=tokens,
                positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                attn_mask=np.ones((B, T), bool), loss_mask=loss_mask,
                returns=rng.normal(size=(B, T)).astype(np.float32) * loss_mask)
  terms, weight = objectives.value_terms(0.2)
  learner = Learner(graphdef, layout, make_optimizer(OptimConfig(
      learning_rate=1e-2)), terms_fn=terms, weight_fn=weight, micro_batches=2)
  return (learner, ScalarHead(graphdef, layout), learner.init_state(params),
          learner.put_batch(arrays))


def test_critic_fits_returns():
  """Critic updates (clipped value loss, micro-batched, 8 devices) on one
  batch cut the value error against fixed returns."""
  import jax

  learner, heads, state, batch = _critic_fixture()
  errors = []
  for _ in range(30):
    # Fresh old values each update (one PPO step per update): the clip
    # bounds the move of each update, not the total.
    batch = {**batch, "old_values": heads.values(state.params, batch)}
    state, m = learner.step(state, batch)
    errors.append(m["value_error"])
  errors = [float(e) for e in jax.device_get(errors)]
  assert errors[-1] < 0.5 * errors[0], errors


def test_learner_logs_extremes_and_means_over_micro_batches():
  """An update's aux metrics over its micro-batches (the strided rows
  `split_micro` takes): "*_min" is the least, "*_max" the most, any other
  the mean; the step's metrics over its updates keep the same rule."""
  import jax.numpy as jnp
  from rlhf_jax import metrics as metrics_lib
  from rlhf_jax.rl.learner import Learner

  import jax
  learner, heads, state, batch = _critic_fixture()
  value_terms = learner.terms_fn

  def terms(graphdef, params, mb):
    num, aux = value_terms(graphdef, params, mb)
    first = mb["tokens"][:, 0].astype(jnp.float32)
    return num, {**aux, "first_min": jnp.min(first),
                 "first_max": jnp.max(first), "first": jnp.mean(first)}

  probe = Learner(learner.graphdef, learner.layout, learner.optimizer,
                  terms_fn=terms, weight_fn=learner.weight_fn,
                  micro_batches=2)
  batch = {**batch, "old_values": heads.values(state.params, batch)}
  _, m = probe.step(state, batch)
  first = np.asarray(jax.device_get(batch["tokens"]))[:, 0].astype(float)
  per_micro = [first[u::2] for u in range(2)]  # split_micro's rows.
  assert len({x.min() for x in per_micro}) == 2  # Else it shows nothing.
  assert float(m["first_min"]) == min(x.min() for x in per_micro)
  assert float(m["first_max"]) == max(x.max() for x in per_micro)
  np.testing.assert_allclose(float(m["first"]),
                             np.mean([x.mean() for x in per_micro]),
                             rtol=1e-6)
  updates = [{"first_min": 3.0, "first_max": 5.0, "first": 4.0},
             {"first_min": 1.0, "first_max": 9.0, "first": 6.0}]
  logged = metrics_lib.rl_step_metrics(
      {"rewards": np.ones(2), "kl": np.zeros(2), "response_len": np.ones(2),
       "positions": 4, "real_positions": 4, "gap_max": 0.0, "gap_mean": 0.0,
       "mismatch_kl": 0.0}, {"train": updates}, {"perf/step_s": 1.0},
      version=0, stale=0, step=1, alarm_kl=0.0)
  assert (logged["train/first_min"], logged["train/first_max"],
          logged["train/first"]) == (1.0, 9.0, 5.0)


def test_learner_paces_every_pass():
  """Every update, gradient sum and apply hands one output of its own pass
  to the learner's Pacer (whose bound tests/parallel/test_pacing.py checks with fake
  markers).

  This replaces a test that counted unfinished outputs of real passes: on CPU
  a launch on 8 sharded fake devices returns only after most of its run, so
  fewer than MAX_AHEAD were ever pending, with or without the Pacer (it could
  not fail; tests_audit.md defect 3)."""
  from rlhf_jax.parallel import pacing
  from rlhf_jax.rl.learner import MAX_AHEAD

  learner, heads, state, batch = _critic_fixture()
  batch = {**batch, "old_values": heads.values(state.params, batch)}
  assert isinstance(learner._pacer, pacing.Pacer)
  assert learner._pacer.max_ahead == MAX_AHEAD
  seen = []
  real = learner._pacer.dispatched
  learner._pacer.dispatched = lambda marker: (seen.append(marker),
                                               real(marker))
  state, m = learner.step(state, batch)
  grads, loss_sum, aux_sum, weight = learner.grad_sums(state.params, batch)
  state, m2 = learner.apply(state, grads, loss_sum, aux_sum, weight, 1)
  # The markers are these passes' own outputs, in dispatch order.
  assert [id(x) for x in seen] == [id(m["loss"]), id(loss_sum),
                                   id(m2["loss"])]


def _batch(job, samples, keep, params, ref, critic_params, fused=None):
  """PPO's training batch of `samples` and its info (`PPO.batch`), the
  critic's values from `critic_params`."""
  import types
  return job.algorithm.batch(
      samples, None, keep, params, ref,
      states={"critic": types.SimpleNamespace(params=critic_params)},
      minibatches=job.c.rl.num_minibatches, fused=fused)


def test_long_tail_and_workers_equal_plain_ppo(rm_workdir):
  """PPO's rollout is the same seam as GRPO's: tiny_ppo with
  `rollout.long_tail.enabled=True` (consolidating the tail), and with 2
  elastic workers, each gives the plain step's rewards, KL, returns and
  losses (the same samples)."""
  import fakes
  from rlhf_jax.rollout import build as rollout_build

  job = rl_job.build(_config(rm_workdir))
  prompts = next(job.source.iterator)

  def rollout_of(c):  # The rollout a config builds, on the job's model.
    return rollout_build.build(
        RLJob.from_config(c).rollout, job.cfg, job.graphdef,
        job.rollout_layout, job.source.stop_ids)

  def step(rollout):
    return fakes.first_step(job, prompts, rollout)[1]

  long_tail = _config(rm_workdir, **{"rollout.num_rows": 16})  # 2 a replica.
  long_tail.rollout.long_tail.update(enabled=True, consolidate_below=1.0)
  workers = _config(rm_workdir)
  workers.rollout.workers.update(num=2, theta=2, poll_steps=2)
  plain = step(job.sampler)
  for name, c in (("long_tail", long_tail), ("workers", workers)):
    rollout = rollout_of(c)
    ours = step(rollout)
    rollout.close()
    for k in ("rollout/reward_mean", "rollout/kl", "rollout/return_mean",
              "train/loss", "train/grad_norm", "critic/loss"):
      np.testing.assert_allclose(ours[k], plain[k], rtol=1e-5,
                                 err_msg=f"{name}: {k}")
    if name == "long_tail":
      assert ours["rollout/consolidations"] >= 1
    else:
      assert ours["workers/tokens"] > 0 and ours["workers/alive"] == 2


def test_fused_scoring_equals_scoring_after_the_rollout(rm_workdir):
  """[fuse] tiny_ppo with the tail consolidated (R_t = 1, 2 rows a
  replica): the reward model, critic, policy and reference passes run on
  the freed replicas as samples finish. On the same samples they give the
  batch the passes after the rollout give (scores, old and reference
  log-probs, critic values, KL, advantages, returns; rtol 1e-5, entries
  near 0 to 1e-5 of the array's largest: whitening scales the float
  rounding of other shapes), every
  sample scored once; a whole PPO step gives the same losses, and its
  timeline has scoring spans on freed replicas while another decodes."""
  import jax

  import fakes
  from rlhf_jax.scoring import fused as fused_scoring
  from rlhf_jax.rollout.base import generate

  import dataclasses

  c = _config(rm_workdir, **{"rollout.num_rows": 16})
  c.rollout.long_tail.update(enabled=True, consolidate_below=1.0,
                             score_chunk=4)
  job = rl_job.build(c)
  assert job.fused is not None
  plain = dataclasses.replace(job, fused=None)  # Passes after the rollout.
  prompts = next(job.source.iterator)
  ref = jax.tree.map(lambda x: x * 1.05, job.params)
  critic = fakes.copy_tree(job.algorithm.rm_params)

  # The same samples, their batch built both ways.
  co = job.colocation
  rollout_params = co.to_rollout(fakes.copy_tree(job.params))
  job.sampler.set_weights(rollout_params, co.version)
  with fused_scoring.during(job.fused, job.sampler, policy=rollout_params,
                             ref=ref, rm=job.algorithm.rm_params,
                             critic=critic) as fused:
    sampled = generate(job.sampler, prompts, job.c.rollout.samples_per_row,
                       seed=5, freed=fused)
  samples = sampled.samples
  assert job.fused.scored == len(samples) == len(fused.scores)
  assert sorted(fused.scores) == sorted(s.key for s in samples)
  params = co.to_train(rollout_params)
  keep = np.ones(len(samples), bool)
  ours, ours_info = _batch(job, samples, keep, params, None, critic, fused)
  theirs, theirs_info = _batch(job, samples, keep, params, ref, critic)
  mask = np.asarray(theirs["loss_mask"])
  assert mask.sum() > 0
  def close(got, want, k):  # Entries near 0: to the array's scale.
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max(), err_msg=k)

  for k in ("old_logp", "ref_logp", "old_values", "advantages", "returns"):
    close(np.asarray(ours[k]) * mask, np.asarray(theirs[k]) * mask, k)
  for k in ("rewards", "kl"):  # The means of the arrays above: not again.
    close(ours_info[k], theirs_info[k], k)

  # Whole steps from the same states.
  def step(job):
    return fakes.first_step(job, prompts, states={
        "actor": job.algorithm.actor.init_state(fakes.copy_tree(params)),
        "critic": job.algorithm.critic.init_state(fakes.copy_tree(critic)),
        "ref": ref})[1]

  mine, base = step(job), step(plain)
  for k in ("rollout/reward_mean", "rollout/kl", "rollout/return_mean",
            "rollout/value_mean", "train/loss", "train/grad_norm",
            "critic/loss"):  # Means of differences: atol for cancellation.
    np.testing.assert_allclose(mine[k], base[k], rtol=1e-5, atol=1e-6,
                               err_msg=k)
  assert mine["rollout/consolidations"] >= 1
  fractions = {k: v for k, v in mine.items()
               if k.startswith("perf/device_fraction/")}
  assert sum(fractions.values()) == pytest.approx(1.0)
  assert fractions["perf/device_fraction/scoring"] > 0
  assert mine["rollout/scoring_chunks"] >= len(samples) // 8
  spans = job.clock.timeline.step_spans(1)
  decode = [s for s in spans if s.phase == "rollout"
            and s.group.startswith("replica")]
  overlapped = [s for s in spans if s.phase == "scoring"
                and s.group.startswith("replica") and any(
                    d.group != s.group and d.start < s.start < d.end
                    for d in decode)]
  assert overlapped, [(s.group, s.phase, s.start, s.end) for s in spans]


def test_packed_rows_equal_the_padded_step(rm_workdir):
  """`rl.pack_length`: the batch in packed rows (several sequences a row,
  padding neither computed nor trained; GAE restarts at each sequence),
  with shared prompts (a response's first cell directly follows its
  sibling's last one, so only `seq` tells them apart), and without them
  fused into the consolidated tail, gives the padded step's returns, values, KL, losses
  and gradient norms (one update on the whole batch, so both train on the
  same tokens)."""

  import jax

  import fakes

  def config(**extra):
    return _config(rm_workdir, **{"rl.ppo_epochs": 1,
                                  "rl.num_minibatches": 1, **extra})

  plain = rl_job.build(config())
  prompts = next(plain.source.iterator)
  ref = jax.tree.map(lambda x: x * 1.05, plain.params)

  def step(job, rollout=None):
    return fakes.first_step(job, prompts, rollout, states={
        "actor": job.algorithm.actor.init_state(
            fakes.copy_tree(plain.params)),
        "critic": job.algorithm.critic.init_state(
            fakes.copy_tree(plain.algorithm.rm_params)),
        "ref": ref})[1]

  fused = config(**{"rl.pack_length": 32, "rollout.num_rows": 16})
  fused.rollout.long_tail.update(enabled=True, consolidate_below=1.0,
                                 score_chunk=4)
  variants = {
      "shared_prompts": config(**{"rl.pack_length": 32,
                                  "rl.share_prompt": True}),
      "fused": fused}
  seen = fakes.capture_samples(plain)
  want = step(plain)
  # Shared prompts change the train side only: that step replays the plain
  # step's samples. The fused one decodes for itself (its scoring runs in
  # the rollout).
  replayed = {"shared_prompts": fakes.ScriptedRollout(
      fakes.ScriptedRollout.recorded(seen[0].samples))}
  jobs = {}
  for name, c in variants.items():
    job = jobs[name] = rl_job.build(c)
    assert (job.fused is not None) == (name == "fused")
    got = step(job, replayed.get(name))
    for k in ("rollout/reward_mean", "rollout/kl", "rollout/return_mean",
              "rollout/value_mean", "train/loss", "train/grad_norm",
              "critic/loss", "critic/value_error"):
      np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6,
                                 err_msg=f"{name}: {k}")
    if name == "fused":
      assert got["rollout/scoring_chunks"] >= 1
  # The packed batch: rows of several sequences, fewer cells than padded.
  from rlhf_jax.rollout.base import generate
  co = plain.colocation
  rollout_params = co.to_rollout(fakes.copy_tree(plain.params))
  plain.sampler.set_weights(rollout_params, co.version)
  samples = generate(plain.sampler, prompts, plain.c.rollout.samples_per_row,
                     seed=5).samples
  params, keep = co.to_train(rollout_params), np.ones(len(samples), bool)
  keep[3] = False  # Left out of the rows, yet scored.
  packed, packed_info = _batch(jobs["shared_prompts"], samples, keep,
                                params, ref, plain.algorithm.rm_params)
  padded, padded_info = _batch(plain, samples, keep, params, ref,
                               plain.algorithm.rm_params)
  # The reward model reads packed rows too, each sequence to its last token.
  np.testing.assert_allclose(packed_info["rewards"], padded_info["rewards"],
                             rtol=1e-5, atol=1e-6)
  assert np.ptp(np.asarray(padded_info["rewards"])) > 1e-4
  assert "seg" in packed and "seg" not in padded
  assert packed["tokens"].size < padded["tokens"].size
  assert float(np.sum(packed["loss_mask"])) == float(
      np.sum(padded["loss_mask"]))


@pytest.mark.slow
def test_moe_actor_replays_the_samplers_experts(rm_workdir, tmp_path):
  """[r3] in PPO: tiny_ppo with configs/tiny_grpo_moe.py's policy (8
  experts, top 2, split over 2 devices) computing in bf16, and
  `rl.routing_replay`. The batch carries the sampler's experts; the
  ADVANTAGES stage's log-probs replay them (never more mismatch than the
  trainer's own routing, and less where the router flips a choice) and
  the actor's update replays them (`train/moe_flip_rate` is counted only
  over replayed tokens); the critic and reward model route nothing."""
  from configs import tiny_grpo_moe
  c = _config(rm_workdir, **{"train.steps": 2, "eval.every": 2})
  moe = tiny_grpo_moe.get_config("runlocal")
  c.model = moe.model
  c.model.compute_dtype = "bfloat16"
  c.mesh.update(expert=moe.mesh.expert, rollout_expert=moe.mesh.rollout_expert)
  c.rl.routing_replay = True
  rl_job.run(c, str(tmp_path))
  records = _rl_records(str(tmp_path))
  flipped = updates_flipped = 0
  for step in (1, 2):
    r = records[step]
    assert r["rollout/mismatch_kl"] <= r["rollout/mismatch_kl_without_replay"]
    if r["rollout/moe_flip_rate"] > 0:
      flipped += 1
      assert 2 * r["rollout/mismatch_kl"] < r[
          "rollout/mismatch_kl_without_replay"], r
    # Counted only over replayed tokens: the update replayed.
    updates_flipped += r["train/moe_flip_rate"] > 0
    assert np.isfinite(r["critic/loss"]) and r["train/grad_norm"] > 0
  assert flipped >= 1  # Not vacuous: a flip to remove.
  assert updates_flipped >= 1


@pytest.mark.slow
def test_async_ppo_at_eta_zero_equals_the_synchronous_job(rm_workdir,
                                                          tmp_path):
  """Async PPO: the rollout decodes on half the devices, the actor, the
  critic and the reward model run on the other half. At eta = 0 (batch b
  waits for version b - 1) the same samples, scores and updates as the
  synchronous job on all 8, to fp32 rounding."""
  from rlhf_jax import typed_config
  from rlhf_jax.config import sections
  steps = {"train.steps": 2, "eval.every": 2}
  rl_job.run(_config(rm_workdir, **steps), str(tmp_path / "sync"))
  c = _config(rm_workdir, **steps)
  c.asynchronous = typed_config.config_dict(
      sections.Async, enabled=True, max_staleness=0, switch_after_groups=0)
  rl_job.run(c, str(tmp_path / "async"))
  a, b = (_rl_records(str(tmp_path / "async")),
          _rl_records(str(tmp_path / "sync")))
  for step in (1, 2):
    assert a[step]["async/staleness_max"] == 0
    assert a[step]["async/rollout_devices"] == 4
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("rollout/return_mean", "rollout/value_mean", "train/loss",
                "train/grad_norm", "critic/loss", "critic/value_error"):
      assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]) \
          + 1e-6, (step, key, a[step][key], b[step][key])
    assert b[step]["train/grad_norm"] > 1e-3 and b[step]["critic/loss"] > 0
  assert a[2]["eval/reward_mean"] == pytest.approx(b[2]["eval/reward_mean"],
                                                   rel=1e-5, abs=1e-6)
