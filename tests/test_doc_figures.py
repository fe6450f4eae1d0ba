"""Every figure README.md quotes, and the current figures at the head of each
docs/results.md section, pinned to a committed result.

A pin is (doc, quote, file, specs): `quote` is text as the doc prints it,
`file` a JSON under benchmarks/results/ (written by a benchmark's `--out`,
benchmarks/report.py, or a hand-assembled record that names its commit,
date and command), and `specs` say, number by number, what the figures in
the quote are. A spec is a key path into the file ("result/speedup";
"/"-separated, list indices as integers), `(path, scale)` for a printed
unit (100 for a percentage), `("ratio", a, b)` for a figure derived from
two keys, `None` for a number that is not a figure (a
seed, a step count), or `("text", path)`: the quote appears verbatim in
that string or list of strings (a job's printed summary).

Checks, for each pin: the doc contains the quote; the file exists and the
same paragraph, list item or table row cites it by name; each figure lies
within one unit of its printed last digit of the file's value ("1.63x" ->
+-0.01; "+0.230" -> +-0.001; "26.83 GiB" -> +-0.01), sign included. And coverage: every
figure-like number of README.md and of the heads of docs/results.md
(decimals, and numbers with a unit: x, ×, %, s, ms, min, GiB, ...) lies
inside a pinned quote or matches `NOT_FIGURES` (versions, model names, a
config value, a test's tolerance), each with its reason. The oracle is the
committed files; an edited figure or an unpinned new one fails here.
The pins and `NOT_FIGURES` are data, in `tests/doc_pins.py`.
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest

from doc_pins import D, NOT_FIGURES, PINS, R, RESULTS, ROOT  # tests/ is on sys.path

# ------------------------------------------------------------ the docs
@functools.cache
def _text(doc: str) -> str:
  with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
    return f.read()


def _blocks(text: str) -> list[tuple[int, int]]:
  """(start, end) of each paragraph, list item or table row; a fenced code
  block belongs to the paragraph before it (the one that cites it)."""
  spans, start, fenced = [], 0, False
  pos = 0
  for line in text.splitlines(keepends=True):
    stripped = line.strip()
    if stripped.startswith("```"):
      fenced = not fenced
    elif not fenced and (not stripped or stripped.startswith(("|", "- "))):
      # A table row or list item is a block of its own; a blank line ends
      # a paragraph unless a code block follows (handled by merging below).
      if pos > start:
        spans.append((start, pos))
      start = pos
      if stripped:
        spans.append((pos, pos + len(line)))
        start = pos + len(line)
    pos += len(line)
  if pos > start:
    spans.append((start, pos))
  merged = []
  for s, e in spans:
    if merged and text[s:e].lstrip().startswith("```"):
      merged[-1] = (merged[-1][0], e)
    else:
      merged.append((s, e))
  return merged


def _block_of(text: str, offset: int) -> str:
  for s, e in _blocks(text):
    if s <= offset < e:
      return text[s:e]
  return ""


def _results_heads(text: str) -> list[tuple[int, int]]:
  """(start, end) of each `## ` section's head: up to its first `###`."""
  heads, start = [], None
  pos = 0
  fenced = False
  for line in text.splitlines(keepends=True):
    if line.startswith("```"):
      fenced = not fenced
    if not fenced and line.startswith("#"):
      if start is not None:
        heads.append((start, pos))
        start = None
      if line.startswith("## "):
        start = pos
    pos += len(line)
  if start is not None:
    heads.append((start, pos))
  return heads


# ------------------------------------------------------------ the files
@functools.cache
def _load(file: str):
  with open(os.path.join(RESULTS, file), encoding="utf-8") as f:
    return json.load(f)


def _get(file: str, path: str):
  node = _load(file)
  for key in path.split("/"):
    node = node[int(key)] if isinstance(node, list) else node[key]
  return node


def _value(file: str, spec):
  if isinstance(spec, str):
    return _get(file, spec)
  if spec[0] == "ratio":
    return _get(file, spec[1]) / _get(file, spec[2])
  path, scale = spec
  return _get(file, path) * scale


NUMBER = re.compile(r"(?<![\w.])[-+−]?\d+(?:\.\d+)?")


def _numbers(quote: str) -> list[tuple[float, float]]:
  """(value, tolerance) of each number printed in `quote`."""
  for pattern, _ in NOT_FIGURES:  # A model's name is not a figure.
    quote = re.sub(pattern, " ", quote)
  out = []
  for m in NUMBER.finditer(quote):
    s = m.group().replace("−", "-")
    decimals = len(s.split(".")[1]) if "." in s else 0
    out.append((float(s), 10.0 ** -decimals))
  return out


@pytest.mark.parametrize("pin", PINS, ids=repr)
def test_pin(pin):
  text = _text(pin.doc)
  at = text.find(pin.quote)
  assert at >= 0, f"{pin.doc} no longer prints {pin.quote!r}"
  assert os.path.exists(os.path.join(RESULTS, pin.file)), pin.file
  assert pin.file in _block_of(text, at), (
      f"{pin.doc}: the text around {pin.quote!r} does not cite {pin.file}")
  texts = [s for s in pin.specs if isinstance(s, tuple) and s[0] == "text"]
  for _, path in texts:
    held = _get(pin.file, path)
    held = "\n".join(held) if isinstance(held, list) else held
    if "\n" in held:  # Printed output: line by line, as printed.
      assert pin.quote in held, (pin.quote, held)
    else:  # Prose: the doc may wrap it.
      assert " ".join(pin.quote.split()) in held, (pin.quote, held)
  if texts:
    return
  printed = _numbers(pin.quote)
  assert len(printed) == len(pin.specs), (
      f"{pin.quote!r} prints {len(printed)} numbers, the pin names "
      f"{len(pin.specs)}")
  for (shown, tol), spec in zip(printed, pin.specs):
    if spec is None:
      continue
    value = float(_value(pin.file, spec))
    assert abs(shown - value) <= tol * (1 + 1e-9), (
        f"{pin.doc} prints {shown} in {pin.quote!r}; {pin.file} {spec} "
        f"holds {value}")


# ------------------------------------------------------------ coverage
FIGURE = re.compile(
    r"(?<![\w.])[-+−~]?\d+(?:\.\d+)?(?:\s?(?:×|x\b|%|GiB|MiB|GB|MB|ms\b|s\b"
    r"|min\b|minutes\b|nats\b|tok/s))|(?<![\w.])\d+\.\d+(?![\w.])")


def _scanned(doc: str) -> list[tuple[int, int]]:
  text = _text(doc)
  return ([(0, len(text))] if doc == R else _results_heads(text))


def _unpinned(doc: str) -> list[str]:
  text = _text(doc)
  covered = []
  for pin in PINS:
    if pin.doc == doc:
      at = text.find(pin.quote)
      while at >= 0:
        covered.append((at, at + len(pin.quote)))
        at = text.find(pin.quote, at + 1)
  for pattern, _ in NOT_FIGURES:
    covered += [m.span() for m in re.finditer(pattern, text)]
  # Commands and code spans are what to type, not what was measured; a
  # fenced block other than a job's printed output is a command.
  for m in re.finditer(r"```bash.*?```|`[^`\n]*`|\]\([^)]*\)", text, re.S):
    covered.append(m.span())
  out = []
  for start, end in _scanned(doc):
    for m in FIGURE.finditer(text, start, end):
      if not any(s <= m.start() and m.end() <= e for s, e in covered):
        line = text.count("\n", 0, m.start()) + 1
        out.append(f"{doc}:{line}: {m.group()!r} in "
                   f"{text[max(0, m.start() - 40):m.end() + 20]!r}")
  return out


@pytest.mark.parametrize("doc", [R, D])
def test_every_figure_is_pinned(doc):
  missing = _unpinned(doc)
  assert not missing, "figures without a pin:\n" + "\n".join(missing)


def test_every_results_section_opens_with_a_cited_result():
  """Each `## ` section of docs/results.md opens with its current figures
  and names the file they come from."""
  text = _text(D)
  files = [n for n in os.listdir(RESULTS) if n.endswith(".json")]
  for start, end in _results_heads(text):
    head = text[start:end]
    assert "**Now**" in head and any(n in head for n in files), (
        head.splitlines()[0])


# Files under benchmarks/results/ that are inputs, not quoted results.
NOT_RECORDS = {
    "engine_costs_cpu.json": "the simulator's CPU decode profile, written "
                             "by benchmarks.engine --calibration_out",
}


def test_every_results_file_is_a_record():
  """Each committed result says when and how it was taken."""
  for name in sorted(os.listdir(RESULTS)):
    if name.endswith(".json") and name not in NOT_RECORDS:
      keys = set(_load(name))
      assert "date" in keys and keys & {"command", "commands"}, (
          name, sorted(keys)[:10])
