"""docs/sim.md's headline tables, pinned: every number the doc prints for a
simulator config is re-run here (the committed config, 20 steps) and must
lie within the doc's printed precision.

Tolerance: a number printed with d decimals must be within one unit of its
last digit (10**-d) of the simulator's value, in the doc's unit ("1.54×" ->
the ratio +- 0.01, "+19.6%" -> the gain +- 0.1 percentage points, "18.6k"
tokens/s -> +- 100 tokens/s, "+26" -> +- 1 point). The oracle is the doc;
the per-headline arithmetic (relative error, best-seed margin, mean vs
"up to") is recomputed here from the simulator's per-case values.

The full configs take ~1.5 min on 2 cores, hence `slow`;
`test_doc_rows_name_every_sim_config` is fast.
"""

import functools
import glob
import importlib.util
import os
import re

import pytest

from rlhf_jax.sim import reproduce

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "sim.md")


def _pct(xs):
  return [100 * x for x in xs]


def _range(h):
  return [min(h["per_case"]), max(h["per_case"])]


# One entry per row of "## Reproduced headlines", in the doc's order:
# (config, index of its headline, the numbers the row's "ours" cell prints
# as a function of the config's headlines H, in the doc's units).
REPRODUCED = [
    ("rlboost_qwen3_8b", 0, lambda H: [H[0]["ours"], *H[0]["per_case"]]),
    ("rlboost_qwen3_8b", 1, lambda H: _pct([H[1]["ours"], *H[1]["per_case"]])),
    ("rlboost_qwen3_8b", 2, lambda H: [H[2]["ours"], *H[2]["per_case"]]),
    ("rlboost_qwen3_8b", 3, lambda H: _pct([H[3]["ours"], *H[3]["per_case"]])),
    ("rlboost_qwen3_14b", 0, lambda H: [H[0]["ours"], *H[0]["per_case"]]),
    ("rlboost_qwen3_14b", 1,
     lambda H: _pct([H[1]["ours"], *H[1]["per_case"]])),
    ("rlboost_qwen3_14b", 2,
     lambda H: _pct([H[2]["ours"], *H[2]["per_case"]])),
    ("rlboost_qwen3_32b", 0, lambda H: [H[0]["ours"], *H[0]["per_case"]]),
    ("rlboost_qwen3_32b", 1,
     lambda H: _pct([H[1]["ours"], *H[1]["per_case"]])),
    ("rlboost_qwen3_32b", 2,
     lambda H: _pct([H[2]["ours"], *H[2]["per_case"]])),
    ("rlboost_static_spot", 0, lambda H: [H[0]["ours"]]),
    # The doc prints the change of the cost per token: -(the reduction).
    ("rlboost_static_spot", 1, lambda H: [-100 * H[1]["ours"]]),
    ("rlboost_fault", 0, lambda H: [100 * H[0]["ours"]]),
    # "0% (150 s: 49.7%)": the 200 s fault, then the 150 s one.
    ("rlboost_fault", 2, lambda H: [100 * H[2]["ours"], 150,
                                    100 * H[1]["ours"]]),
    ("rlboost_seeding_ablation", 0, lambda H: [H[0]["ours"]]),
    ("rlboost_seeding_ablation", 1, lambda H: [H[1]["ours"]]),
    ("rlhfless_testbed", 0, lambda H: [H[0]["ours"], *_range(H[0])]),
    ("rlhfless_testbed", 1, lambda H: _pct([H[1]["ours"], *_range(H[1])])),
    ("rlhfless_testbed", 2, lambda H: [100 * H[2]["ours"]]),
    ("rlhfless_sim20", 0, lambda H: [H[0]["ours"]]),
    ("rlhfless_sim20", 1, lambda H: [100 * H[1]["ours"]]),
    ("rlhfuse", 0, lambda H: [H[0]["ours"], *_range(H[0])]),
    ("rlhfuse", 1, lambda H: [H[1]["ours"]]),
    ("rlhfuse", 2, lambda H: [H[2]["ours"], *_range(H[2])]),
]
SEEDS = ("rlhfuse", "rlhfless", "rlboost")  # combined.py's seed policies.


# -------------------------------------------------------------- the doc
def _doc() -> str:
  with open(DOC, encoding="utf-8") as f:
    return f.read()


def _section(title: str) -> str:
  text = _doc()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end >= 0 else None]


def _table(section: str) -> list[list[str]]:
  """Body rows (header and rule dropped) of the section's first table."""
  lines = [l for l in section.splitlines() if l.startswith("|")]
  rows = [[c.strip() for c in l.strip().strip("|").split("|")]
          for l in lines]
  assert set(rows[1][0]) <= set("-: "), rows[1]  # The header rule.
  return rows[2:]


def _numbers(cell: str) -> list[tuple[float, float]]:
  """(value, tolerance) of each number in a cell: ASCII '-' between digits
  is a range ("0.91-0.95"), U+2212 a minus sign; the tolerance is one unit
  of the number's last printed digit."""
  cell = re.sub(r"(?<=\d)-(?=\d)", " ", cell.replace("**", ""))
  cell = cell.replace("\u2212", "-")
  out = []
  for m in re.finditer(r"[+-]?\d+(?:\.(\d+))?", cell):
    decimals = len(m.group(1) or "")
    out.append((float(m.group(0)), 10.0 ** -decimals))
  return out


def _assert_cell(cell: str, want: list[float], what: str):
  got = _numbers(cell)
  assert len(got) == len(want), (what, cell, want)
  for (value, tol), w in zip(got, want):
    # 1e-9: a value exactly half a unit away is still within one unit.
    assert abs(value - w) <= tol + 1e-9, (
        f"{what}: the doc prints {value} (+-{tol}), the simulator gives "
        f"{w:.4f}; cell {cell!r}")


# ------------------------------------------------------------ the runs
def _config_path(name: str) -> str:
  return os.path.join(ROOT, "configs", "sim", f"{name}.py")


@functools.lru_cache(maxsize=None)
def _reproduce(name: str):
  spec = importlib.util.spec_from_file_location(f"sim_cfg_{name}",
                                                _config_path(name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return reproduce.reproduce(module.get_config(None))


def test_doc_rows_name_every_sim_config():
  """The pinned rows are the doc's rows, and every config is pinned."""
  rows = _table(_section("Reproduced headlines"))
  assert [r[0] for r in rows] == [name for name, _, _ in REPRODUCED]
  configs = {os.path.basename(p)[:-3]
             for p in glob.glob(os.path.join(ROOT, "configs/sim/*.py"))
             if not p.endswith(("__init__.py", "common.py"))}
  assert configs == {name for name, _, _ in REPRODUCED} | {"combined",
                                                             "async_rl"}
  combined = _table(_section("Ours: the combined policy"))
  assert [r[0] for r in combined] == ["A", "B", "C"]
  # Every "ours" cell holds numbers to compare (a row of words would pass
  # vacuously).
  for r in rows:
    assert _numbers(r[3]), r


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted({n for n, _, _ in REPRODUCED}))
def test_reproduced_headlines_match_doc(name):
  rows = _table(_section("Reproduced headlines"))
  _, headlines = _reproduce(name)
  checked = 0
  for row, (config, index, numbers) in zip(rows, REPRODUCED):
    if config != name:
      continue
    checked += 1
    _, what, _, ours_cell, rel_cell, within_cell = row
    h = headlines[index]
    _assert_cell(ours_cell, numbers(headlines), f"{name}: {what}")
    # Relative error vs the paper's number (its midpoint for a range).
    rel = abs(h["ours"] - h["paper"]) / abs(h["paper"])
    _assert_cell(rel_cell.split()[0], [100 * rel], f"{name}: {what}, error")
    assert within_cell.startswith("yes") == (rel <= 0.20), (
        name, what, rel, within_cell)
  assert checked == sum(1 for n, _, _ in REPRODUCED if n == name)


@pytest.mark.slow
def test_combined_policy_table_matches_doc():
  section = _section("Ours: the combined policy")
  table, headlines = _reproduce("combined")
  by = {(r["case"], r["policy"]): r for r in table}
  for row in _table(section):
    seg = row[0]
    tps = {p: by[f"segment_{seg}", p]["tokens_per_s"]
           for p in ("baseline", *SEEDS, "combined")}
    tpd = {p: by[f"segment_{seg}", p]["trained_tokens_per_dollar"]
           for p in ("rlboost", "combined")}
    for cell, policy in zip(row[1:6], ("baseline", *SEEDS, "combined")):
      _assert_cell(cell, [tps[policy] / 1e3], f"{seg} {policy} tokens/s")
    best = max(tps[p] for p in SEEDS)
    _assert_cell(row[6], [100 * (tps["combined"] / best - 1)],
                 f"{seg} best seed -> combined")
    _assert_cell(row[7], [tpd["rlboost"] / 1e3, tpd["combined"] / 1e3,
                          100 * (tpd["combined"] / tpd["rlboost"] - 1)],
                 f"{seg} trained tokens per $")
  # "+0.21 ahead on throughput and +0.15 on cost efficiency (1.71x vs veRL
  # on average; RLBoost 1.50x)".
  prose = re.search(r"In ratio-to-veRL points.*?RLBoost [\d.]+\u00d7\)",
                    section, re.S).group(0)
  rlboost = [by[c, "rlboost"]["tokens_per_s"] / by[c, "baseline"][
      "tokens_per_s"] for c in ("segment_A", "segment_B", "segment_C")]
  _assert_cell(prose, [headlines[0]["ours"], headlines[1]["ours"],
                       headlines[2]["ours"], sum(rlboost) / 3],
               "combined, prose")
  # "It beats the best single seed on both metrics in every segment."
  assert all(v > 0 for v in headlines[0]["per_case"] + headlines[1][
      "per_case"]), headlines[:2]


@pytest.mark.slow
def test_async_table_matches_doc():
  """The committed config's row (eta = 4): the split, the step, the ratio
  and the cost model's split and step the doc prints; that split's step
  within 5% of the best of the eight splits the simulator tries."""
  rows = {r[0].replace("**", "").split()[0]: r
          for r in _table(_section("Ours: async RL"))}
  table, headlines = _reproduce("async_rl")
  by = {r["policy"]: r for r in table}
  _, devices, step, ratio, rule, rule_step = rows["4"]
  a = by["async"]
  _assert_cell(devices, [a["rollout_devices"]], "split")
  _assert_cell(rule, [a["cost_model_rollout_devices"]], "cost model split")
  _assert_cell(rule_step, [a["cost_model_step_s"],
                           100 * (a["cost_model_step_s"] / a["step_s"] - 1)],
               "cost model's step s")
  assert a["cost_model_step_s"] <= 1.05 * a["step_s"]
  _assert_cell(step, [by["async"]["step_s"]], "step s")
  assert f"(sync {by['baseline']['step_s']:.1f})" in _section(
      "Ours: async RL")
  _assert_cell(ratio, [headlines[0]["ours"]], "throughput vs sync")
  assert headlines[0]["ours"] >= 2.0
