"""The PPO step of `benchmarks.long_tail`: scoring fused into the tail or not.

Setting: the long-tail benchmark's trace, engines and `ours` rollout
policies (longest predicted first on the least-loaded replica,
consolidation at R_t with KV moves), with PPO's models: the policy, a
reference, a reward model and a critic (tiny scalar-head models). One PPO
step is the rollout, the passes (policy and reference log-probs of every
token, the reward model's score, the critic's values), the ADVANTAGES
stage (GAE) and one update of the actor and of the critic on the training
layout (FSDP over the 8 devices). The batch is built by the trainer's own
`trainers/ppo.PPO.batch` (`pack_length`, `--ppo_pack_length`: in packed
rows, `rl.pack_length`). Three modes on the same trace, the same
consolidation:

  unfused  the trainer without fusion: the passes over the whole batch
           [B, P + M] on the training layout, after the rollout;
  chunked  the fused passes' chunks (`scoring/passes.py`, `scoring/fused.py`: finished
           samples, each chunk cut to a power-of-two length), all after
           the rollout on every replica;
  fused    the same chunks dispatched as samples finish, on the replicas
           the consolidated tail frees (`rollout.long_tail.fusion`).

unfused -> fused is what the trainer's option changes; chunked -> fused is
the overlap alone (`chunked=False` leaves that mode out: `--quick`). The
rollout copy and the training params are separate arrays here (no
repartition in either mode). Idle fraction of the step:
`Timeline.device_seconds`, idle over all device-seconds of the step (the
controller's per-replica spans inside the rollout, where a replica with no
live sample that is not scoring is idle; the passes and the update after
it keep every device busy).
"""

from __future__ import annotations

import dataclasses
import statistics
import types

import numpy as np

from benchmarks import timing

MODES = ("unfused", "chunked", "fused")


class PPOStep:
  """The models, learners and one `LocalRollout` of the PPO modes."""

  def __init__(self, cfg, graphdef, layout, train, rollout, *, prompt_len,
               max_new, group_size, pack_length=0):
    import jax
    from rlhf_jax.config import sections
    from rlhf_jax.models import model as model_lib
    from rlhf_jax.models import reward_model
    from rlhf_jax.scoring.heads import ScalarHead
    from rlhf_jax.rl import objectives, prepare
    from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from rlhf_jax.scoring.passes import ScoringPasses

    self.rollout = rollout
    _, self.params = model_lib.init_params(cfg, 0, train)
    self.rollout_params = jax.device_put(
        model_lib.init_params(cfg, 0, train)[1],
        layout.param_shardings(self.params))
    _, self.ref = model_lib.init_params(cfg, 1, train)
    heads_graphdef, self.rm = reward_model.init_params(cfg, 2, train)
    _, critic = reward_model.init_params(cfg, 3, train)
    rl = sections.RL(advantage="gae", policy_loss="ppo", kl_coef=0.05,
                     kl_estimator="k1", kl_in_loss=False, share_prompt=False,
                     pack_length=pack_length)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-5))
    self.actor = objectives.policy_learner(
        graphdef, train, rl.policy_loss_config(max_len=max_new), optimizer,
        micro_batches=1)
    terms, weight = objectives.value_terms(0.2)
    self.critic = Learner(heads_graphdef, train, optimizer, terms_fn=terms,
                          weight_fn=weight, micro_batches=1)
    self.states = [self.actor.init_state(self.params),
                   self.critic.init_state(critic)]
    self.passes = ScoringPasses(
        graphdef, prompt_len=prompt_len, max_new=max_new,
        heads_graphdef=heads_graphdef, with_rm=True, with_critic=True,
        pack=pack_length > 0)
    # PPO (`trainers/ppo.py`) with what its `batch` reads, built here
    # without a reward-model workdir.
    from rlhf_jax.trainers.ppo import PPO
    heads = ScalarHead(heads_graphdef, train)
    self.ppo = object.__new__(PPO)
    self.ppo.__dict__.update(
        source=types.SimpleNamespace(prompt_len=prompt_len),
        c=types.SimpleNamespace(
            rl=rl, rollout=types.SimpleNamespace(
                max_new_tokens=max_new, samples_per_row=group_size),
            shared_prompt_group=0),  # rl.share_prompt=False.
        actor=self.actor,
        preparer=prepare.Preparer(self.actor, rl.advantage_config(
            group_size)),
        heads=heads, critic_heads=heads, rm_params=self.rm,
        fused=self.passes)
    self._tail = rollout.tail
    self.chunks: dict[str, list] = {}  # Each mode's last (chunk, layout)s.

  def step(self, mode: str, requests, step: int) -> dict:
    """One PPO step in `mode`; its wall seconds, phases and idle fraction."""
    import jax
    from rlhf_jax.parallel import submesh
    from rlhf_jax.scoring import fused as fused_scoring
    from rlhf_jax.rl.learner import train_epochs
    from rlhf_jax.timeline import device_group

    lt, tl = self.rollout, self.rollout.timeline
    lt.tail = dataclasses.replace(self._tail, fusion=mode == "fused")
    lt.set_weights(self.rollout_params, 0)
    t0 = tl.now()
    with fused_scoring.during(
        None if mode == "unfused" else self.passes, lt,
        policy=self.rollout_params, ref=self.ref, rm=self.rm,
        critic=self.states[1].params) as fused:
      samples = sorted(lt.run(requests, step=step, freed=fused),
                       key=lambda s: s.key)
    t1 = tl.now()
    if mode != "unfused":  # The passes ran; their chunks, for the fit.
      self.chunks[mode] = list(self.passes.dispatched)
    batch, info = self.ppo.batch(
        samples, None, np.ones(len(samples), bool), self.states[0].params,
        self.ref, states={"critic": self.states[1]}, minibatches=1,
        fused=fused)
    jax.block_until_ready(batch)
    t2 = tl.now()
    self.states, _ = train_epochs([self.actor, self.critic], self.states,
                                  batch, epochs=1, num_minibatches=1,
                                  seed=step)
    jax.block_until_ready(self.states)
    t3 = tl.now()
    devices = device_group("all", submesh.devices_of(lt.engines.layout))
    tl.add(devices, "rollout", t0, t1, step)
    tl.add(devices, "scoring", t1, t2, step)
    tl.add(devices, "train", t2, t3, step)
    device_s = tl.device_seconds(step)
    assert len(samples) == sum(r.num_samples for r in requests)
    return dict(wall_s=t3 - t0, rollout_s=t1 - t0, scoring_s=t2 - t1,
                train_s=t3 - t2,
                idle_fraction=device_s["idle"] / sum(device_s.values()),
                # No fused passes (unfused): no chunks.
                chunks=lt.metrics().get("rollout/scoring_chunks", 0),
                reward_mean=float(np.mean(jax.device_get(info["rewards"]))))


  def chunk_cost(self, requests):
    """(n, L) -> seconds of a chunk of n samples whose longest response
    has L tokens: a + b * n * Tc, fitted to the chunks of the last step
    of each mode that ran them (chunked, fused), each timed alone; Tc the
    chunk length of L after the mean prompt."""
    import jax
    from rlhf_jax.sched import tail as tail_rules
    self.passes.begin(policy=self.rollout_params, ref=self.ref, rm=self.rm,
                      critic=self.states[1].params)
    x, y = [], []
    for samples, layout in sum(self.chunks.values(), []):
      x.append(tail_rules.chunk_rows(len(samples), layout.mesh.shape["data"])
               * self.passes.chunk_length(samples))
      y.append(timing.median_time(
          lambda s=samples, l=layout: jax.tree.leaves(
              self.passes.score(s, l)), 3))
    self.passes.end()
    b, a = np.polyfit(x, y, 1)
    prompt = int(np.ceil(np.mean([len(r.tokens) for r in requests])))
    T = self.passes.prompt_len + self.passes.max_new

    def cost(n, longest):
      return a + b * n * min(T, 1 << (prompt + longest - 1).bit_length())
    return cost, dict(a=a, b=b, chunks=len(x))


def run(cfg, graphdef, layout, train, make_rollout, requests, *, prompt_len,
        max_new, group_size, repeats, sim_rollout, chunked=True,
        pack_length=0, warmup=True, log=print) -> dict:
  """Warm-up, then `repeats` PPO steps per mode, interleaved; the medians
  and paired ratios (unfused / fused of the same repeat); the simulator's
  step per mode: `sim_rollout(score_s, fusion)` (the row simulator's
  rollout with its chunks, `sim/rows.py`, at this run's unit costs) plus
  the measured phases after it. `make_rollout()` gives the `ours`
  rollout, its length history filled. Without `chunked`, unfused and
  fused only (no `fused_vs_chunked`, `chunked_vs_unfused`). `pack_length`:
  the training batch in packed rows of that many tokens (`rl.pack_length`)
  in every mode. `warmup=False` (`benchmarks.long_tail --smoke`): no
  warm-up steps and no reruns, the timed steps compile (their times mean
  nothing)."""
  modes = MODES if chunked else ("unfused", "fused")
  bench = PPOStep(cfg, graphdef, layout, train, make_rollout(),
                  prompt_len=prompt_len, max_new=max_new,
                  group_size=group_size, pack_length=pack_length)
  # One warm-up step per mode compiles every engine, move and chunk shape
  # it meets (`make_rollout`'s length history is already filled).
  for mode in modes if warmup else ():
    bench.step(mode, requests, step=100 + MODES.index(mode))
  # A fused chunk's program depends on which replicas the tail freed and
  # on the chunk's shape, so a timed step can still meet one the warm-up
  # did not: such a step is run again (at most twice) and counted, since
  # in a long run each program compiles once and the steady state is what
  # is compared.
  runs = {m: [] for m in modes}
  rerun = dict.fromkeys(modes, 0)
  step = 1000
  for i in range(repeats):
    for mode in modes:
      attempts = 3 if warmup else 1
      for attempt in range(attempts):
        step += 1
        with timing.count_compiles() as compiles:
          result = bench.step(mode, requests, step=step)
        if not compiles.n or attempt == attempts - 1:
          break
        rerun[mode] += 1
      runs[mode].append(result)
    log("  ppo repeat %d: %s" % (i + 1, ", ".join(
        f"{m} {v[-1]['wall_s']:.2f}s" for m, v in runs.items())))

  def paired(a, b):
    return statistics.median(x["wall_s"] / y["wall_s"]
                             for x, y in zip(runs[a], runs[b]))

  med = {m: {k: statistics.median(r[k] for r in v) for k in v[0]}
         for m, v in runs.items()}
  cost, fit = bench.chunk_cost(requests)
  for mode, m in med.items():
    m["sim_rollout_s"] = sim_rollout(
        0.0 if mode == "unfused" else cost, fusion=mode == "fused")
    m["sim_wall_s"] = m["sim_rollout_s"] + m["scoring_s"] + m["train_s"]
  sim_speedup = med["unfused"]["sim_wall_s"] / med["fused"]["sim_wall_s"]
  live = paired("unfused", "fused")
  split = {}
  if chunked:  # unfused -> fused split into the chunking and the overlap.
    split = dict(fused_vs_chunked=paired("chunked", "fused"),
                 chunked_vs_unfused=paired("unfused", "chunked"))
  return dict(modes=med, speedup_vs_unfused=live, reruns=rerun, **split,
              sim_speedup_vs_unfused=sim_speedup,
              sim_rel_error=sim_speedup / live - 1, chunk_fit=fit)
