"""Test setup: 8 fake CPU devices, set before JAX initialises its backend.

Tiers: `pytest -m "not slow" tests` skips the end-to-end runs (whole jobs,
Ray clusters, multi-process launches); `.ci/run` runs everything.

On an accelerator (`JAX_PLATFORMS=cuda pytest tests/test_hf.py ...`, the
[gpu] checks of docs/results.md) the tests that need the 8-device mesh
skip, and fp32 matmuls run at full precision: the parity tests compare
fp32 results with fp64 and torch oracles, and XLA's GPU default (TF32)
would be ~1e-3 off.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

if jax.default_backend() != "cpu":
  jax.config.update("jax_default_matmul_precision", "highest")

from rlhf_jax.parallel import mesh as mesh_lib  # noqa: E402
import fakes  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="session", autouse=True)
def subprocess_compilation_cache(tmp_path_factory):
  """The jobs tests start as subprocesses share one XLA compilation cache per
  run, so a rerun or a second process loads its programs instead of
  compiling them again (same executables, same numbers). Set in os.environ
  after `import jax` on purpose: JAX read its flags then, so this process
  keeps compiling as before and only the children use the cache."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # Shared by the xdist workers of this run.
  os.environ.update(
      JAX_COMPILATION_CACHE_DIR=str(root / "xla_cache"),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


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


@pytest.fixture
def round_clock():
  return fakes.Clock()
