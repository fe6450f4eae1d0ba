"""A real model (SmolLM2-135M-Instruct) against oracles that never read our
conversion: `python -m rlhf_jax.fetch` converts its Q4_1 GGUF file
(`models/from_gguf`) and keeps the file as `source.gguf`; transformers reads
that file on its own (its GGUF tokenizer and model loaders).

- tokenizer: our tokenizer.json's ids of 10,000 random strings = the GGUF
  tokenizer's, with llama.cpp's "smollm" pre-tokenizer (digits one by one,
  then byte-level) set on it by hand; plus hand-checked token strings;
- logits: `models/hf.load` of our directory, float32, FSDP over the 8 fake
  CPU devices = transformers' GGUF model, float32, on chat prompts, 2e-4;
- greedy decoding: the paged engine = `generate(do_sample=False)` of the
  GGUF model on chat prompts (arithmetic questions), up to <|im_end|>.

Without the fetched model every test skips with the command that fetches it;
with CI=true they fail instead (CI must have run the fetch).
"""

import contextlib
import functools
import os

import jax
import numpy as np
import pytest

from rlhf_jax import fetch
from rlhf_jax.samples import Request
from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.driver import Driver
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import hf
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.hf_tokenizer import HFTokenizer
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.parallel.layout import use_layout

try:
  import torch
  import transformers
  from tokenizers import pre_tokenizers
except ImportError:
  torch = transformers = pre_tokenizers = None

NAME = "smollm2-135m-instruct"
GGUF = "source.gguf"
IM_END = 2
NEW_TOKENS = 24
QUESTIONS = (
    "What is 45+9? Answer with only the number.",
    "What is 12+30? Answer with only the number.",
    "What is 7*8? Answer with only the number.",
    "What is 100-36? Answer with only the number.",
    "Name the capital of France in one word.",
    "Write one short sentence about the sea.",
    "List three colors, separated by commas.",
    "What is 3+4?  Then add 10.",
)


@pytest.fixture(scope="module")
def model_dir():
  """The fetched model's directory; a skip (a failure with CI=true) naming
  the fetch command when it or its source.gguf is missing."""
  path = fetch.model_dir(NAME)
  if not (fetch.is_fetched(path) and os.path.isfile(os.path.join(path, GGUF))):
    line = (f"{NAME} is not fetched to {path} (with {GGUF}): run `python -m "
            f"rlhf_jax.fetch {NAME}`")
    if os.environ.get("CI", "").lower() == "true":
      pytest.fail(line)
    pytest.skip(line)
  if transformers is None:
    pytest.skip("needs the test-only torch + transformers")
  return path


def _smollm_pre_tokenizer(digits=True):
  """llama.cpp's "smollm" pre-tokenizer: each digit alone, then byte-level
  without a prefix space."""
  steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
  if digits:
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  return pre_tokenizers.Sequence(steps)


@pytest.fixture(scope="module", autouse=True)
def gguf_read_once():
  """transformers' GGUF loaders each open the file again with
  `gguf.GGUFReader` (the tokenizer once, the model twice: its config, its
  weights) and build gguf's tensor-name map once per tensor: 4.7 s a read
  (49,152 vocabulary strings parsed field by field) and 6.7 s of maps, 27 s
  of the module's 50 (2 cores). The same reader and map serve every call
  here: both are read-only, so what the oracle computes is unchanged."""
  if transformers is None:
    yield
    return
  import gguf  # pylint: disable=g-import-not-at-top
  reader_class, readers = gguf.GGUFReader, {}

  def read_once(path, *args, **kwargs):
    key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
    if key not in readers:
      readers[key] = reader_class(path, *args, **kwargs)
    return readers[key]

  with pytest.MonkeyPatch.context() as patch:
    # transformers imports both names from `gguf` at each call.
    patch.setattr(gguf, "GGUFReader", read_once)
    patch.setattr(gguf, "get_tensor_name_map",
                  functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    yield


@pytest.fixture(scope="module")
def gguf_dir(model_dir, tmp_path_factory):
  """A directory holding only (a link to) source.gguf: next to our
  tokenizer.json and config.json, transformers' `gguf_file=` loaders read
  those instead of the GGUF's own (the oracle would be our converter)."""
  path = tmp_path_factory.mktemp("gguf_only")
  os.symlink(os.path.join(model_dir, GGUF), path / GGUF)
  return str(path)


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_dir):
  """transformers' tokenizer of the GGUF file (vocabulary, merges, chat
  template), llama.cpp's pre-tokenizer set on it by hand: transformers'
  loader has no rule for "smollm" and leaves plain byte-level, which
  drops the digit split."""
  tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
  tok.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
  return tok


@pytest.fixture(scope="module")
def ours_tokenizer(model_dir):
  return HFTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def gguf_model(gguf_dir):
  """transformers' own GGUF loader (config from the GGUF's keys; it
  dequantizes and un-permutes q/k itself)."""
  return transformers.AutoModelForCausalLM.from_pretrained(
      gguf_dir, gguf_file=GGUF, dtype=torch.float32,
      attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours_model(model_dir, mesh8):
  """Our loader on the training layout of the 8 devices (FSDP 8)."""
  layout = mesh_lib.train_layout(mesh8)
  return layout, hf.load(model_dir, layout=layout, dtype="float32")


@contextlib.contextmanager
def _one_torch_thread():
  """torch on one thread while the oracle runs: on a 2-core machine with
  another busy process, its 2 threads wait on each other (a 44-token
  forward of this model: 4.5 s on 2 threads, 0.3 s on 1)."""
  n = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(n)


def _chat(question):
  return [{"role": "user", "content": question}]


# Pieces the random strings are made of: digits, whitespace runs that end
# right before digits, punctuation, letters, non-ASCII, chat special tokens.
_PIECES = (
    list("0123456789") + [" ", "  ", "   ", "\t", "\n", "\n\n", " \t", "\t\n "]
    + list(".,;:!?+-*/=()[]{}'\"_#$%&@^~|<>") + list("aAbBzZeEtTxX")
    + ["the", " the", "The", "hello", " world", "ing", "'s", "n't", "est"]
    + ["é", "ü", "ß", "ñ", "中", "文", "日本", "ру", "Ω", "😀", "👍🏽", "🦜", "\u200b"]
    + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n",
       "<|im_", "|>", "<|"])


def _random_strings(n=10_000, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    k = int(rng.integers(1, 16))
    parts = []
    for _ in range(k):
      if rng.random() < 0.25:  # Whitespace right before a number.
        parts.append(str(rng.choice(["", " ", "  ", "   ", "\t", "\n", " \n",
                                     "\t\t"])))
        parts.append(str(rng.integers(0, 10 ** int(rng.integers(1, 7)))))
      else:
        parts.append(str(rng.choice(_PIECES)))
    out.append("".join(parts))
  return out


def _encode_all(tok, texts):
  """Ids of each text with `tok`'s tokenizers backend, no specials added."""
  return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def test_tokenizer_matches_gguf_oracle(ours_tokenizer, gguf_tokenizer):
  """Our tokenizer.json's ids = transformers' GGUF tokenizer (llama.cpp's
  smollm pre-tokenizer) on 10,000 random strings: digits after whitespace
  runs, punctuation, non-ASCII, emoji, chat special tokens."""
  texts = _random_strings()
  ours = _encode_all(ours_tokenizer.tokenizer, texts)
  ref = _encode_all(gguf_tokenizer.backend_tokenizer, texts)
  assert all(ours_tokenizer.encode(t) == o for t, o in zip(texts[:200], ours))
  bad = [(t, o, r) for t, o, r in zip(texts, ours, ref) if o != r]
  assert not bad, (f"{len(bad)} of {len(texts)} strings differ; first: "
                   f"{bad[0]}")
  # The strings did exercise the cases above.
  joined = "".join(texts)
  for piece in (" 4", "  4", "\t4", "\n4", "é", "中", "😀", "<|im_start|>"):
    assert piece in joined, piece


@pytest.mark.parametrize("text,tokens", [
    # Spaces before digits: the run is one token (plain byte-level keeps the
    # last space for the number: Ġ, Ġ, 4, 0, 2), each digit alone.
    ("  402", ["ĠĠ", "4", "0", "2"]),
    ("12+34=46", ["1", "2", "+", "3", "4", "=", "4", "6"]),
    (" 2024", ["Ġ", "2", "0", "2", "4"]),
    # A special token is one id, never split; the newline is its own byte.
    ("<|im_start|>user\n7", ["<|im_start|>", "user", "Ċ", "7"]),
])
def test_tokenizer_hand_cases(ours_tokenizer, gguf_tokenizer, text, tokens):
  """Token strings of hand-checked cases, ours and the oracle's."""
  ids = ours_tokenizer.encode(text)
  assert [ours_tokenizer.tokenizer.id_to_token(i) for i in ids] == tokens
  assert gguf_tokenizer.convert_ids_to_tokens(
      gguf_tokenizer(text, add_special_tokens=False).input_ids) == tokens


def test_logits_match_gguf_model(ours_model, gguf_model, ours_tokenizer):
  """Our float32 logits (FSDP over 8 devices) = transformers' GGUF model in
  float32 on chat prompts (right-padded batch, valid positions), 2e-4."""
  layout, (cfg, graphdef, params) = ours_model
  assert cfg.param_dtype == "float32"
  prompts = [ours_tokenizer.encode_chat(_chat(q)) for q in QUESTIONS]
  B, T = len(prompts), max(len(p) for p in prompts)
  tokens = np.full((B, T), IM_END, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  lengths = np.array([len(p) for p in prompts])
  mask = np.arange(T)[None] < lengths[:, None]
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  with use_layout(layout):
    ours = np.asarray(jax.jit(model_lib.forward, static_argnums=0)(
        graphdef, params, tokens, positions, mask))
  with torch.no_grad(), _one_torch_thread():
    ref = gguf_model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long)
                     ).logits.numpy()
  diff = max(float(np.abs(ours[b, :n] - ref[b, :n]).max())
             for b, n in enumerate(lengths))
  assert diff <= 2e-4, diff  # 1.1e-4 seen (logits up to ~40 in size).


# Mostly running: 24 decode steps of a 30-layer model, 6 programs (10 s at
# -O0, 6 s with XLA's optimizations).
@pytest.mark.xla_optimized
def test_greedy_paged_engine_matches_gguf_generate(
    ours_model, gguf_model, ours_tokenizer, gguf_tokenizer, mesh1):
  """Greedy tokens of the paged engine = `generate(do_sample=False)` of the
  GGUF model on chat prompts, up to and with <|im_end|> (<= 24 tokens);
  the prompts themselves = the oracle tokenizer's chat template."""
  _, (cfg, graphdef, params) = ours_model
  questions = QUESTIONS[:4] + QUESTIONS[6:7]
  prompts = [np.asarray(ours_tokenizer.encode_chat(_chat(q)), np.int32)
             for q in questions]
  for q, p in zip(questions, prompts):
    text = gguf_tokenizer.apply_chat_template(
        _chat(q), add_generation_prompt=True, tokenize=False)
    assert ours_tokenizer.apply_chat_template(_chat(q)) == text, q
    assert p.tolist() == gguf_tokenizer(
        text, add_special_tokens=False).input_ids, q
  layout = mesh_lib.rollout_layout(mesh1)
  sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS,
                            stop_tokens=(IM_END,))
  bucket = 64
  assert max(len(p) for p in prompts) <= bucket
  engine = Engine(cfg, graphdef, layout, num_slots=len(prompts),
                       samples_per_group=1, prefill_buckets=(bucket,),
                       sampling=sampling, page_size=16, num_pages=64)
  driver = Driver(engine, mesh_lib.to_layout(params, layout))
  samples = list(driver.run([Request(i, p) for i, p in enumerate(prompts)]))
  ours = {s.prompt_id: s.tokens for s in samples}
  # Both ends are exercised: <|im_end|> (kept) and the 24-token budget.
  assert {s.finish_reason for s in samples} == {"stop", "length"}
  for i, p in enumerate(prompts):
    ids = torch.tensor(p[None], dtype=torch.long)
    with torch.no_grad(), _one_torch_thread():
      out = gguf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=NEW_TOKENS,
                                eos_token_id=IM_END, pad_token_id=IM_END)
    ref = out[0, len(p):].tolist()
    first = next((k for k, (a, b) in enumerate(zip(ours[i], ref)) if a != b),
                 None)
    assert ours[i] == ref, (questions[i], first, ours_tokenizer.decode(
        ours[i], stop_at_eos=False), ours_tokenizer.decode(
            ref, stop_at_eos=False))


def test_smollm2_config_prompts_fit_and_render_with_the_chat_template(
    model_dir):
  """configs/smollm2_grpo.py's data source on the fetched tokenizer: every
  held-out problem fits `data.max_prompt_len` (none dropped) and is not
  padded far past its length, and a prompt is the sum's question inside
  SmolLM2's chat template (the default system turn, the user's turn),
  ending where the assistant's turn starts."""
  from configs import smollm2_grpo
  from rlhf_jax.config.sections import RLJob
  from rlhf_jax.data import sources
  config = smollm2_grpo.get_config()
  config.model.path = model_dir
  source = sources.build(RLJob.from_config(config))
  (batch,) = source.eval_batches  # One batch of all held-out prompts.
  assert len(batch.prompts) == config.task.num_eval == 200
  assert batch.lengths_N.max() <= config.data.max_prompt_len
  assert tuple(config.rollout.prefill_buckets) == (config.data.max_prompt_len,)
  assert batch.lengths_N.min() >= 0.9 * config.data.max_prompt_len
  text = source.tokenizer.decode(batch.tokens_NxP[0, :batch.lengths_N[0]],
                                 stop_at_eos=False)
  # decode drops the special tokens (<|im_start|>, <|im_end|>): the turns
  # show as their role names.
  assert text.startswith("system\n") and f"user\n{batch.prompts[0]}" in text
  assert text.rstrip().endswith("\nassistant")
