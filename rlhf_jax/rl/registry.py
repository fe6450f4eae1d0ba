"""Registries of swappable pieces, chosen by a config string.

One decorator style for every category:

  @registry.register("advantage", "grpo")
  def grpo_advantages(rewards_B, group_size, *, eps=1e-6): ...

  fn = registry.get("advantage", config.rl.advantage)

An entry can carry properties the checks read, stated beside the function:

  @registry.register("advantage", "rloo", group=True, group_local=True)

  registry.has("advantage", "rloo", "group_local")  # True

Categories are a whitelist; each one names the module (or package: every
module in it) that registers its built-in entries, and `get` imports it on
first use, so callers never depend on import order to find a built-in name.
A new reward file in `rlhf_jax/rewards/` is found without editing another
module. User code can register more entries in an existing category from
its own modules.

The reward category lives here too, although rewards are not RL math, so that
there is a single registry style in the code base; this module imports nothing
from the rest of `rlhf_jax`.
"""

import importlib
import pkgutil
from typing import Callable, TypeVar

from rlhf_jax.errors import ConfigError

_F = TypeVar("_F", bound=Callable)

# category -> module or package that registers its built-in entries.
CATEGORIES: dict[str, str] = {
    "advantage": "rlhf_jax.rl.advantages",
    "policy_loss": "rlhf_jax.rl.losses",
    "kl_estimator": "rlhf_jax.rl.losses",
    "aggregation": "rlhf_jax.rl.aggregation",
    "reward": "rlhf_jax.rewards",
}

_ENTRIES: dict[str, dict[str, Callable]] = {c: {} for c in CATEGORIES}
# category -> name -> the properties given to `register` (what the
# config checks ask of an entry, e.g. whether an advantage is per group).
_PROPERTIES: dict[str, dict[str, dict[str, object]]] = {
    c: {} for c in CATEGORIES}
# The modules and packages of `CATEGORIES` already imported: listing a
# package's modules reads its directory, so once per process rather than
# once per lookup (rewards are looked up for every scored group).
_LOADED: set[str] = set()


def _check_category(category: str) -> None:
  if category not in CATEGORIES:
    raise ValueError(
        f"Unknown registry category {category!r}; known categories: "
        f"{sorted(CATEGORIES)}."
    )


def register(category: str, name: str,
             **properties: object) -> Callable[[_F], _F]:
  """Returns a decorator that registers a function under `category/name`.

  Args:
    category: one of `CATEGORIES`.
    name: the config string that selects the function.
    **properties: facts about the entry that checks read with `has`
      (a property not given is False).

  Returns:
    A decorator that registers its argument and returns it unchanged.
  """
  _check_category(category)

  def decorator(fn: _F) -> _F:
    entries = _ENTRIES[category]
    old = entries.get(name)
    # Re-registering the same definition (a module reload) is harmless; two
    # different functions under one name is a silent-override bug.
    if old is not None and _qualname(old) != _qualname(fn):
      raise ValueError(
          f"{category}/{name} is already registered to {_qualname(old)}; "
          f"cannot register {_qualname(fn)}."
      )
    entries[name] = fn
    _PROPERTIES[category][name] = dict(properties)
    return fn

  return decorator


def get(category: str, name: str) -> Callable:
  """Returns the function registered as `category/name`.

  Args:
    category: one of `CATEGORIES`.
    name: a registered name.

  Returns:
    The registered function.

  Raises:
    ValueError: unknown category or name; the message lists the known ones.
  """
  _check_category(category)
  _load_builtins(category)
  entries = _ENTRIES[category]
  if name not in entries:
    raise ConfigError(
        f"Unknown {category} {name!r}; known {category} names: "
        f"{sorted(entries)}."
    )
  return entries[name]


def has(category: str, name: str, prop: str) -> bool:
  """Whether `category/name` was registered with `prop` true (a property
  not given is False)."""
  get(category, name)  # Loads built-ins; an unknown name fails here.
  return bool(_PROPERTIES[category][name].get(prop))


def property_of(category: str, name: str, prop: str, default=None):
  """The value `category/name` was registered with for `prop` (`default`
  when not given), e.g. a reward's answer extraction."""
  get(category, name)  # Loads built-ins; an unknown name fails here.
  return _PROPERTIES[category][name].get(prop, default)


def names_with(category: str, prop: str) -> list[str]:
  """The sorted names of `category` registered with `prop` true (for
  messages that list the choices)."""
  _check_category(category)
  _load_builtins(category)
  return sorted(n for n, p in _PROPERTIES[category].items() if p.get(prop))


def names(category: str) -> list[str]:
  """Returns the sorted registered names of `category`.

  Args:
    category: one of `CATEGORIES`.

  Returns:
    Sorted list of names, built-ins included.
  """
  _check_category(category)
  _load_builtins(category)
  return sorted(_ENTRIES[category])


def _load_builtins(category: str) -> None:
  """Imports the category's module, or every module of its package (once)."""
  name = CATEGORIES[category]
  if name in _LOADED:
    return
  module = importlib.import_module(name)
  for info in pkgutil.iter_modules(getattr(module, "__path__", ())):
    importlib.import_module(f"{module.__name__}.{info.name}")
  _LOADED.add(name)


def _qualname(fn: Callable) -> str:
  """`module.qualname` of a function, for duplicate detection and messages."""
  return f"{fn.__module__}.{fn.__qualname__}"
