"""pyproject.toml states ranges; requirements*.txt are the exact lock.

A user's environment with newer releases must keep them (`pip install -e .`
never downgrades), while CI installs the lock. The rule that ties the two:
every locked library is a dependency whose floor is the locked release
(the floor is what the suite ran on), with no upper bound, and the `test`
extra pins exactly what requirements-test.txt adds.
"""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lock(name: str) -> dict[str, str]:
  """name -> version of a requirements file's `pkg==version` lines."""
  out = {}
  with open(os.path.join(ROOT, name)) as f:
    for line in f:
      line = line.split("#")[0].strip()
      if line and not line.startswith("-r"):
        pkg, version = line.split("==")
        out[_norm(pkg)] = version
  return out


def _norm(pkg: str) -> str:
  return re.sub(r"[-_.]+", "-", pkg).lower()


def _specs(reqs: list[str]) -> dict[str, str]:
  """name -> specifier of pyproject requirement strings ('jax>=0.10.2')."""
  out = {}
  for r in reqs:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?(.*)", r.replace(" ", ""))
    out[_norm(m.group(1))] = m.group(3)
  return out


def _project():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def test_dependencies_are_ranges_floored_at_the_lock():
  deps = _specs(_project()["dependencies"])
  lock = _lock("requirements.txt")
  assert set(deps) == set(lock), set(deps) ^ set(lock)
  for pkg, version in lock.items():
    assert deps[pkg] == f">={version}", (pkg, deps[pkg], version)


def test_test_extra_equals_requirements_test():
  extra = _specs(_project()["optional-dependencies"]["test"])
  lock = _lock("requirements-test.txt")
  assert extra == {pkg: f"=={v}" for pkg, v in lock.items()}


def test_accelerator_extras_take_jax_own_extras():
  extras = _project()["optional-dependencies"]
  floor = _lock("requirements.txt")["jax"]
  for name in ("cuda12", "cuda13", "tpu"):
    assert extras[name] == [f"jax[{name}]>={floor}"], (name, extras[name])
