"""Synthetic GSM8K-format data and the local assets of `gsm8k_grpo:runlocal`.

  model_dir, data_path = build_assets("/tmp/w/runlocal_assets")

writes
- `<dir>/data/train.jsonl`: records like
  {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\\n#### 7"},
  the GSM8K field names and answer format;
- `<dir>/model/`: a tiny random Qwen2 checkpoint whose tokenizer was trained
  on the same text (`models.tiny_checkpoint`).

A finished directory (marked by `ASSETS_OK`) is reused as it is, so a resumed
run sees the same tokenizer and data. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import numpy as np

from rlhf_jax.models import tiny_checkpoint

MARKER = "ASSETS_OK"
# The instruction of configs/gsm8k_grpo.py: part of the tokenizer corpus so
# prompts stay short.
INSTRUCTION = ("Let's think step by step and output the final answer after "
               "\"####\".")


def records(num: int, seed: int = 0, max_operand: int = 20) -> list[dict]:
  """`num` addition word problems with GSM8K-style "#### <n>" answers."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    a, b = (int(x) for x in rng.integers(0, max_operand, size=2))
    out.append({"question": f"What is {a} + {b}?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
  return out


def corpus(rows: list[dict]) -> list[str]:
  """Texts the tiny tokenizer is trained on: prompts, answers, roles."""
  texts = [INSTRUCTION, "system", "user", "assistant"] * 8
  for r in rows:
    texts += [r["question"], r["answer"], f"{r['question']}\n{INSTRUCTION}"]
  return texts


def write_jsonl(path: str, rows: list[dict]) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def build_assets(path: str, *, seed: int = 0, num_records: int = 256
                 ) -> tuple[str, str]:
  """Writes (once) the tiny checkpoint and dataset; returns their paths.

  Args:
    path: assets directory (e.g. `<workdir>/runlocal_assets`).
    seed: seed of the records and of the random weights.
    num_records: records in train.jsonl.

  Returns:
    (model directory, train.jsonl path).
  """
  model_dir = os.path.join(path, "model")
  data_path = os.path.join(path, "data", "train.jsonl")
  if os.path.exists(os.path.join(path, MARKER)):
    return model_dir, data_path
  rows = records(num_records, seed)
  write_jsonl(data_path, rows)
  tiny_checkpoint.write(model_dir, corpus(rows), seed=seed)
  with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
    f.write("ok\n")
  return model_dir, data_path
