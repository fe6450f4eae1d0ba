"""The house's import rules, read from the source (every import statement,
those inside functions too): no module imports itself back through others,
the rooms stand in floors (no room imports one that imports it), and the
rules DESIGN.md states hold."""

import ast
import functools
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "rlhf_jax")


def _modules() -> dict[str, str]:
  """Module name -> file of every module of the package."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(
            os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


MODULES = _modules()


def _imports(path: str) -> set[str]:
  """Every name an import statement of `path` names (absolute imports:
  the package uses no relative ones), the module or `module.attr`."""
  names = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, f"{path}: a relative import"
      names.update(f"{node.module}.{a.name}" for a in node.names)
      names.add(node.module)
  return names


@functools.cache
def _graph() -> dict[str, set[str]]:
  """Module -> the package's modules it imports (`from a import b`: a.b
  when b is a module, else a). Parsed once per run (every file: ~1 s); the
  tests only read it."""
  graph = {}
  for name, path in MODULES.items():
    deps = set()
    for imported in _imports(path):
      if imported in MODULES:
        deps.add(imported)
      elif imported.rpartition(".")[0] in MODULES and "." in imported:
        deps.add(imported.rpartition(".")[0])
    deps.discard(name)
    # A submodule import also runs its package's __init__ (a dependence
    # only when that package is not the importer's own ancestor).
    graph[name] = {d for d in deps if not name.startswith(d + ".")}
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` (its nodes in order, the first repeated), or
  None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def _room(module: str) -> str:
  """rlhf_jax.engine.driver -> engine; rlhf_jax.metrics -> metrics."""
  return module.split(".")[1] if "." in module else module


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_itself_back():
  assert len(MODULES) > 100  # The walk found the package.
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_rooms_stand_in_floors():
  """No room imports a room that imports it, so each has a floor: one
  above every room it imports."""
  rooms = {}
  for module, deps in _graph().items():
    rooms.setdefault(_room(module), set()).update(
        _room(d) for d in deps if _room(d) != _room(module))
  cycle = _cycle(rooms)
  assert cycle is None, "rooms import each other: " + " -> ".join(cycle)


@pytest.mark.parametrize("room,forbidden", [
    # The simulator is a consumer of the rules, never a library.
    *[(room, {"sim"}) for room in (
        "engine", "rl", "rollout", "trainers", "workers", "sched", "models",
        "parallel", "config", "data", "rewards", "envs", "serving")],
    # The endpoint speaks HTTP to sessions; it drives no engine or job.
    ("serving", {"engine", "rollout", "trainers", "workers", "rl",
                 "scoring"}),
    # Models know logical axis names, not jobs.
    ("models", {"config", "rl", "engine", "rollout", "trainers", "data"}),
    # The engine decodes; it neither reads job config nor scores.
    ("engine", {"config", "rl", "rewards", "rollout", "trainers", "workers",
                "scoring"}),
    # The RL math knows samples, not who made them or how they are scored.
    ("rl", {"engine", "rollout", "workers", "trainers", "config",
            "scoring"}),
    # Scoring is the trainers' and the rollout's business, not the
    # engine's: it reads samples and the weights it is given.
    ("scoring", {"engine", "rollout", "trainers", "workers"}),
])
def test_a_room_does_not_import_the_rooms_above_it(room, forbidden):
  bad = sorted(f"{m} -> {d}" for m, deps in _graph().items()
               if _room(m) == room for d in deps if _room(d) in forbidden)
  assert not bad, bad


def test_the_engine_knows_nothing_of_scoring():
  """Its tail controller reports the replicas it frees; the work it is
  given (`scoring/fused.py`) scores there."""
  bad = []
  for name, path in MODULES.items():
    if _room(name) == "engine":
      bad += [f"{path}:{i}" for i, line in enumerate(open(path), 1)
              if "scor" in line.lower()]
  assert not bad, bad


def test_sched_is_plain_python():
  """`sched/` decides from what a scheduler observes: no arrays."""
  bad = sorted(f"{name}: {imp}" for name, path in MODULES.items()
               if _room(name) == "sched" for imp in _imports(path)
               if imp.split(".")[0] in ("jax", "numpy", "flax", "optax"))
  assert not bad, bad


def test_no_file_name_in_two_rooms():
  """A module's name says which one it is: no two rooms hold files of the
  same name (`models/tokenizer.py` beside `data/tokenizer.py` once)."""
  rooms = {}
  for name, path in MODULES.items():
    base = os.path.basename(path)
    if base != "__init__.py":
      rooms.setdefault(base, []).append(name)
  twins = {base: names for base, names in rooms.items() if len(names) > 1}
  assert not twins, twins
