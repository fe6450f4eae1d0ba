"""`--compilation_cache`: a rerun loads what the first run compiled and
computes the same metrics; several fake CPU devices need XLA:CPU's
concurrency-optimized scheduler off first (one clear error otherwise)."""

import os
import re

import pytest

from resume import records, run_main
from rlhf_jax import compile_cache
from rlhf_jax.errors import ConfigError


def test_cache_dir_follows_the_setting(monkeypatch):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  assert compile_cache.cache_dir("off", "/w", "gpu") is None
  assert compile_cache.cache_dir("auto", "/w", "gpu") == "/w/xla_cache"
  assert compile_cache.cache_dir("auto", "/w", "tpu") == "/w/xla_cache"
  assert compile_cache.cache_dir("auto", "/w", "cpu") is None
  assert compile_cache.cache_dir("/c", "/w", "cpu") == "/c"
  monkeypatch.setenv(compile_cache.ENV, "/env")  # JAX's own variable wins.
  assert compile_cache.cache_dir("auto", "/w", "cpu") == "/env"
  assert compile_cache.cache_dir("auto", "/w", "gpu") == "/env"


def test_fake_cpu_devices_with_the_scheduler_on_are_refused(tmp_path):
  before = os.environ.get(compile_cache.ENV)
  with pytest.raises(ConfigError, match=re.escape(
      "on 8 CPU devices needs XLA_FLAGS=" + compile_cache.CPU_SAFE_FLAG)):
    compile_cache.setup(str(tmp_path), str(tmp_path), xla_flags=(
        "--xla_force_host_platform_device_count=8"))
  assert os.environ.get(compile_cache.ENV) == before  # Nothing was set.


@pytest.mark.slow
def test_rerun_loads_every_program_and_computes_the_same(tmp_path):
  """Two runs of one config in fresh workdirs on one cache (8 devices,
  the scheduler off as in every test): the second compiles nothing, loads
  each program the first one compiled or loaded, and its metrics equal
  the first's."""
  cache = tmp_path / "cache"
  summaries, runs = [], []
  for name in ("first", "second"):
    workdir = tmp_path / name
    out = run_main(["--config=configs/tiny_grpo.py:runlocal",
                    "--config.train.steps=2", f"--workdir={workdir}",
                    f"--compilation_cache={cache}"])
    assert out.returncode == 0, out.stderr[-3000:]
    line = re.search(r"compilation cache \S+: (\d+) programs loaded "
                     r"\(.*\), (\d+) compiled and written", out.stderr)
    assert line, out.stderr[-3000:]
    summaries.append((int(line[1]), int(line[2])))
    runs.append(records(workdir))
  (loaded_1, written_1), (loaded_2, written_2) = summaries
  # One run may load a program it compiled itself (the same program from
  # another jitted function); the rerun loads every one.
  assert written_1 > 0
  assert written_2 == 0 and loaded_2 == loaded_1 + written_1, summaries
  assert runs[0] == runs[1]
