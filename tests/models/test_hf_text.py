"""HF tokenizer and chat templates vs transformers; JSONL prompts; GSM8K.

The tokenizer is a byte-level BPE trained in the test on a few sentences with
the `tokenizers` library; nothing is downloaded.
"""

import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rlhf_jax.data import jsonl
from rlhf_jax.models.hf_tokenizer import HFTokenizer
from rlhf_jax.rewards import gsm8k
from rlhf_jax.rl import registry

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>"]
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if not (message.role == 'system' and loop.first) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content"
    " + '<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}\n")
# Uses bos_token, tojson, raise_exception, loop controls and whitespace
# control the way Llama / Gemma templates do.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
    "  [{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n"
    "{% if loop.index > 8 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
CORPUS = ["Natalia sold clips to 48 of her friends in April.",
          "How many clips did Natalia sell altogether in April and May?",
          "Weng earns $12 an hour for babysitting. #### 10",
          "You are helpful. The answer is \\boxed{72}. émoji ✓"] * 20


def _write_tokenizer(path, *, template_in_config=True):
  os.makedirs(path, exist_ok=True)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>", "pad_token": "<|endoftext|>",
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"}}
  if template_in_config:
    config["chat_template"] = CHATML
  else:
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
      f.write(BOS_TEMPLATE)
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  endoftext = tok.token_to_id("<|endoftext|>")
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [endoftext]}, f)
  return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return _write_tokenizer(str(tmp_path_factory.mktemp("tok") / "chatml"))


MESSAGES = [{"role": "system", "content": "Solve it."},
            {"role": "user", "content": "Natalia sold 48 clips? ✓"},
            {"role": "assistant", "content": "#### 72"},
            {"role": "user", "content": "And in May?"}]


def test_special_tokens_and_stop_ids(tok_dir):
  tok = HFTokenizer.from_dir(tok_dir)
  eos, pad = tok.tokenizer.token_to_id("<|im_end|>"), tok.tokenizer.token_to_id(
      "<|endoftext|>")
  assert tok.eos_id == eos and tok.pad_id == pad
  assert tok.stop_ids == (pad, eos)  # generation_config first, then eos.
  ids = tok.encode("Natalia sold clips", add_special_tokens=True)
  assert ids[0] == tok.bos_id and tok.encode("Natalia")[0] != tok.bos_id
  assert tok.decode(ids) == "Natalia sold clips"
  assert tok.decode(tok.encode("48 ✓") + [eos] + tok.encode("x")) == "48 ✓"
  assert tok.vocab_size == tok.tokenizer.get_vocab_size()


@pytest.mark.parametrize("in_config", [True, False])
def test_chat_template_matches_transformers(tmp_path, in_config):
  transformers = pytest.importorskip("transformers")
  path = _write_tokenizer(str(tmp_path / "t"), template_in_config=in_config)
  ours = HFTokenizer.from_dir(path)
  theirs = transformers.AutoTokenizer.from_pretrained(path)
  messages = MESSAGES if in_config else MESSAGES[1:]
  for gen in (True, False):
    text = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == theirs.apply_chat_template(
        messages, add_generation_prompt=gen, tokenize=False)
  want = theirs.apply_chat_template(messages, add_generation_prompt=True,
                                    tokenize=True, return_dict=True)
  assert ours.encode_chat(messages) == list(want["input_ids"])
  assert ours.encode("Weng earns $12") == theirs.encode(
      "Weng earns $12", add_special_tokens=False)
  if not in_config:
    with pytest.raises(Exception, match="bad role system"):
      ours.apply_chat_template(MESSAGES)


def test_jsonl_prompt_source(tok_dir, tmp_path):
  tok = HFTokenizer.from_dir(tok_dir)
  path = tmp_path / "gsm8k.jsonl"
  rows = [{"question": f"Natalia sold {i} clips?", "answer": f"... #### {i}",
           "meta": {"level": i % 3}} for i in range(7)]
  rows.append({"question": "Natalia " * 60, "answer": "#### 0",
               "meta": {"level": 0}})  # Too long: dropped.
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  examples = jsonl.load_examples(
      str(path), {"prompt": "question", "answer": "answer",
                  "level": "meta.level"})
  assert examples[3] == ("Natalia sold 3 clips?",
                         {"prompt_id": 3, "answer": "... #### 3", "level": 0})
  source = jsonl.PromptSource(examples, tok, batch_size=3, max_prompt_len=48,
                              seed=1, system_prompt="Solve it.")
  assert (len(source), source.num_dropped) == (7, 1)
  batches = [next(source) for _ in range(5)]  # Crosses two epochs.
  b = batches[0]
  assert b.tokens_NxP.shape == (3, 48) and b.tokens_NxP.dtype == np.int32
  for row, pid in enumerate(b.prompt_ids):
    want = tok.encode_chat([{"role": "system", "content": "Solve it."},
                            {"role": "user", "content": rows[pid]["question"]}])
    assert b.tokens_NxP[row, :b.lengths_N[row]].tolist() == want
    assert (b.tokens_NxP[row, b.lengths_N[row]:] == tok.pad_id).all()
    assert b.prompts[row] == rows[pid]["question"]
  first_epoch = np.concatenate([x.prompt_ids for x in batches])[:7]
  assert sorted(first_epoch) == list(range(7))
  resumed = jsonl.PromptSource(examples, tok, batch_size=3, max_prompt_len=48,
                               seed=1, system_prompt="Solve it.")
  resumed.set_state(source.get_state())
  assert next(resumed).prompt_ids.tolist() == next(source).prompt_ids.tolist()
  with pytest.raises(ValueError, match="batch_size"):
    resumed.set_state({**source.get_state(), "batch_size": 4})
  with pytest.raises(KeyError, match="record 0 has no field 'problem'"):
    jsonl.load_examples(str(path), {"prompt": "problem"})


# `formatted`: by hand, whether the completion states a number after its last
# "####" or, with no "####", inside a closed \boxed{} (gsm8k_format's rule,
# whatever the value).
@pytest.mark.parametrize("completion,answer,correct,formatted", [
    ("so she sold 48 + 24 = 72.\n#### 72", "blah\n#### 72", 1.0, 1.0),
    ("#### $1,000.00", "#### 1000", 1.0, 1.0),
    ("The answer is \\boxed{\\$1,000}.", 1000, 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{\\text{18 dollars}}", "#### 18", 1.0, 1.0),
    ("\\boxed{-3}", "#### -3", 1.0, 1.0),
    ("#### 5 then \\boxed{7}", "#### 5", 1.0, 1.0),  # '####' wins over boxed.
    ("#### 71", "#### 72", 0.0, 1.0),  # Wrong value, right form.
    ("The answer is 72.", "#### 72", 0.0, 0.0),  # No marker, no credit.
    ("\\boxed{72", "#### 72", 0.0, 0.0),  # Unclosed box.
    ("#### seventy-two", "#### 72", 0.0, 0.0),  # Marker, no number.
    ("\\boxed{x}", "#### 72", 0.0, 0.0),  # Box, no number.
])
def test_gsm8k_rewards(completion, answer, correct, formatted):
  fn = registry.get("reward", "gsm8k")
  fmt = registry.get("reward", "gsm8k_format")
  assert fn([""], [completion], [{"answer": answer}]) == [correct]
  assert fmt([""], [completion], [{}]) == [formatted]


def test_gsm8k_reference_without_number_raises():
  with pytest.raises(ValueError, match="has no number"):
    gsm8k.reference_answer("#### none")
