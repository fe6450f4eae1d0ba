r"""What a GRPO train step executes, read from its compiled HLO (no run).

python tools/lowered_step.py [--layers=1] [--noshare] [--prefix_block_scores=N]
    [--noskip] [--attention_block=N] [--json_out=PATH]

Builds `configs/synthetic_grpo.py` (Qwen2.5-1.5B widths; 16 prompts of 2048
tokens x G=16 responses of 1024 tokens, 16 micro-batches) with `--layers`
layers, lowers and compiles the learner's train step for one batch of those
shapes on the host CPU, and walks the optimized HLO counting what runs:
dot FLOPs, instructions, `conditional`s and while-loop iterations, each
multiplied by the trip counts of the loops around it (a conditional counts
its costlier branch). XLA's own `cost_analysis()` counts a loop body once,
so it cannot show a step made of many small loop iterations, which is what
bound the whole step on an H200 (docs/results.md, GPU). The counts are the
CPU compiler's; a GPU compiler fuses differently, so kernel counts differ,
but loop trip counts and conditionals do not.

Last stdout line: JSON with `dot_tflop`, `dynamic_ops`,
`dynamic_conditionals`, `while_iterations` and the setting.
"""

import json
import math
import re
import sys

from absl import app, flags

_LAYERS = flags.DEFINE_integer("layers", 1, "Decoder layers.")
_SHARE = flags.DEFINE_bool("share", True, "rl.share_prompt (the grouped "
                           "layout); --no_share: prompt repeated per sample.")
_BLOCK = flags.DEFINE_integer("prefix_block_scores", 0, "Override "
                              "model.prefix_block_scores (0: the default).")
_SKIP_BLOCKS = flags.DEFINE_bool("skip", True, "The chunked attention skips empty "
                          "block pairs by lax.cond, as on CPU; --noskip: "
                          "computes them, as on GPU (flash_attention."
                          "SKIP_EMPTY_BLOCKS).")
_ATTN_BLOCK = flags.DEFINE_integer("attention_block", 0, "Override "
                                   "model.attention_block (0: the default).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON here.")

_SKIP = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^(?:ROOT )?%([\w.\-]+) = ")


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """name -> instruction lines, and the entry computation's name."""
  comps, cur, entry = {}, None, None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      cur = m.group(2)
      comps[cur] = []
      entry = cur if m.group(1) else entry
    elif line.strip() == "}":
      cur = None
    elif cur and line.startswith("  "):
      comps[cur].append(line.strip())
  return comps, entry


def _dims(shape: str) -> list[int]:
  m = re.match(r"\w+\[([\d,]*)\]", shape)
  return [int(x) for x in m.group(1).split(",") if x] if m else []


def _split_shape(rest: str) -> tuple[str, str]:
  """(result shape, 'op(args...)') of an instruction's right-hand side."""
  if rest.startswith("("):  # A tuple shape: up to its closing parenthesis.
    depth = 0
    for i, ch in enumerate(rest):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, op = rest.partition(" ")
  return shape, op


def dynamic_counts(comps, entry) -> dict[str, float]:
  """Dot FLOPs, instructions, conditionals and loop iterations as executed."""
  memo = {}

  def cost(name):  # (flops, ops, conditionals, while iterations)
    if name in memo:
      return memo[name]
    shapes, total = {}, [0.0, 0, 0, 0]
    for line in comps.get(name, []):
      m = _INSTR.match(line)
      if not m:
        continue
      shape, call = _split_shape(line[m.end():])
      opm = re.match(r"([\w\-]+)\((.*)$", call)
      if not opm:
        continue
      op, args = opm.groups()
      shapes[m.group(1)] = shape
      if op in _SKIP:
        continue
      total[1] += 1
      if op == "dot":
        lhs = _dims(shapes.get(re.findall(r"%([\w.\-]+)", args)[0], ""))
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args)
        k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",")
                      if i)
        total[0] += 2 * math.prod(_dims(shape)) * k
      elif op == "fusion":
        total[0] += cost(re.search(r"calls=%([\w.\-]+)", args).group(1))[0]
      elif op == "while":
        body = re.search(r"body=%([\w.\-]+)", args).group(1)
        trips = re.search(r'known_trip_count":\{"n":"(\d+)"', args)
        n = int(trips.group(1)) if trips else 1
        sub = cost(body)
        total = [t + n * s for t, s in zip(total, sub)]
        total[3] += n
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", args)
        sub = max((cost(b.strip().lstrip("%"))
                   for b in branches.group(1).split(",")), key=lambda c: c[0])
        total = [t + s for t, s in zip(total, sub)]
        total[2] += 1
      elif op == "call":
        sub = cost(re.search(r"to_apply=%([\w.\-]+)", args).group(1))
        total = [t + s for t, s in zip(total, sub)]
    memo[name] = total
    return total

  flops, ops, conds, iters = cost(entry)
  return {"dot_tflop": flops / 1e12, "dynamic_ops": ops,
          "dynamic_conditionals": conds, "while_iterations": iters}


def main(argv):
  del argv
  import jax
  import numpy as np

  from configs import synthetic_grpo
  from kernels_pallas import flash_attention
  from rlhf_jax.rl.batch import PackedBatch
  from rlhf_jax.trainers import rl_job

  flash_attention.SKIP_EMPTY_BLOCKS[jax.default_backend()] = _SKIP_BLOCKS.value
  c = synthetic_grpo.get_config()
  c.model.overrides.num_layers = _LAYERS.value
  if _BLOCK.value:
    c.model.overrides.prefix_block_scores = _BLOCK.value
  if _ATTN_BLOCK.value:
    c.model.overrides.attention_block = _ATTN_BLOCK.value
  c.rl.share_prompt = _SHARE.value
  job = rl_job.build(c)
  N, G = c.rollout.num_rows, c.rollout.samples_per_row
  P, R = c.data.max_prompt_len, c.rollout.max_new_tokens
  rng = np.random.default_rng(0)
  tokens = lambda *shape: rng.integers(0, 1000, shape).astype(np.int32)  # noqa: E731
  if _SHARE.value:
    arrays = dict(prompt_tokens=tokens(N, P), prompt_len=np.full(N, P, np.int32),
                  response_tokens=tokens(N, G, R),
                  loss_mask=np.ones((N, G, R), np.float32))
    logp = np.zeros((N, G, R), np.float32)
  else:
    B, T = N * G, P + R
    tok = tokens(B, T)
    mask = np.zeros((B, T), np.float32)
    mask[:, P - 1:P - 1 + R] = 1
    arrays = dict(tokens=tok, positions=np.broadcast_to(
        np.arange(T, dtype=np.int32), (B, T)).copy(),
                  attn_mask=np.ones((B, T), bool),
                  targets=np.concatenate([tok[:, 1:], tok[:, :1] * 0], 1),
                  loss_mask=mask)
    logp = np.zeros((B, T), np.float32)
  batch = job.preparer.put(PackedBatch(arrays, logp, np.full(N * G, R, np.float32)),
                           rng.random(N * G).astype(np.float32))
  prepared = jax.eval_shape(job.algorithm.preparer._jit, job.params, job.params, batch,
                            None)[0]
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in
              prepared.items()}
  state = job.learner.init_state(job.params)
  hlo = job.learner._step_jit.lower(state, abstract).compile().as_text()
  result = {**dynamic_counts(*computations(hlo)),
            "layers": _LAYERS.value, "share_prompt": _SHARE.value,
            "skip_empty_blocks": _SKIP_BLOCKS.value,
            "attention_block": job.c.model.overrides.get(
                "attention_block", 0) or "default",
            "prefix_block_scores": job.c.model.overrides.get(
                "prefix_block_scores", 0) or "default",
            "shapes": dict(N=N, G=G, P=P, R=R,
                           micro_batches=c.rl.micro_batches)}
  for k in ("dot_tflop", "dynamic_ops", "dynamic_conditionals",
            "while_iterations"):
    print(f"{k:<24}{result[k]:>16,.2f}")
  sys.stdout.flush()
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
