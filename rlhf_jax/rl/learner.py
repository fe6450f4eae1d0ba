"""The learner: a jitted, micro-batched optax step on the training layout.

Losses are given as "terms" functions returning a numerator whose sum over
micro-batches, divided by one batch-level weight, is the exact full-batch
loss (see `aggregation.aggregate_terms`). So gradient accumulation over any
number of micro-batches gives the same update as one big batch.

Dimension letters: B sequences, T length, U micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from rlhf_jax import distributed
from rlhf_jax.parallel import pacing
from rlhf_jax.parallel.layout import Layout, constrain, use_layout
from rlhf_jax.rl import grouped
from rlhf_jax.shared_programs import SharedPrograms

Batch = dict[str, jax.Array]
# terms_fn(graphdef, params, micro_batch) -> (numerator, aux metrics dict)
TermsFn = Callable[[Any, Any, Batch], tuple[jax.Array, dict]]
# weight_fn(batch) -> scalar normaliser of the whole batch (param-free).
WeightFn = Callable[[Batch], jax.Array]

# Training passes (updates, streamed gradient sums) the host may dispatch
# ahead of the devices (`parallel/pacing.py`).
MAX_AHEAD = pacing.MAX_AHEAD


# Aux metrics are means over micro-batches, except those named "*_max"
# (the max), "*_min" (the min) and "*_sum" (the sum), which are totals over
# the batch.
_TOTALS = ("_max", "_min", "_sum")


def add_aux(a: dict, b: dict) -> dict:
  """Two parts' aux metrics combined: the max of "*_max", the min of
  "*_min", else the sum."""
  def add(k):
    if k.endswith("_max"):
      return jnp.maximum(a[k], b[k])
    return jnp.minimum(a[k], b[k]) if k.endswith("_min") else a[k] + b[k]

  return {k: add(k) for k in a}


def add_sums(a, b):
  """Two parts' `Learner.grad_sums` combined (streamed parts)."""
  (g1, n1, a1, w1), (g2, n2, a2, w2) = a, b
  return jax.tree.map(jnp.add, g1, g2), n1 + n2, add_aux(a1, a2), w1 + w2


@struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-4
  warmup_steps: int = 0
  decay_steps: int = 0         # 0 means constant after warmup.
  end_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip: float = 1.0


# Cached: equal configs give one (stateless) transformation, so learners
# built from equal configs share their programs (`shared_programs.py`).
@functools.cache
def make_optimizer(c: OptimConfig) -> optax.GradientTransformation:
  """AdamW + global-norm clipping + warmup/cosine schedule."""
  if c.decay_steps:
    lr = optax.warmup_cosine_decay_schedule(
        0.0, c.learning_rate, c.warmup_steps,
        max(c.decay_steps, c.warmup_steps + 1),
        end_value=c.learning_rate * c.end_lr_ratio)
  elif c.warmup_steps:
    lr = optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps)
  else:
    lr = c.learning_rate
  return optax.chain(
      optax.clip_by_global_norm(c.grad_clip),
      optax.adamw(lr, c.b1, c.b2, c.eps, weight_decay=c.weight_decay))


def batch_axes(x):
  """Logical axes of a batch array: rows over the batch axes."""
  return ("batch",) + (None,) * (x.ndim - 1)


def split_micro(batch: Batch, num_micro: int) -> Batch:
  """[B, ...] -> [U, B/U, ...], micro-batch u = rows u, u+U, u+2U, ...

  Strided so every micro-batch keeps rows on every data shard.
  """
  def one(x):
    B = x.shape[0]
    if B % num_micro:
      raise ValueError(f"batch of {B} does not split into {num_micro} "
                       "micro-batches")
    return jnp.swapaxes(x.reshape((B // num_micro, num_micro) + x.shape[1:]),
                        0, 1)
  return jax.tree.map(one, batch)


_PROGRAMS = SharedPrograms(("_step_jit", "_grad_sums_jit", "_apply_jit",
                             "_logprobs_jit", "_minibatch_jit",
                             "trace_counts"))


class Learner:
  """Owns the jitted train step and forward-only log-prob pass for one model.

  With `trainable` (an nnx filter, e.g. `lora.ADAPTERS`) only the params it
  matches train: gradients, their sums and the optimizer state cover those
  alone; the rest of `TrainState.params` passes through every update
  unchanged (a LoRA policy's frozen base).
  """

  def __init__(self, graphdef, layout: Layout, optimizer, *,
               terms_fn: TermsFn, weight_fn: WeightFn, micro_batches: int,
               trainable=None):
    self.graphdef, self.layout, self.optimizer = graphdef, layout, optimizer
    self.trainable = trainable
    self.terms_fn, self.weight_fn = terms_fn, weight_fn
    self.micro_batches = micro_batches
    self.trace_counts = {"train": 0, "logprobs": 0}
    self._step_jit = jax.jit(self._step_fn, donate_argnums=0)
    self._grad_sums_jit = jax.jit(self._grad_sums_fn)
    self._apply_jit = jax.jit(self._apply_fn, donate_argnums=(0, 1),
                              static_argnums=5)
    self._logprobs_jit = jax.jit(self._logprobs_fn)
    self._pacer = pacing.Pacer(MAX_AHEAD)
    self._minibatch_jit = jax.jit(
        lambda batch, idx: jax.tree.map(lambda x: x[idx], batch))
    # A learner equal to a live one runs its programs (`shared_programs`;
    # equal configs give the same optimizer and terms functions).
    _PROGRAMS.adopt(self, (graphdef, layout, optimizer, terms_fn, weight_fn,
                           micro_batches, trainable))

  def batch_shardings(self, batch: Batch):
    return {k: self.layout.sharding(batch_axes(v), v.shape)
            for k, v in batch.items()}

  def put_batch(self, batch: dict) -> Batch:
    """Host arrays -> device, sharded over the batch axes of the layout.

    Multi-host: every process holds the same global batch and places only
    its own devices' rows (`distributed.put_global`).
    """
    return jax.tree.map(distributed.put_global, batch,
                        self.batch_shardings(batch))

  def minibatch(self, batch: Batch, idx) -> Batch:
    """Mini-batch of the given rows, gathered on device, batch-sharded."""
    out = self._minibatch_jit(batch, idx)
    return jax.device_put(out, self.batch_shardings(out))

  def split(self, params):
    """(trained, frozen) parts of the params; frozen is None without a
    `trainable` filter."""
    if self.trainable is None:
      return params, None
    return nnx.split_state(params, self.trainable, ...)

  @staticmethod
  def join(trained, frozen):
    return trained if frozen is None else nnx.merge_state(trained, frozen)

  def init_state(self, params) -> TrainState:
    """Optimizer state (of the trained params) born with the shardings of
    the params it mirrors."""
    trained, _ = self.split(params)
    opt_shape = jax.eval_shape(self.optimizer.init, trained)
    opt_state = jax.jit(self.optimizer.init,
                        out_shardings=self.opt_shardings(trained, opt_shape))(
                            trained)
    step = jax.device_put(jnp.zeros((), jnp.int32), self.layout.replicated())
    return TrainState(params=params, opt_state=opt_state, step=step)

  def state_bytes(self, state: TrainState) -> dict[str, float]:
    """Bytes of the trained params, the frozen ones and the optimizer state
    (global, from shapes)."""
    nbytes = lambda tree: float(sum(x.size * x.dtype.itemsize  # noqa: E731
                                    for x in jax.tree.leaves(tree)))
    trained, frozen = self.split(state.params)
    return {"memory/trained_param_bytes": nbytes(trained),
            "memory/frozen_param_bytes": nbytes(frozen),
            "memory/opt_state_bytes": nbytes(state.opt_state)}

  def opt_shardings(self, params, opt_state):
    """Each optimizer leaf whose path ends with a param's path (Adam moments)
    takes that param's sharding; everything else (counts) is replicated."""
    by_path = {
        jax.tree_util.keystr(path): leaf.sharding
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)}

    def one(path, leaf):
      key = jax.tree_util.keystr(path)
      for suffix, sharding in by_path.items():
        if key.endswith(suffix) and leaf.ndim:
          return sharding
      return self.layout.replicated()

    return jax.tree_util.tree_map_with_path(one, opt_state)

  def step(self, state: TrainState, batch: Batch):
    """One optimizer update on `batch` (a dict of [B, ...] device arrays)."""
    out = self._step_jit(state, batch)
    return self._paced(out, out[1]["loss"])

  def grad_sums(self, params, batch: Batch):
    """(gradient, loss numerator, aux, weight) sums of one part of a batch.

    Streaming (`rl/train_stage.Streamed`): the parts of one update arrive one
    by one; the sums over parts, normalised by the summed weight in `apply`,
    are the update `step` makes on the parts' union (weights are additive
    over rows; see `aggregation.aggregate_terms`).
    """
    out = self._grad_sums_jit(params, batch)
    return self._paced(out, out[1])

  def apply(self, state: TrainState, grads, loss_sum, aux_sum, weight,
            num_micro: int):
    """The optimizer update from summed numerator gradients (`grad_sums`)."""
    out = self._apply_jit(state, grads, loss_sum, aux_sum, weight, num_micro)
    return self._paced(out, out[1]["loss"])

  def _paced(self, out, marker: jax.Array):
    """Returns `out` once the pass `MAX_AHEAD` before this one is done
    (`marker`: one output of this pass, never donated), so the host never
    runs further ahead than that."""
    self._pacer.dispatched(marker)
    return out

  def _grads(self, params, batch: Batch, weight):
    """Sums over micro-batches of grad(numerator / weight) (of the trained
    params), the loss and aux."""
    micro = split_micro(batch, self.micro_batches)
    params, frozen = self.split(params)

    def loss(params, mb):
      mb = {k: constrain(v, batch_axes(v)) for k, v in mb.items()}
      num, aux = self.terms_fn(self.graphdef, self.join(params, frozen), mb)
      return num / weight, aux

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def body(carry, mb):
      g_acc, loss_acc, a_acc = carry
      (loss_mb, aux), g = grad_fn(params, mb)
      return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss_mb,
              add_aux(a_acc, aux)), None

    first = jax.tree.map(lambda x: x[0], micro)
    _, aux_shape = jax.eval_shape(loss, params, first)

    def zeros(tree):
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)

    no_aux = {k: jnp.full(v.shape, jnp.inf if k.endswith("_min") else 0,
                          v.dtype) for k, v in aux_shape.items()}
    init = (zeros(params), jnp.zeros((), jnp.float32), no_aux)
    (grads, loss_value, aux), _ = jax.lax.scan(body, init, micro)
    return grads, loss_value, aux

  def _update(self, state: TrainState, grads, loss_value, aux, num_micro):
    trained, frozen = self.split(state.params)
    updates, opt_state = self.optimizer.update(grads, state.opt_state,
                                               trained)
    params = self.join(optax.apply_updates(trained, updates), frozen)
    metrics = {k: v if k.endswith(_TOTALS) else v / num_micro
               for k, v in aux.items()}
    metrics.update(loss=loss_value, grad_norm=optax.tree.norm(grads))
    return TrainState(params, opt_state, state.step + 1), metrics

  def _step_fn(self, state: TrainState, batch: Batch):
    self.trace_counts["train"] += 1
    with use_layout(self.layout):
      weight = jnp.maximum(self.weight_fn(batch), 1e-9)
      grads, loss_value, aux = self._grads(state.params, batch, weight)
      return self._update(state, grads, loss_value, aux, self.micro_batches)

  def _grad_sums_fn(self, params, batch: Batch):
    self.trace_counts["train"] += 1
    with use_layout(self.layout):
      grads, num, aux = self._grads(params, batch, 1.0)
      return grads, num, aux, self.weight_fn(batch)

  def _apply_fn(self, state, grads, loss_sum, aux_sum, weight, num_micro):
    with use_layout(self.layout):
      weight = jnp.maximum(weight, 1e-9)
      grads = jax.tree.map(lambda g: g / weight, grads)
      return self._update(state, grads, loss_sum / weight, aux_sum, num_micro)

  def logprobs(self, params, batch: Batch) -> jax.Array:
    """Per-token log-probs of the targets (forward only).

    [B, T] for a repeated batch, [N, G, R] for a grouped one (each prompt
    run once for its G responses; see `rl/grouped.py`).
    """
    return self._logprobs_jit(params, batch)

  def _logprobs_fn(self, params, batch):
    self.trace_counts["logprobs"] += 1
    with use_layout(self.layout):
      return batch_logprobs(self.graphdef, params, batch, self.micro_batches)


def batch_logprobs(graphdef, params, batch: Batch, micro_batches: int):
  """Per-token log-probs of the targets, micro-batch by micro-batch (the
  activations of one micro-batch at a time, as in training): [B, T]
  repeated, [N, G, R] grouped. Call under the batch's layout."""
  def one(mb):
    return grouped.token_logprobs_in_layout(graphdef, params, mb), ()

  return _micro_batched(one, batch, micro_batches)[0]


def own_routing_logprobs(graphdef, params, batch: Batch, micro_batches: int):
  """(log-probs as `batch_logprobs`, flipped, recorded) of a batch that
  carries the sampler's experts (MoE routing replay) with the model's own
  routing instead: the log-probs the trainer would compute without
  replay, and of the (token, layer) choices the sampler recorded, how many
  its own router makes differently (the flip rate at these weights)."""
  def one(mb):
    logp, _, _, stats = grouped.target_logprobs(
        graphdef, params, mb, router_stats=True, route_by_replay=False)
    if grouped.is_grouped(mb):
      logp = logp.reshape(mb["response_tokens"].shape)
    return logp, (jnp.sum(stats["flipped"]), jnp.sum(stats["replayed"]))

  logp, (flipped, recorded) = _micro_batched(one, batch, micro_batches)
  return logp, jnp.sum(flipped), jnp.sum(recorded)


def _micro_batched(one, batch: Batch, micro_batches: int):
  """(per-token values [B, ...] in batch order, the per-micro-batch
  extras [U, ...]) of `one(micro-batch) -> (values, extras)`."""
  micro = split_micro(batch, micro_batches)
  logp, extras = jax.lax.map(one, micro)  # [U, B/U, ...]
  B = jax.tree.leaves(batch)[0].shape[0]  # Axis 0 is rows in any layout.
  logp = jnp.swapaxes(logp, 0, 1).reshape((B,) + logp.shape[2:])
  return constrain(logp, batch_axes(logp)), extras


def train_epochs(learners, states, batch: Batch, *, epochs: int,
                 num_minibatches: int, seed: int):
  """`epochs` x `num_minibatches` updates of every learner on the same
  mini-batches (rows of `batch`, a fresh permutation each epoch; packed
  rows come in balanced mini-batches, `rl/packing.py`: contiguous blocks,
  visited in a fresh order each epoch).

  GRPO passes one learner (the policy); PPO the actor and the critic. All
  of them train on each mini-batch before the next. Returns the new states
  and, per learner, the host metrics of every update.
  """
  rng = np.random.default_rng(seed)
  rows = batch["loss_mask"].shape[0]  # Sequences, groups or packed rows.
  states, metrics = list(states), [[] for _ in learners]
  for _ in range(epochs):
    if grouped.is_packed(batch):
      blocks = np.arange(rows).reshape(num_minibatches, -1)
      minis = blocks[rng.permutation(num_minibatches)]
    else:
      perm = rng.permutation(rows)
      minis = [perm[k::num_minibatches] for k in range(num_minibatches)]
    for idx in minis:
      mini = learners[0].minibatch(batch, idx)
      for i, learner in enumerate(learners):
        states[i], m = learner.step(states[i], mini)
        metrics[i].append(m)
  return states, jax.device_get(metrics)
