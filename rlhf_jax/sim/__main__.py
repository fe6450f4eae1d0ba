"""Runs a simulator config: python -m rlhf_jax.sim --config=configs/sim/x.py.

Prints a per-case, per-policy table, then the headline comparisons, and ends
with one JSON line: {"headline", "paper", "ours", "rel_error", ...}.
"""

import json

from absl import app
from absl import flags
from ml_collections import config_flags

from rlhf_jax import cli
from rlhf_jax.sim import accounting
from rlhf_jax.sim import reproduce

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Simulator config file.", lock_config=True)
_TRACE = flags.DEFINE_string(
    "trace_out", "", "If set, write case 0's timelines (Chrome trace JSON) "
    "here, one file per policy: <trace_out>.<policy>.json.")


def main(argv):
  del argv
  config = _CONFIG.value
  with cli.user_errors(verbose=False):  # A missing or bad trace: one line.
    rows, headlines = reproduce.reproduce(config)
  print(reproduce.format_table(rows))
  print()
  for h in headlines:
    print(f"{h['headline']}: paper={h['paper']} ours={h['ours']} "
          f"rel_error={h['rel_error']} per_case={h['per_case']}")
  if _TRACE.value:
    for name, results in reproduce.results_of(config).items():
      accounting.write_chrome_trace(f"{_TRACE.value}.{name}.json", results)
  last = dict(headlines[0])
  last["others"] = headlines[1:]
  print(json.dumps(last))


if __name__ == "__main__":
  app.run(main)
