"""Typed config sections from ConfigDicts, and the checks every section
uses. The ground floor of configuration: it imports nothing of rlhf_jax
but its errors, so any room can describe its own section (the config
sections in `config/sections.py`, the data kinds in `data/sources.py`).

A section is a frozen dataclass with a `PATH` (its key in the config,
for messages) that validates itself in `__post_init__` with the helpers
here, each raising a one-line `ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_collections

from rlhf_jax.errors import ConfigError


# ------------------------------------------------------------------ checks
def fail(section, key: str, message: str):
  raise ConfigError(f"config.{section.PATH}.{key}={getattr(section, key)!r}: "
                    f"{message}")


def positive_ints(section, *keys) -> None:
  for key in keys:
    v = getattr(section, key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      fail(section, key, "must be a positive int")


def one_of(section, key: str, choices) -> None:
  if getattr(section, key) not in choices:
    fail(section, key, f"must be one of {list(choices)}")


def in_range(section, key: str, lo: float, hi: float) -> None:
  if not lo <= getattr(section, key) <= hi:
    fail(section, key, f"must be in [{lo}, {hi}]")


# --------------------------------------------------------- dict <-> object
def config_dict(cls, **overrides) -> ml_collections.ConfigDict:
  """A config section with every key of `cls` at its default, then
  `overrides` (values, or nested ConfigDicts/dicts for nested sections)."""
  out = ml_collections.ConfigDict(to_dict(cls()))
  for key, value in overrides.items():
    if key not in out:
      raise ConfigError(f"{cls.__name__} has no key {key!r}; known: "
                        f"{sorted(out.keys())}")
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out[key].update(dict(value))
    else:
      out[key] = value
  return out


def to_dict(obj) -> dict[str, Any]:
  """The plain-dict form of a section (for logs and `config.json`)."""
  return {f.name: (to_dict(getattr(obj, f.name))
                   if dataclasses.is_dataclass(getattr(obj, f.name))
                   else getattr(obj, f.name))
          for f in dataclasses.fields(obj)}


def from_dict(cls, d, path: str):
  """`cls` from the mapping `d` (a ConfigDict section), strictly: every
  field present, no other key; nested sections recursively."""
  known = [f.name for f in dataclasses.fields(cls)]
  keys = set(d.keys())
  missing = [k for k in known if k not in keys]
  if missing:
    raise ConfigError(
        f"config.{path} has no key {missing[0]!r} (missing: {missing}); "
        f"build the section with rlhf_jax.typed_config.config_dict("
        f"{cls.__name__}, ...)")
  extra = sorted(keys - set(known))
  if extra:
    raise ConfigError(f"config.{path}.{extra[0]} is not a known key; "
                      f"known: {known}")
  hints = typing.get_type_hints(cls)
  values = {}
  for name in known:
    value, kind = d[name], hints[name]
    if dataclasses.is_dataclass(kind):
      value = from_dict(kind, value, f"{path}.{name}")
    elif kind is tuple or typing.get_origin(kind) is tuple:
      value = tuple(value)
    elif kind is dict:
      value = dict(value)
    elif kind is float and isinstance(value, int) and not isinstance(
        value, bool):
      value = float(value)
    values[name] = value
  return cls(**values)


def from_saved(cls, d, path: str):
  """`cls` from a section saved in a workdir's config.json, keys missing
  there (saved by an older version) at their defaults."""
  merged = to_dict(cls())
  merged.update({k: v for k, v in dict(d).items() if k in merged})
  return from_dict(cls, merged, path)


def from_partial(cls, d, path: str):
  """`cls` from the mapping `d`, keys it does not set at their defaults
  and any other key refused (a section written as a plain dict)."""
  known = [f.name for f in dataclasses.fields(cls)]
  extra = sorted(set(d.keys()) - set(known))
  if extra:
    raise ConfigError(f"config.{path}.{extra[0]} is not a known key; "
                      f"known: {known}")
  merged = to_dict(cls())
  merged.update(dict(d))
  return from_dict(cls, merged, path)
