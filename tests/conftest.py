"""Test setup: 8 fake CPU devices, set before JAX initialises its backend.

Tiers: `pytest -m "not slow" tests` skips the end-to-end runs (whole jobs,
Ray clusters, multi-process launches); `.ci/run` runs everything.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _share_compiled_programs() -> None:
  """One persistent compilation cache for the session (its xdist workers
  and the processes tests start inherit it through the environment): a job
  rebuilt by another test, or rerun after an interruption, compiles the
  same programs, so only the first compile of each is paid. A fresh
  directory each session (a clean checkout shares nothing with an older
  run); the size limit turns on JAX's file lock, so processes writing the
  same entry at once are safe."""
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  path = tempfile.mkdtemp(prefix="rlhf_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 << 30)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
  atexit.register(shutil.rmtree, path, ignore_errors=True)


_share_compiled_programs()

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

from rlhf_jax.parallel import mesh as mesh_lib  # noqa: E402
import fakes  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="session")
def mesh8():
  """The 8-device training mesh (FSDP 8)."""
  assert jax.device_count() == 8, "tests need 8 fake CPU devices"
  return mesh_lib.make_mesh(fsdp=-1)


@pytest.fixture(scope="session")
def mesh1():
  """A one-device mesh, the reference for sharded results."""
  return mesh_lib.make_mesh(fsdp=1, devices=jax.devices()[:1])


@pytest.fixture
def round_clock():
  return fakes.Clock()
