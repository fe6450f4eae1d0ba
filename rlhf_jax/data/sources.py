"""Prompt sources of the RL jobs, one per `config.data.kind`.

  data, task = sources.sections_of(config)  # typed, by kind (`KINDS`)
  source = sources.build(c)   # tokenizer, prompts, eval, SFT data

`c` are the job's typed sections (`config/sections.RLJob`), `c.data` and
`c.task` among them: each kind has its own `data` section (below, and
`random_tokens.RandomTokensData`) and maybe a `task` (`data/tasks.
AdditionTask`, `data/sums.Sums`); keys a kind does not know are refused,
keys it knows but the config leaves out take their defaults.

- "addition": the synthetic addition task (`config.task`) with the character
  tokenizer; prompts are padded to `task.max_prompt_len`; SFT warm-start
  batches come from the task's solutions.
- "code": the tiny code task (`data/code_task.py`, `config.task`), the
  same way: a spec in, a Python expression out, scored by the `code`
  reward in the sandbox (configs/tiny_code.py).
- "jsonl": prompts from a local JSONL / Parquet file (`config.data.path`,
  field mapping `config.data.fields`) tokenized with the checkpoint's own
  tokenizer (`HFTokenizer.from_dir(config.model.path)`), padded to
  `config.data.max_prompt_len`. Eval prompts: the first
  `config.eval.num_prompts` records of `config.data.eval_path` when it is
  set (0 = all of them); otherwise the first `config.eval.num_prompts`
  records of `config.data.path` are held out and training uses the rest.
  No SFT arrays (set `config.sft.steps = 0`).
- "sums": generated sums of several small integers (`data/sums.py`, knobs
  in `config.task`; `config.data.num_train` training problems) rendered
  like "jsonl" prompts with the checkpoint's tokenizer and chat template;
  the held-out problems are the eval prompts (configs/smollm2_grpo.py). No
  SFT arrays.
- "random_tokens": random ids of `config.data.vocab_size` as prompts and
  text (`data/random_tokens.py`): an RL step of any size without a
  checkpoint or a dataset (configs/synthetic_grpo.py). No SFT arrays.

`prepare(config, workdir)` runs before `build`: with `data.synthetic`
set it writes the tiny checkpoint and dataset of the `runlocal` configs
under `<workdir>/runlocal_assets` and points the config at them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, ClassVar

import numpy as np

from rlhf_jax import distributed
from rlhf_jax.data import jsonl
from rlhf_jax.data import random_tokens
from rlhf_jax.data.data_source import DataSource
from rlhf_jax.data.batching import PromptIterator, eval_batches, sft_arrays
from rlhf_jax.data.code_task import CodeTask
from rlhf_jax.samples import PromptBatch
from rlhf_jax.data.sums import Sums, build_tiny_model
from rlhf_jax.data.tasks import AdditionTask
from rlhf_jax.data.tokenizer import CharTokenizer
from rlhf_jax.errors import ConfigError
from rlhf_jax.typed_config import fail, from_partial


# ------------------------------------------------------ the data sections
@dataclasses.dataclass(frozen=True)
class AdditionData:
  """Kind "addition": the task (`config.task`, AdditionTask) is all."""
  PATH: ClassVar[str] = "data"
  kind: str = "addition"


@dataclasses.dataclass(frozen=True)
class CodeData:
  """Kind "code": the code task (`config.task`, CodeTask) is all."""
  PATH: ClassVar[str] = "data"
  kind: str = "code"


@dataclasses.dataclass(frozen=True)
class TextPrompts:
  """Text prompts rendered with a template and the checkpoint's chat
  template, padded to `max_prompt_len` (longer ones dropped)."""
  PATH: ClassVar[str] = "data"
  template: str = "{prompt}"
  system_prompt: str = ""       # "" = the chat template's default.
  use_chat_template: bool = True
  max_prompt_len: int = 256
  seed: int = 0
  shuffle: bool = True
  synthetic: bool = False       # runlocal: build tiny assets in workdir.

  def __post_init__(self):
    if "{prompt}" not in self.template:
      fail(self, "template", "has no {prompt}")
    if not isinstance(self.max_prompt_len, int) or self.max_prompt_len < 2:
      fail(self, "max_prompt_len", "must be an int >= 2")


@dataclasses.dataclass(frozen=True)
class JsonlData(TextPrompts):
  """Kind "jsonl": a local GSM8K-format .jsonl / .parquet file."""
  kind: str = "jsonl"
  path: str = ""                # Required (or `synthetic`).
  eval_path: str = ""           # "" = hold out eval.num_prompts records.
  fields: dict = dataclasses.field(
      default_factory=lambda: {"prompt": "question", "answer": "answer"})


@dataclasses.dataclass(frozen=True)
class SumsData(TextPrompts):
  """Kind "sums": generated sums (`config.task`, data/sums.Sums)."""
  kind: str = "sums"
  num_train: int = 8192         # Training draws.


@dataclasses.dataclass(frozen=True)
class Kind:
  """A data kind: its `data` section, its `task` section (or None) and
  the builder of its DataSource from the job's sections."""
  data: type
  task: type | None
  build: Callable[[Any], DataSource]
  # (directory, task, seed) -> (model_dir, data_path or None): the tiny
  # local assets of `data.synthetic` (`prepare`); None: the kind has none.
  assets: Callable[[str, Any, int], tuple[str, str | None]] | None = None


def sections_of(config) -> tuple[Any, Any]:
  """(data, task): `config.data` and `config.task` typed by the kind."""
  kind = config.data.get("kind")
  if kind not in KINDS:
    raise ConfigError(f"config.data.kind={kind!r} is unknown; known: "
                      f"{sorted(KINDS)}")
  k = KINDS[kind]
  data = from_partial(k.data, config.data, "data")
  task = None if k.task is None else from_partial(
      k.task, config.get("task") or {}, "task")
  return data, task


def prepare(config, workdir: str):
  """Materializes synthetic assets if `data.synthetic`; returns config.

  The assets are written once under `<workdir>/runlocal_assets` and reused
  by a resumed run; the returned copy of the config points `model.path`
  (and, for "jsonl", `data.path`) at them: a tiny random Qwen2 checkpoint
  + a GSM8K-format JSONL ("jsonl"), a tiny random checkpoint whose
  tokenizer knows the task's text ("sums").
  """
  data, task = sections_of(config)
  write = KINDS[data.kind].assets
  if write is None or not data.synthetic:
    return config
  assets = os.path.join(workdir, "runlocal_assets")
  build = lambda: write(assets, task, config.seed)
  # Multi-host: process 0 writes the shared files, the others then read them.
  model_dir, data_path = distributed.process0_first(build, "runlocal_assets")
  config = config.copy_and_resolve_references()
  config.model.path = model_dir
  if data_path is not None:
    config.data.path = data_path
  return config


def build(c) -> DataSource:
  """The DataSource of `c.data.kind`, sized by the sections `c`."""
  source = KINDS[c.data.kind].build(c)
  if c.sft.steps and source.sft_arrays is None:
    raise ConfigError(f"config.sft.steps={c.sft.steps} but "
                      f"config.data.kind={c.data.kind!r} has no SFT data; "
                      "set --config.sft.steps=0")
  return source


def addition(c) -> DataSource:
  """A task of the character tokenizer (`config.task`): the addition task
  (configs/tiny_grpo.py) or the code task (configs/tiny_code.py)."""
  tokenizer = CharTokenizer()
  task = c.task
  return DataSource(
      tokenizer=tokenizer, prompt_len=task.max_prompt_len,
      stop_ids=(tokenizer.eos_id,),
      iterator=PromptIterator(task, tokenizer, c.train.prompts_per_step),
      eval_batches=eval_batches(task, tokenizer, c.eval.batch_size),
      sft_arrays=lambda start, size: sft_arrays(task, tokenizer, start, size))


def require_path(path: str, key: str, what: str, example: str) -> str:
  """`path` (`config.<key>`) if it exists, else a ConfigError saying how
  to set it."""
  if not path:
    raise ConfigError(
        f"config.{key} is empty: set it to {what}, e.g. "
        f"--config.{key}={example} (or run the ':runlocal' config, which "
        "builds tiny local assets)")
  if not os.path.exists(path):
    raise ConfigError(f"config.{key}={path!r} does not exist ({what})")
  if os.path.isdir(path) and not os.listdir(path):
    raise ConfigError(f"config.{key}={path!r} is an empty directory ({what})")
  return path


def _format_kwargs(data) -> dict:
  return dict(template=data.template, system_prompt=data.system_prompt or None,
              use_chat_template=data.use_chat_template)


def _eval_batches(examples, tokenizer, prompt_len: int, batch_size: int,
                  **fmt) -> list[PromptBatch]:
  """Fixed-order eval batches; prompts longer than prompt_len are dropped."""
  items = []
  for prompt, meta in examples:
    ids = jsonl.format_prompt(tokenizer, prompt, **fmt)
    if len(ids) <= prompt_len:
      items.append((prompt, meta, ids))
  if not items:
    raise ConfigError(f"no eval prompt fits config.data.max_prompt_len="
                      f"{prompt_len}")
  out = []
  for i in range(0, len(items), batch_size):
    chunk = items[i:i + batch_size]
    tokens = np.full((len(chunk), prompt_len), tokenizer.pad_id, np.int32)
    for row, (_, _, ids) in enumerate(chunk):
      tokens[row, :len(ids)] = ids
    out.append(PromptBatch(
        prompt_ids=np.asarray([m["prompt_id"] for _, m, _ in chunk], np.int32),
        tokens_NxP=tokens,
        lengths_N=np.asarray([len(ids) for _, _, ids in chunk], np.int32),
        prompts=[p for p, _, _ in chunk], metadata=[m for _, m, _ in chunk]))
  return out


def _checkpoint_tokenizer(c):
  from rlhf_jax.models.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
  model_path = require_path(c.model.path, "model.path",
                            "a local Hugging Face checkpoint directory",
                            "/ckpt/Qwen2.5-0.5B-Instruct")
  tokenizer = HFTokenizer.from_dir(model_path)
  if not tokenizer.stop_ids:
    raise ConfigError(f"the tokenizer in config.model.path={model_path!r} "
                      "has no eos token or eos_token_id to stop sampling")
  return tokenizer


def _text_source(c, tokenizer, examples, eval_examples, what: str
                 ) -> DataSource:
  """Text prompts (prompt, metadata) rendered with `c.data`'s template
  and the tokenizer's chat template, padded to `data.max_prompt_len`."""
  data = c.data
  fmt = _format_kwargs(data)
  source = jsonl.PromptSource(
      examples, tokenizer, batch_size=c.train.prompts_per_step,
      max_prompt_len=data.max_prompt_len, seed=data.seed,
      shuffle=data.shuffle, **fmt)
  if len(source) < c.train.prompts_per_step:
    raise ConfigError(
        f"{what} has {len(source)} usable prompts, fewer than "
        f"config.train.prompts_per_step={c.train.prompts_per_step}")
  return DataSource(
      tokenizer=tokenizer, prompt_len=data.max_prompt_len,
      stop_ids=tuple(tokenizer.stop_ids), iterator=source,
      eval_batches=_eval_batches(eval_examples, tokenizer, data.max_prompt_len,
                                 c.eval.batch_size, **fmt))


def sums(c) -> DataSource:
  """Generated sums with the checkpoint's tokenizer."""
  tokenizer = _checkpoint_tokenizer(c)
  return _text_source(c, tokenizer, c.task.train_examples(c.data.num_train),
                      c.task.eval_examples(), "config.task's training set")


def _gsm8k_assets(directory: str, task, seed: int):
  del task
  from rlhf_jax.data import synthetic_gsm8k  # pylint: disable=g-import-not-at-top
  return synthetic_gsm8k.build_assets(directory, seed=seed)


def _sums_assets(directory: str, task, seed: int):
  return build_tiny_model(directory, task, seed=seed), None


def from_jsonl(c) -> DataSource:
  """Prompts from `c.data.path` with the checkpoint's tokenizer."""
  data = c.data
  tokenizer = _checkpoint_tokenizer(c)
  data_path = require_path(data.path, "data.path",
                           "a local GSM8K-format .jsonl or .parquet file",
                           "/data/gsm8k/train.jsonl")
  fields = dict(data.fields)
  examples = jsonl.load_examples(data_path, fields)
  num_eval = c.eval.num_prompts
  if data.eval_path:
    eval_examples = jsonl.load_examples(data.eval_path, fields)
    eval_examples = eval_examples[:num_eval or None]
  else:
    if not 0 < num_eval < len(examples):
      raise ConfigError(
          f"config.eval.num_prompts={num_eval} records of config.data.path "
          f"are held out for eval, out of {len(examples)}; set it in "
          "[1, #records) or set config.data.eval_path")
    eval_examples, examples = examples[:num_eval], examples[num_eval:]
  return _text_source(c, tokenizer, examples, eval_examples,
                      "config.data.path")


KINDS: dict[str, Kind] = {
    "addition": Kind(AdditionData, AdditionTask, addition),
    "code": Kind(CodeData, CodeTask, addition),
    "jsonl": Kind(JsonlData, None, from_jsonl, _gsm8k_assets),
    "sums": Kind(SumsData, Sums, sums, _sums_assets),
    "random_tokens": Kind(random_tokens.RandomTokensData, None,
                          random_tokens.source),
}
