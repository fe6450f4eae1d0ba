"""Test setup: 8 fake CPU devices, set before JAX initialises its backend.

Tiers: `pytest -m "not slow" tests` skips the end-to-end runs (whole jobs,
Ray clusters, multi-process launches); `.ci/run` runs everything.

On an accelerator (`JAX_PLATFORMS=cuda pytest tests/models/test_hf.py ...`, the
[gpu] checks of docs/results.md) the tests that need the 8-device mesh
skip, and fp32 matmuls run at full precision: the parity tests compare
fp32 results with fp64 and torch oracles, and XLA's GPU default (TF32)
would be ~1e-3 off.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's concurrency-optimized scheduler off: with it, programs loaded from
# the compilation cache (below) deadlock in their collectives; see
# `compilation_cache`.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"
)
# XLA:CPU's older loop emitter instead of its MLIR fusion emitters: backend
# compiling is most of the suite's time (687 of 1,079 test-seconds in the
# fast tier, 2,055 programs), and the fusion emitters take twice as long to
# compile the same programs (tests/engine/test_paged.py: 34 s of compiling
# with them, 16 s without; 2 cores, jax 0.10.2, 2026-11-30). The test
# programs are tiny, so how well they run matters less. Set for the jobs the
# tests start too (they inherit XLA_FLAGS), so a resumed subprocess and this
# process compute with the same code.
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# One LLVM module per program instead of XLA:CPU's split into parts compiled
# in parallel: on 2 cores, for the tests' small programs, the split costs
# more than it saves (tests/engine/test_paged.py alone on a quiet machine:
# 37.9 and 38.8 s with one module, 40.7 and 41.0 s split, alternated;
# 2026-11-30). How a program is compiled, not what it computes.
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
# On CPU the tests compile with XLA's backend optimizations off (LLVM -O0, no
# expensive passes), here and in every job a test starts (they read the
# variable when they import JAX): the test programs are small and run a few
# times, so compiling is most of a test's time (a profiled packing test: 38
# of 57 s in `backend_compile`); a clean-clone `.ci/run` took 23:18 in pytest
# instead of 29:02 (2 cores, 2026-11-28). The same mode everywhere on purpose: results of the two
# modes differ in the last bits, and resume tests compare a job run here
# with one run as a subprocess to 1e-6. Tests marked `xla_optimized` (many
# steps of one self-contained job: mostly running, not compiling) keep them.
_NO_BACKEND_OPTIMIZATION = os.environ["JAX_PLATFORMS"] == "cpu"
if _NO_BACKEND_OPTIMIZATION:
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"

# torch (the transformers and PEFT oracles) makes /tmp/torchinductor_<user>
# when imported; the run keeps it in a directory of its own that it removes
# at exit (the xdist workers and the jobs tests start inherit the variable).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402
  os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="rlhf-jax-torchinductor-")
  atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  ignore_errors=True)

# Python's cyclic garbage collector less often: tracing and lowering make
# millions of short-lived objects, and at the default thresholds (700, 10,
# 10) the collector ran 1,134 times in tests/engine/test_paged.py, 2.1 s of
# its 35; at these, 29 times, 0.3 s. Arrays are freed by reference counts
# (or `delete`), as in the jobs; the tests that count live device bytes
# collect first and hold collection off while they count
# (tests/parallel/test_repartition.py: `counted_live_bytes`).
import gc  # noqa: E402
gc.set_threshold(20_000, 50, 50)

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

if jax.default_backend() != "cpu":
  jax.config.update("jax_default_matmul_precision", "highest")

from rlhf_jax.parallel import mesh as mesh_lib  # noqa: E402
import fakes  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """One XLA compilation cache per test run, shared by the xdist workers and
  the jobs tests start as subprocesses: a program another test (or the run
  before a resume) already compiled is loaded instead of compiled again.
  The cache is keyed on the program, its compile options, XLA_FLAGS and the
  devices, so a hit is the same executable; it starts empty on every run.

  The subprocesses inherit this process's XLA_FLAGS (8 devices, XLA:CPU's
  concurrency-optimized scheduler off). With that scheduler on, a sharded
  program loaded from the cache can
  deadlock in its first collectives (seen with jax 0.10.2:
  `gsm8k_grpo:runlocal` run twice on one cache aborts every time in the
  train step, 5 devices waiting in an all-reduce and 3 in the all-gather
  before it, the same launch; with the flag 3 of 3 warm runs pass, 33 s
  cold, 12 s warm)."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # Shared by the xdist workers of this run.
  os.environ.update(  # The children read these when they import JAX.
      JAX_COMPILATION_CACHE_DIR=str(root / "xla_cache"),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  jax.config.update("jax_compilation_cache_dir", str(root / "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  cc.reset_cache()  # Checked again at the next compile, with the dir set.


@pytest.fixture(autouse=True)
def xla_optimized(request):
  """Backend optimizations on for a test marked `xla_optimized`, in this
  process and in the jobs it starts (see `_NO_BACKEND_OPTIMIZATION`)."""
  if (not _NO_BACKEND_OPTIMIZATION
      or request.node.get_closest_marker("xla_optimized") is None):
    yield
    return
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", True)
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"


@pytest.fixture(scope="session")
def mesh8():
  """The 8-device training mesh (FSDP 8)."""
  if jax.default_backend() != "cpu":
    pytest.skip("needs the 8 fake CPU devices")
  assert jax.device_count() == 8, "tests need 8 fake CPU devices"
  return mesh_lib.make_mesh(fsdp=-1)


@pytest.fixture(scope="session")
def mesh1():
  """A one-device mesh, the reference for sharded results."""
  return mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])


@pytest.fixture(scope="session")
def tiny_model(mesh8):
  """(graphdef, params) of `fakes.TINY_CFG` on the 8-device training
  layout, seed 0: the engine, multi-turn and agent tests' model. Shared by
  every test of a worker: tests copy or reshard it, never donate it."""
  from rlhf_jax.models import model as model_lib  # pylint: disable=g-import-not-at-top
  return model_lib.init_params(fakes.TINY_CFG, 0,
                               mesh_lib.train_layout(mesh8))


@pytest.fixture
def tiny_grpo_job(mesh8, tmp_path):
  """Builds tiny GRPO jobs: `tiny_grpo_job({"section.key": value, ...})` is
  configs/tiny_grpo.py:runlocal with those overrides, its data prepared in
  a directory of its own under the test's tmp_path, built (`rl_job.build`)
  on the 8 devices. Each call a new job."""
  del mesh8
  import itertools  # pylint: disable=g-import-not-at-top
  import resume  # pylint: disable=g-import-not-at-top
  from configs import tiny_grpo  # pylint: disable=g-import-not-at-top
  from rlhf_jax.data import sources  # pylint: disable=g-import-not-at-top
  from rlhf_jax.trainers import rl_job  # pylint: disable=g-import-not-at-top
  calls = itertools.count()

  def build(overrides=None):
    config = resume.override(tiny_grpo.get_config("runlocal"),
                             **(overrides or {}))
    workdir = tmp_path / f"tiny_grpo_{next(calls)}"
    return rl_job.build(sources.prepare(config, str(workdir)))
  return build


@pytest.fixture
def round_clock():
  return fakes.Clock()
