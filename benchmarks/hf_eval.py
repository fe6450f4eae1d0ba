"""The independent check of a job's eval: transformers decodes the same prompts.

  python -m benchmarks.hf_eval --config=configs/smollm2_grpo.py \
      --model=DIR [--model=DIR2 ...] [--out=benchmarks/results/X.json]

For each HF checkpoint directory (the untrained model; `python -m
rlhf_jax.export` of the trained one), transformers' `from_pretrained` loads
it in float32 and decodes the config's held-out eval prompts greedily
(`generate(do_sample=False)`, the config's `rollout.max_new_tokens`, stopping
at the tokenizer's eos), and the config's rewards score the decoded text:
`accuracy` is the first reward's mean, as the job's `eval/accuracy` is, so
the two can be compared; each reward's mean beside it; with the `sums` task,
accuracy by the number of carries the sum takes.

The prompts are the job's own token ids (`data/sources.py` builds them
from the config); they are checked equal to transformers' tokenizer of the
rendered chat, so only the model's execution is ours on one side and
transformers' on the other. Report, no gate; the tolerance the [real] issue
asks (±0.03) is for the reader and docs/results.md.
"""

from __future__ import annotations

import collections
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import report

_CONFIG = flags.DEFINE_string("config", "configs/smollm2_grpo.py",
                              "The job's config (with :args).")
_MODEL = flags.DEFINE_multi_string("model", [], "HF checkpoint directories.")
_BATCH = flags.DEFINE_integer("batch", 50, "Prompts per generate call.")
_SMOKE = flags.DEFINE_bool("smoke", False, "The config's :runlocal variant and "
                           "its tiny random model (tests/test_benchmarks_"
                           "smoke.py): that it runs, not a measurement.")


def _prompts(spec: str):
  """The eval prompts as the job builds them: (ids, text, metadata)."""
  from rlhf_jax import cli  # pylint: disable=g-import-not-at-top
  from rlhf_jax.config.sections import RLJob  # pylint: disable=g-import-not-at-top
  from rlhf_jax.data import sources  # pylint: disable=g-import-not-at-top
  config = cli._load_config(report.repo_path(spec))  # pylint: disable=protected-access
  # :runlocal's tiny model is written here (nothing for the real config).
  config = sources.prepare(config, tempfile.mkdtemp(prefix="hf_eval_"))
  c = RLJob.from_config(config)
  source = sources.build(c)
  out = []
  for batch in source.eval_batches:
    for n, text in enumerate(batch.prompts):
      ids = batch.tokens_NxP[n, :batch.lengths_N[n]].tolist()
      out.append((ids, text, batch.metadata[n]))
  return config, c, out


def evaluate(model_dir: str, c, prompts, batch: int) -> dict:
  """Greedy transformers decoding of `prompts`, scored by `c`'s rewards."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from rlhf_jax.rl import registry  # pylint: disable=g-import-not-at-top
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      model_dir, dtype=torch.float32).eval()
  pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
  texts, t0 = [], time.perf_counter()
  for start in range(0, len(prompts), batch):
    chunk = [ids for ids, _, _ in prompts[start:start + batch]]
    width = max(len(ids) for ids in chunk)
    # Left padding: every prompt ends where generation starts.
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in chunk])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i)
                         for i in chunk])
    with torch.no_grad():
      out = model.generate(input_ids=input_ids, attention_mask=mask,
                           max_new_tokens=c.rollout.max_new_tokens,
                           do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=pad)
    texts += tok.batch_decode(out[:, width:], skip_special_tokens=True)
  seconds = time.perf_counter() - t0
  metadata = [m for _, _, m in prompts]
  questions = [q for _, q, _ in prompts]
  scores = {name: np.asarray(registry.get("reward", name)(
      questions, texts, metadata), np.float64) for name in c.rl.rewards}
  first = scores[c.rl.rewards[0]]
  out = dict(model=model_dir, prompts=len(prompts),
             accuracy=round(float(first.mean()), 4),
             rewards={k: round(float(v.mean()), 4) for k, v in scores.items()},
             decode_s=round(seconds, 1))
  if all("carries" in m for m in metadata):
    by = collections.defaultdict(list)
    for m, s in zip(metadata, first):
      by[int(m["carries"])].append(s)
    out["accuracy_by_carries"] = {  # carries -> [accuracy, prompts]
        str(k): [round(float(np.mean(v)), 4), len(v)]
        for k, v in sorted(by.items())}
  out["examples"] = [[q, t] for q, t in zip(questions[:4], texts[:4])]
  return out


def _check_tokens(model_dir, data, prompts):
  """Our prompt ids = transformers' tokenizer of the same chat (the
  config's template and system prompt; `data/jsonl.format_prompt`)."""
  import transformers  # pylint: disable=g-import-not-at-top
  if not data.use_chat_template:
    return
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  system = ([{"role": "system", "content": data.system_prompt}]
            if data.system_prompt else [])
  for ids, question, _ in prompts[:20]:
    theirs = tok.apply_chat_template(
        system + [{"role": "user",
                   "content": data.template.format(prompt=question)}],
        add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (a mapping), 4 a list.
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    if list(theirs) != ids:
      raise SystemExit(f"error: the job's prompt ids of {question!r} differ "
                       f"from transformers' tokenizer of {model_dir}")


def main(argv):
  del argv
  spec = _CONFIG.value + (":runlocal" if _SMOKE.value else "")
  config, c, prompts = _prompts(spec)
  models = _MODEL.value or ([config.model.path] if _SMOKE.value else [])
  if not models:
    raise SystemExit("error: pass --model=DIR (one or more)")
  if not _SMOKE.value:  # transformers re-tokenizes :runlocal's tiny
    # tokenizer its own way (its Qwen2 class brings its own pre-tokenizer).
    _check_tokens(models[0], c.data, prompts)
  runs = []
  print(f"{'model':<60}{'accuracy':>10}{'decode s':>10}")
  for model_dir in models:
    run = evaluate(model_dir, c, prompts, _BATCH.value)
    runs.append(run)
    print(f"{model_dir[-60:]:<60}{run['accuracy']:>10.3f}"
          f"{run['decode_s']:>10.1f}")
  report.emit(dict(config=spec, accuracy=[r["accuracy"] for r in runs],
                   runs=runs))


if __name__ == "__main__":
  app.run(main)
