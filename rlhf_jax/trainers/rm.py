"""Reward-model job: Bradley-Terry training on preference pairs.

The model is the decoder trunk with a scalar head (`models/reward_model.py`)
scored at <eos>. Data: a local JSONL of {"prompt", "chosen", "rejected"}
(config.data.kind="jsonl") or pairs made from the addition task
("addition": the right sum against a wrong one). Held-out pairs give
`rm/pair_accuracy` and `rm/loss`.

Resume order: (1) the latest checkpoint in workdir, else (2) random init.
The train batch of step s is a pure function of (seed, s), so the checkpoint
holds only the train state; a killed run restarted with the same command
writes the same metrics an uninterrupted one would. The final checkpoint's
"state.params" is what a PPO job loads as its reward model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.data import preferences
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import (CheckpointError, DataError, MissingInputError,
                             NonFiniteError)
from rlhf_jax.metrics import Progress
from rlhf_jax.models import reward_model
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout
from rlhf_jax.rl import objectives, preference
from rlhf_jax.rl.learner import Learner, OptimConfig, make_optimizer
from rlhf_jax.trainers import loop


@dataclasses.dataclass
class Job:
  """Everything a reward-model run builds before its first step."""
  config: Any
  data: preferences.PreferenceData  # The typed `config.data`.
  tokenizer: CharTokenizer
  train_pairs_fn: Any      # (start, count) -> list[preferences.Pair].
  eval_pairs: list
  graphdef: Any
  params: Any
  layout: Any
  learner: Learner


def _data(config, d, task, tokenizer):
  """(train_pairs_fn, eval_pairs) of the data section `d` (and `task`)."""
  if d.kind == "addition":
    near_miss = d.near_miss
    return (lambda start, n: preferences.synthetic_train_pairs(
        task, start, n, max_offset=d.max_offset, seed=config.seed,
        near_miss=near_miss),
            preferences.synthetic_eval_pairs(task, max_offset=d.max_offset,
                                             seed=config.seed,
                                             near_miss=near_miss))
  train = preferences.load_jsonl(d.train_path)
  if d.eval_path:
    evals = preferences.load_jsonl(d.eval_path)
  else:
    train, evals = preferences.split_holdout(train, d.holdout_fraction,
                                             config.seed)
  fit = lambda p: preferences.fits(p, tokenizer, d.seq_len)
  dropped = sum(not fit(p) for p in train + evals)
  if dropped:
    logging.warning("dropped %d pairs longer than seq_len=%d", dropped,
                    d.seq_len)
  train, evals = [p for p in train if fit(p)], [p for p in evals if fit(p)]
  if not train or not evals:
    raise DataError(f"no pairs fit seq_len={d.seq_len} in {d.train_path}")

  def train_fn(start, n):
    # Epoch e visits the pairs in the seeded permutation e.
    out = []
    for g in range(start, start + n):
      epoch, pos = divmod(g, len(train))
      perm = np.random.default_rng([config.seed, epoch]).permutation(
          len(train))
      out.append(train[perm[pos]])
    return out

  return train_fn, evals


def build(config) -> Job:
  """Builds data, layout, the scalar-head model and its learner."""
  tokenizer = CharTokenizer()
  data, task = preferences.sections_of(config)
  train_fn, evals = _data(config, data, task, tokenizer)
  layout, _ = mesh_lib.layouts(
      typed_config.from_dict(sections.Mesh, config.mesh, "mesh"))
  cfg = typed_config.from_dict(
      sections.Model, config.model, "model").model_config(
          vocab_size=tokenizer.vocab_size)
  graphdef, params = reward_model.init_params(cfg, config.seed, layout)
  terms, weight = objectives.reward_model_terms()
  optim = typed_config.from_dict(OptimConfig, config.optim, "optim")
  learner = Learner(graphdef, layout, make_optimizer(optim),
                    terms_fn=terms, weight_fn=weight,
                    micro_batches=config.train.micro_batches)
  return Job(config=config, data=data, tokenizer=tokenizer,
             train_pairs_fn=train_fn,
             eval_pairs=evals, graphdef=graphdef, params=params,
             layout=layout, learner=learner)


def load_trained(workdir: str, layout):
  """(config, ModelConfig, graphdef, params, step) of the last checkpoint
  of an rm job.

  Rebuilds the model from the job's saved config.json, so a consumer (PPO)
  needs only the workdir. The optimizer state is restored with the params
  (a checkpoint is one tree) and dropped.
  """
  make = ("python -m rlhf_jax.main --config=configs/tiny_rm.py "
          f"--workdir={workdir}")
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise MissingInputError(
        f"no reward model in {workdir!r} (no config.json): train one first "
        f"with `{make}`")
  with open(config_path) as f:
    saved = json.load(f)
  if saved.get("job") != "rm":  # A file on disk, not the locked config.
    raise CheckpointError(f"{workdir!r} holds a {saved.get('job')!r} job, "
                          "not a reward model (job 'rm')")
  config = ml_collections.ConfigDict(saved)
  from rlhf_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  cfg = typed_config.from_saved(
      sections.Model, saved["model"], "model").model_config(
          vocab_size=CharTokenizer().vocab_size)
  graphdef, params = reward_model.init_params(cfg, config.seed, layout)
  optimizer = make_optimizer(
      typed_config.from_saved(OptimConfig, saved["optim"], "optim"))
  terms, weight = objectives.reward_model_terms()
  like = Learner(graphdef, layout, optimizer, terms_fn=terms,
                 weight_fn=weight, micro_batches=1).init_state(params)
  with Checkpointer(os.path.join(workdir, "checkpoints"), keep=None) as ckpt:
    restored = ckpt.restore_latest(like)
  if restored is None:
    raise MissingInputError(f"the reward-model run in {workdir!r} has no "
                            f"checkpoint yet: finish it with `{make}`")
  step, state, _ = restored
  return config, cfg, graphdef, state.params, step


def train_arrays(job: Job, step: int) -> dict:
  """Host arrays of the train batch of `step` (1-based)."""
  c = job.config
  n = c.train.batch_size
  pairs = job.train_pairs_fn((step - 1) * n, n)
  arrays = preferences.encode_pairs(pairs, job.tokenizer, job.data.seq_len)
  arrays["margin"] = arrays["margin"] + np.float32(c.train.margin)
  return arrays


def make_eval_fn(job: Job):
  """Jitted (params, arrays) -> (loss_P, correct_P) of a chunk of pairs."""
  def fn(params, batch):
    with use_layout(job.layout):
      both = {k: jnp.concatenate([batch[f"chosen_{k}"],
                                  batch[f"rejected_{k}"]])
              for k in ("tokens", "positions", "mask")}
      s = reward_model.score(job.graphdef, params, both["tokens"],
                             both["positions"], both["mask"])
      chosen, rejected = jnp.split(s, 2)
      # Held-out loss is plain Bradley-Terry (no margin): comparable runs.
      return (preference.bradley_terry_loss(chosen, rejected),
              preference.pair_accuracy(chosen, rejected))
  return jax.jit(fn)


def evaluate(job: Job, eval_fn, params) -> dict:
  """rm/loss and rm/pair_accuracy over all held-out pairs."""
  c = job.config
  pairs, n = job.eval_pairs, c.eval.batch_size
  losses, correct = [], []
  for start in range(0, len(pairs), n):
    chunk = pairs[start:start + n]
    padded = chunk + pairs[:n - len(chunk)]  # Static shape; cut below.
    arrays = preferences.encode_pairs(padded, job.tokenizer,
                                      job.data.seq_len)
    loss, acc = jax.device_get(eval_fn(params, job.learner.put_batch(arrays)))
    losses.append(loss[:len(chunk)])
    correct.append(acc[:len(chunk)])
  return {"rm/loss": float(np.concatenate(losses).mean()),
          "rm/pair_accuracy": float(np.concatenate(correct).mean())}


def run(config, workdir: str):
  """Trains (or resumes) the reward model in `workdir`; returns the state."""
  job = build(config)
  writer, ckpt, main_process = loop.workdir_outputs(
      config, workdir, config.train.keep_checkpoints)
  learner, eval_fn = job.learner, make_eval_fn(job)

  state = learner.init_state(job.params)
  stop = loop.StopFlag()
  try:
    restored = ckpt.restore_latest(state)
    loop.write_config(config, workdir)
    if restored is None:
      start = 0
      writer.truncate_after("rm", -1)
      writer.write("rm", 0, evaluate(job, eval_fn, state.params))
    else:
      start, state, _ = restored
      writer.truncate_after("rm", start)
      logging.info("resumed from step %d", start)
    state = _train(job, eval_fn, state, start, writer, ckpt, stop,
                   main_process)
  finally:  # Also on errors: Orbax's threads end before the interpreter.
    stop.close()
    ckpt.close()
    writer.close()
  return state


def _train(job: Job, eval_fn, state, start, writer, ckpt, stop,
           main_process):
  """Steps `start + 1 .. train.steps`; checkpoints every
  `train.checkpoint_every`, at the end and on SIGTERM/SIGINT."""
  config, learner = job.config, job.learner
  total, t = config.train.steps, config.train
  progress = Progress(total, start, name="rm", enabled=main_process)
  for step in range(start + 1, total + 1):
    batch = learner.put_batch(train_arrays(job, step))
    state, metrics = learner.step(state, batch)
    saving = (step % t.checkpoint_every == 0 or step == total
              or stop.requested)
    evaluating = step % config.eval.every == 0 or step == total
    log = evaluating or step % t.log_every == 0
    # Device values are fetched only to log, evaluate or check a save.
    if (log or saving) and not np.isfinite(float(metrics["loss"])):
      raise NonFiniteError(
          f"non-finite rm loss at step {step}: lower "
          "config.optim.learning_rate and rerun the same command; it "
          f"resumes from the last checkpoint (step {ckpt.latest_step()})")
    if log:
      record = {"train/loss": metrics["loss"],
                "train/pair_accuracy": metrics["pair_accuracy"],
                "train/score_gap": metrics["score_gap"],
                "train/grad_norm": metrics["grad_norm"]}
      if evaluating:
        record.update(evaluate(job, eval_fn, state.params))
      record = writer.write("rm", step, record)
      progress.update(step, " ".join(f"{k} {v:.3f}"
                                     for k, v in record.items()))
    if saving:
      ckpt.save(step, state, {"step": step})
    if stop.requested:
      logging.warning("stopped after step %d (checkpointed); rerun the "
                      "same command to resume", step)
      break
  return state
