"""The step's forward passes over finished samples, on any layout (fusion).

A training batch needs, per sample: the policy's log-probs of its tokens
(old log-probs; not on the on-policy path), the reference's, and for PPO
the reward model's score and the critic's values. Unfused, the step runs them after the rollout on the
training layout (`rl/prepare.py`). Fused (RLHFuse's inter-stage fusion,
`scoring/fused.py`), chunks of samples are scored as they finish, on the
replicas the consolidated tail no longer needs, and the results join the
training batch (`assemble`, then `Preparer.from_scores`) without a second
pass.

  passes = ScoringPasses(graphdef, ...)
  with fused.during(passes, sampler, policy=rollout_params, ref=ref) as f:
    ... chunks: passes.score(chunk, layout) on the freed replicas ...
  per_token = f.assemble(samples, packed)  # passes.assemble of its scores

A chunk is packed as `rl/batch.pack` packs the training batch (repeated
layout: prompt + response per row), cut to a power-of-two length that
holds its longest sample: samples that finish early are short, and the
causal forward of a prefix does not depend on what follows it. The
log-prob passes run each prompt of the chunk once for its samples there
instead (the grouped layout, `models/grouped_forward.py`; partial groups padded to
the chunk's largest) when that computes fewer token positions
(`runs_grouped`: long prompts, several samples of one prompt); the reward
model and critic always read the repeated rows. With `pack` (the training
batch in packed rows, `rl.pack_length`) every pass reads the chunk in
packed rows instead (several samples a row, each to its last token, which
the reward model reads: `packing.with_last_token`). Every per-token output is
response-aligned (column j: response token j), which `assemble` lays out
as the training batch's loss mask. The policy
is the rollout copy itself, viewed on the scoring replicas without a copy
(`submesh.view`); the reference, reward model and critic (which wait in
host memory while the rollout decodes) are placed on each scoring layout
once a step and freed by `end`.

Each pass is its own program per scoring layout and chunk shape (the
policy and the reference share the log-prob one), so a new chunk shape
compiles only the passes whose inputs changed: the reward model and critic
read the repeated rows alone, whatever layout the log-prob passes take.
Which shapes and which freed replicas a step meets depends on timing, so
new programs keep appearing in a job's first steps. `compile` builds them
on a background thread while the tail decodes (its chunk waits); with
several processes they compile inline, as every process must launch the
same programs in the same order.

Dimension letters: B sequences, T positions (Tc a chunk's), N groups, G
per group, R max new tokens.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import distributed
from rlhf_jax.models import reward_model
from rlhf_jax.parallel import pacing, repartition, submesh
from rlhf_jax.parallel.layout import Layout, use_layout
from rlhf_jax.rl import batch as batch_lib
from rlhf_jax.rl import grouped
from rlhf_jax.rl import packing
from rlhf_jax.sched import tail as tail_rules

# What each pass writes: per token ([B, T]) or per sequence ([B]).
PER_TOKEN = ("old_logp", "ref_logp", "values")
_FIELDS = ("tokens", "positions", "attn_mask", "targets", "loss_mask")
# The chunk arrays each kind of pass reads (its program's inputs).
_INPUTS = {
    "logp_grouped": ("prompt_tokens", "prompt_len", "response_tokens",
                     "group", "slot"),
    "logp_rows": _FIELDS + ("start",),
    "rm": ("tokens", "positions", "attn_mask"),
    "critic": ("tokens", "positions", "attn_mask", "start"),
    # Packed rows (`pack`): "take" [rows, Rc] and "last" [rows] are the flat
    # cells of each sample's response targets and of its last token.
    "logp_packed": ("tokens", "positions", "seg", "targets", "take"),
    "rm_packed": ("tokens", "positions", "seg", "last"),
    "critic_packed": ("tokens", "positions", "seg", "take"),
}


class ScoringPasses:
  """Old and reference log-probs, reward-model scores, critic values."""

  def __init__(self, graphdef, *, prompt_len: int, max_new: int,
               with_policy: bool = True, with_ref: bool = True,
               heads_graphdef=None, critic_graphdef=None,
               with_rm: bool = False, with_critic: bool = False,
               pack: bool = False):
    """
    Args:
      graphdef: the policy's (and reference's) graph.
      prompt_len, max_new: P and M of the training batch (T = P + M).
      with_policy: run the policy's log-probs (not on the on-policy path,
        `rl/off_policy.on_policy`: the loss anchors on its own).
      with_ref: run the reference's log-probs.
      heads_graphdef: the scalar-head graph of the reward model (and of the
        critic, unless `critic_graphdef`: a LoRA critic's).
      with_rm, with_critic: run the reward model's score / critic's values.
      pack: every pass reads the chunk in packed rows (`rl/packing.py`, as
        the training batch with `rl.pack_length`), not one row a sample.
    """
    if (with_rm or with_critic) and heads_graphdef is None:
      raise ValueError("reward-model and critic passes need heads_graphdef")
    self.graphdef, self.heads_graphdef = graphdef, heads_graphdef
    self.critic_graphdef = critic_graphdef or heads_graphdef
    self.prompt_len, self.max_new = prompt_len, max_new
    self.pack = pack
    self.names = {"policy": "old_logp"} if with_policy else {}
    if with_ref:
      self.names["ref"] = "ref_logp"
    if with_rm:
      self.names["rm"] = "rewards"
    if with_critic:
      self.names["critic"] = "values"
    self.scored = 0                       # Samples scored this step.
    self.dispatched: list = []            # This step's (chunk, layout)s.
    self._trees: dict[str, Any] = {}
    self._placed: dict[tuple, dict] = {}  # Per scoring layout.
    # Compiled pass programs by `_signature`: futures of the background
    # compiles (`compile`), done or not. They outlive the step.
    self._programs: dict[tuple, concurrent.futures.Future] = {}
    self._host_chunks: dict[tuple, dict] = {}  # Packed by `compile`.
    self._compiler = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="scoring-compile")
    self._pacer = pacing.Pacer()  # A flush dispatches every chunk at once.

  # ---------------------------------------------------------------- step
  def begin(self, **trees) -> None:
    """This step's weights: `policy` (the rollout copy, rollout layout) and
    `ref`, `rm`, `critic` as the passes need them (any placement)."""
    missing = set(self.names) - set(trees)
    if missing:
      raise ValueError(f"scoring passes need weights for {sorted(missing)}")
    self.end()
    self._trees = {k: trees[k] for k in self.names}
    self.scored, self.dispatched = 0, []

  def end(self) -> None:
    """Drops the copies placed on scoring layouts and the weights."""
    # Dropped, not deleted: a copy may alias its source's buffers (a leaf
    # already on those devices), which the caller still holds.
    self._placed, self._trees, self._host_chunks = {}, {}, {}

  # -------------------------------------------------------------- passes
  def score(self, samples: Sequence, layout: Layout) -> dict:
    """Dispatches every pass over `samples` on `layout`; returns device
    arrays whose row i is `samples[i]`: per token [rows, Rc] (response
    token j at column j) and the reward model's [rows]. rows >= n: the
    chunk's padding rows are left in (cutting them off would be one more
    launch per pass, on the host's path between two decode steps). A
    program not compiled yet is compiled here (or waited for, when
    `compile` started it)."""
    arrays = self._host_chunks.pop(_chunk_key(samples, layout), None)
    if arrays is None:
      arrays = self._chunk_arrays(samples, layout)
    arrays = {k: distributed.put_global(v, _rows_sharding(layout, v))
              for k, v in arrays.items()}  # Multi-host too.
    out = {}
    for name, kind, params, sig in self._passes(layout, arrays):
      inputs = {k: arrays[k] for k in _INPUTS[kind]}
      program = self._program(kind, layout, params, sig, inputs).result()
      out[self.names[name]] = program(params, inputs)
      self._pacer.dispatched(out[self.names[name]])
    self.scored += len(samples)
    self.dispatched.append((list(samples), layout))
    return out

  def compile(self, samples: Sequence, layout: Layout) -> list:
    """Starts compiling, on a background thread, the programs `score`
    would need for `samples` on `layout` that are neither compiled nor
    compiling; returns the futures of those still compiling (empty: ready
    to launch). With several processes: empty, `score` compiles inline."""
    if jax.process_count() > 1:
      return []
    # Packed once: `score` takes these host arrays.
    host = self._host_chunks[_chunk_key(samples, layout)] = (
        self._chunk_arrays(samples, layout))
    arrays = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                      sharding=_rows_sharding(layout, v))
              for k, v in host.items()}
    futures = [self._program(kind, layout, params, sig,
                             {k: arrays[k] for k in _INPUTS[kind]},
                             background=True)
               for _, kind, params, sig in self._passes(layout, arrays)]
    return [f for f in futures if not f.done()]

  def bytes_per_device(self, layout: Layout) -> int:
    """Device bytes this step's weights take on each device of `layout`
    once placed there (the policy is viewed in place: none)."""
    total = 0
    for name, tree in self._trees.items():
      if name != "policy":
        for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(
            layout.param_shardings(tree))):
          total += math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total

  def _passes(self, layout: Layout, arrays: dict):
    """(name, kind, params, params' signature) of each pass over a chunk's
    `arrays` (device arrays or their shapes) on `layout`."""
    if not self._trees:
      raise RuntimeError("ScoringPasses.score before begin()")
    key = _layout_key(layout)
    if key not in self._placed:
      self._placed[key] = {name: (params, _signature(params))
                           for name, params in self._place(layout).items()}
    for name, (params, sig) in self._placed[key].items():
      kind = name if name in ("rm", "critic") else (
          "logp_grouped" if "group" in arrays else "logp_rows")
      if self.pack:
        kind = ("logp" if name in ("policy", "ref") else name) + "_packed"
      yield name, kind, params, sig

  def _program(self, kind, layout, params, params_sig, inputs, *,
               background=False) -> concurrent.futures.Future:
    """The future of the compiled program of one pass: a new one compiles
    on the background thread, or here (already done) unless `background`.
    Programs are keyed by the pass and its arguments' signatures."""
    sig = (kind, params_sig, _signature(inputs))
    program = self._programs.get(sig)
    if program is None:
      build = functools.partial(_compile, functools.partial(
          self._pass, kind, layout), _abstract(params), _abstract(inputs))
      if background:
        program = self._compiler.submit(build)
      else:
        program = concurrent.futures.Future()
        program.set_result(build())
      self._programs[sig] = program
    return program

  def _place(self, layout: Layout) -> dict:
    placed = {}
    for name, tree in self._trees.items():
      shardings = layout.param_shardings(tree)
      if name == "policy":  # Every replica holds it whole: a view.
        placed[name] = jax.tree.map(submesh.view, tree, shardings)
      else:
        placed[name] = _put(tree, shardings)
    return placed

  def chunk_length(self, samples) -> int:
    """Tc: the power of two (at most P + M) that holds every sequence."""
    longest = max(len(s.prompt_tokens) + len(s.tokens) for s in samples)
    return _pow2_at_most(longest, self.prompt_len + self.max_new)

  def grouped_positions(self, samples) -> int:
    """Token positions of the chunk with each of its prompts run once for
    its samples there (`models/grouped_forward.py`), as `_chunk_arrays` pads it."""
    counts = collections.Counter(s.prompt_id for s in samples)
    return len(counts) * (
        _pow2_at_most(max(len(s.prompt_tokens) for s in samples),
                      self.prompt_len)
        + max(counts.values()) * _pow2_at_most(
            max(len(s.tokens) for s in samples), self.max_new))

  def runs_grouped(self, samples) -> bool:
    """Whether the log-prob passes take the grouped layout: fewer token
    positions than the repeated rows (n x Tc). A chunk mixes whole and
    partial groups, so either can win."""
    log_prob_passes = {"policy", "ref"} & set(self.names)
    return bool(log_prob_passes) and not self.pack and self.grouped_positions(
        samples) < len(samples) * self.chunk_length(samples)

  def _chunk_arrays(self, samples, layout) -> dict:
    """The chunk's host arrays, rows padded to `sched.tail.chunk_rows` of
    the layout's replicas: the repeated rows packed as the training batch
    is, cut to `chunk_length` (the reward model and critic, and the
    log-prob passes unless `runs_grouped`), with each sample's first
    response target ("start"); or / and the grouped layout (each prompt
    once, its samples of the chunk in a power of two of slots; "group" and
    "slot" of each sample). Every length is a power of two too, so a run
    meets a few shapes per layout, however its chunks fill."""
    shards = layout.mesh.shape["data"]
    pad = lambda x: np.pad(  # noqa: E731
        x, [(0, tail_rules.chunk_rows(len(x), shards) - len(x))]
        + [(0, 0)] * (x.ndim - 1))
    if self.pack:
      return self._packed_arrays(samples, shards, pad)
    grouped_passes = self.runs_grouped(samples)
    out = {}
    if not grouped_passes or {"rm", "critic"} & set(self.names):
      Tc = self.chunk_length(samples)
      out = {k: pad(v[:, :Tc]) for k, v in batch_lib.pack(
          samples, self.prompt_len, self.max_new).arrays.items()
             if k in _FIELDS}
      out["start"] = pad(np.array([len(s.prompt_tokens) - 1
                                   for s in samples], np.int32))
    if grouped_passes:
      order = list(dict.fromkeys(s.prompt_id for s in samples))
      group = np.array([order.index(s.prompt_id) for s in samples], np.int32)
      slot = np.zeros(len(samples), np.int32)
      for b in range(len(samples)):
        slot[b] = np.sum(group[:b] == group[b])
      Pc = _pow2_at_most(max(len(s.prompt_tokens) for s in samples),
                         self.prompt_len)
      Rc = _pow2_at_most(max(len(s.tokens) for s in samples), self.max_new)
      prompts = np.zeros((len(order), Pc), np.int32)
      prompt_len = np.ones(len(order), np.int32)  # Padding rows: 1 token.
      Gc = 1 << int(slot.max()).bit_length()  # Slots: a power of two.
      responses = np.zeros((len(order), Gc, Rc), np.int32)
      for b, s in enumerate(samples):
        p = len(s.prompt_tokens)
        prompts[group[b], :p], prompt_len[group[b]] = s.prompt_tokens, p
        responses[group[b], slot[b], :len(s.tokens)] = s.tokens
      out.update(prompt_tokens=pad(prompts), prompt_len=pad(prompt_len),
                 response_tokens=pad(responses), group=pad(group),
                 slot=pad(slot))
    return out

  def _packed_arrays(self, samples, shards, pad) -> dict:
    """The chunk in packed rows of `chunk_length` tokens, each sample with
    its last token (`packing.with_last_token`: the reward model reads it),
    rows dealt evenly to the layout's `shards`; "take" [rows, Rc]: the flat
    cell of each sample's response target j (Rc = min(Tc, M)), "last"
    [rows]: of its last token (padding rows: cell 0)."""
    Tc = self.chunk_length(samples)
    arrays, _ = packing.pack(packing.with_last_token(samples),
                             packing.Slots(Tc, shards=shards))
    cells, start = packing.cells_by_sequence(arrays["seq"], len(samples))
    take = np.zeros((len(samples), min(Tc, self.max_new)), np.int32)
    for i, s in enumerate(samples):  # Its first n cells: r_0 .. r_{n-1}.
      take[i, :len(s.tokens)] = cells[start[i]:start[i] + len(s.tokens)]
    out = {k: arrays[k] for k in ("tokens", "positions", "seg", "targets")}
    return {**out, "take": pad(take), "last": pad(packing.last_cells(
        arrays["seq"], len(samples)))}

  def _pass(self, kind, layout, params, arrays):
    """One pass over a chunk (one program per kind, layout and shapes; the
    policy and the reference share theirs). Per-token outputs are
    response-aligned: [n, Rc] grouped, [n, min(Tc, M)] from repeated rows."""
    def responses(x_BxT):  # Column j: the target of response token j.
      T = x_BxT.shape[1]
      cols = arrays["start"][:, None] + np.arange(min(T, self.max_new))[None]
      return jnp.take_along_axis(x_BxT, jnp.minimum(cols, T - 1), axis=1)

    with use_layout(layout):
      if kind.endswith("_packed"):  # [W, Tc] -> each sample's cells.
        rows = {k: arrays[k] for k in ("tokens", "positions", "seg",
                                       "targets") if k in arrays}
        x = (grouped.token_logprobs_in_layout(self.graphdef, params, rows)
             if kind == "logp_packed" else reward_model.batch_values(
                 self.heads_graphdef if kind == "rm_packed"
                 else self.critic_graphdef, params, rows)).reshape(-1)
        return x[arrays["last" if kind == "rm_packed" else "take"]]
      if kind == "logp_grouped":
        logp = grouped.token_logprobs_in_layout(self.graphdef, params, {
            k: arrays[k] for k in grouped.PROMPT_KEYS + ("response_tokens",)})
        return logp[arrays["group"], arrays["slot"]]  # [N, Gc, Rc] -> [n, Rc]
      if kind == "logp_rows":
        return responses(grouped.token_logprobs_in_layout(
            self.graphdef, params, {k: arrays[k] for k in _FIELDS}))
      fn, graphdef = ((reward_model.score, self.heads_graphdef)
                      if kind == "rm" else
                      (reward_model.values, self.critic_graphdef))
      score = fn(graphdef, params, arrays["tokens"], arrays["positions"],
                 arrays["attn_mask"])
      return score if kind == "rm" else responses(score)

  # ------------------------------------------------------------ assemble
  def assemble(self, samples: Sequence, scores: dict,
               packed: batch_lib.PackedBatch) -> dict:
    """Host arrays of every pass for the training batch `packed` (of
    `samples`, in order): per token laid out like its `loss_mask`
    (repeated [B, T], grouped [N, G, R] or packed rows [W, L]),
    reward-model scores [B].
    Raises if a sample was not scored."""
    missing = [s.key for s in samples if s.key not in scores]
    if missing:
      raise RuntimeError(f"{len(missing)} of {len(samples)} samples have no "
                         f"fused scores (first: {missing[0]})")
    out = {}
    for name in self.names.values():
      if name == "rewards":
        out[name] = np.array([scores[s.key][name] for s in samples],
                             np.float32)
      else:
        out[name] = _like_mask([scores[s.key][name] for s in samples],
                               samples, packed)
    return out


def _abstract(tree):
  """Shapes, dtypes and shardings of `tree`'s arrays (what a program is
  compiled for)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=x.sharding), tree)


def _signature(tree) -> tuple:
  """What a program is compiled for in an argument: its tree and its
  arrays' shapes, dtypes and shardings (the layout is in the shardings)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves)


def _rows_sharding(layout: Layout, x) -> jax.sharding.Sharding:
  """A chunk array's sharding: its rows over the layout's replicas."""
  return layout.sharding(("batch",) + (None,) * (x.ndim - 1), x.shape)


def _layout_key(layout: Layout) -> tuple:
  return (tuple(d.id for d in submesh.devices_of(layout)),
          tuple(layout.mesh.shape.items()))


def _chunk_key(samples, layout: Layout) -> tuple:
  return tuple(s.key for s in samples), _layout_key(layout)


def _compile(fn, params, inputs):
  return jax.jit(fn).lower(params, inputs).compile()


def _pow2_at_most(n: int, cap: int) -> int:
  """The power of two that holds n, at most cap."""
  return min(cap, 1 << (n - 1).bit_length())


def _put(tree, shardings):
  """`tree` (on device or parked in host memory) on device `shardings`."""
  def one(x, s):
    kind = x.sharding.memory_kind
    if kind in (None, "device"):
      return jax.device_put(x, s)
    # Host to host across devices, then up: a direct put of a parked leaf
    # can keep its host memory kind under a device sharding.
    return repartition.reload(jax.device_put(x, s.with_memory_kind(kind)),
                              donate=False)  # It may alias the source.
  return jax.tree.map(one, tree, shardings)


def _like_mask(responses, samples, packed) -> np.ndarray:
  """Response-aligned per-sample values in the layout of
  `packed.arrays["loss_mask"]` (0 elsewhere)."""
  mask = packed.arrays["loss_mask"]
  if grouped.is_packed(packed.arrays):
    # Sample b's response token j: its j-th cell; samples that train
    # nothing have none.
    cells, start = packing.cells_by_sequence(packed.arrays["seq"],
                                             len(samples))
    out = np.zeros(mask.size, np.float32)
    for b, values in enumerate(responses):
      n = start[b + 1] - start[b]
      out[cells[start[b]:start[b + 1]]] = values[:n]
    return out.reshape(mask.shape)
  out = np.zeros((len(samples), mask.shape[-1]), np.float32)
  for b, (s, values) in enumerate(zip(samples, responses)):
    # Repeated rows: response token j is target p - 1 + j; grouped: j.
    at = len(s.prompt_tokens) - 1 if mask.ndim == 2 else 0
    out[b, at:at + len(s.tokens)] = values[:len(s.tokens)]
  return out.reshape(mask.shape)
