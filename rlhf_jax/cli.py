"""What a person sees from `rlhf_jax.main`: flag and config-key errors as
one line, user errors without a traceback, only our own INFO logs."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import logging as py_logging
import os
import re
import sys

from absl import flags, logging

from rlhf_jax.errors import UserError

EXIT_USER_ERROR = 2
# Our code: INFO logs from files under these directories are shown.
_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), d) + os.sep
              for d in ("rlhf_jax", "launch", "benchmarks"))


def fail(message: str) -> None:
  """Prints `error: message` (one line) and exits with status 2."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr,
        flush=True)
  sys.exit(EXIT_USER_ERROR)


# ------------------------------------------------------------------ flags
def _config_spec(argv: list[str]) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _load_config(spec: str):
  """The ConfigDict of `path[:arg]`, loaded as ml_collections does."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_rlhf_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _paths(node, prefix: str = "") -> list[str]:
  """Every key path under a ConfigDict / dict."""
  out = []
  for key in node.keys():
    path = f"{prefix}{key}"
    out.append(path)
    child = node[key]
    if hasattr(child, "keys"):
      out += _paths(child, path + ".")
  return out


def unknown_key(config, path: str) -> str | None:
  """A one-line message if `config.<path>` does not exist, else None: the
  full key path, the closest keys beside it and where a key of that name
  lives elsewhere."""
  node, done = config, []
  for part in path.split("."):
    where = "config" + "".join("." + d for d in done)
    if not hasattr(node, "keys"):
      return (f"unknown config key config.{path}: {where} is a "
              f"{type(node).__name__} value, not a section")
    if part in node.keys():
      node, done = node[part], done + [part]
      continue
    close = difflib.get_close_matches(part, list(node.keys()), n=3,
                                      cutoff=0.5)
    elsewhere = [p for p in _paths(config) if p.rsplit(".", 1)[-1] == part]
    hints = [f"{where}.{c}" for c in close] + [f"config.{p}"
                                              for p in elsewhere]
    keys = sorted(node.keys())
    hint = (f"did you mean {' or '.join(hints)}?" if hints else
            f"keys of {where}: {', '.join(keys)}" if keys else
            f"{where} is empty in this config file (add the key there)")
    return f"unknown config key config.{path}; {hint}"
  return None


def _unknown_override(argv: list[str]) -> str | None:
  """The message for the first `--config.<path>` that names no key."""
  spec = _config_spec(argv)
  if not spec:
    return None
  try:
    config = _load_config(spec)
  except Exception:  # pylint: disable=broad-except
    return None  # A bad config file: absl's own message says so.
  for arg in argv:
    if (m := re.match(r"--config\.([^=]+)(=|$)", arg)) and (
        message := unknown_key(config, m[1])):
      return message
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run`'s flags parser: a bad flag or config key is one line. The
  config file is read a second time only when parsing failed, to name an
  unknown key and its closest neighbours."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    if message := _unknown_override(argv):
      fail(message)
    fail(e if isinstance(e, flags.Error)
         else f"bad command line ({type(e).__name__}: {e})")


# ---------------------------------------------------------------- logging
class _OursOnly(py_logging.Filter):
  """Third-party INFO (Orbax, absl, JAX) hidden; warnings always shown."""

  def filter(self, record):
    return (record.levelno >= py_logging.WARNING
            or record.pathname.startswith(_OURS))


def quiet_third_party(verbose: bool) -> None:
  """Hides other libraries' INFO logs unless `verbose`."""
  if verbose:
    return
  logging.get_absl_handler().addFilter(_OursOnly())
  # C++ logs of XLA and tensorstore: warnings and errors only.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


@contextlib.contextmanager
def user_errors(verbose: bool):
  """A `UserError` becomes one line and exit status 2 (the traceback too
  with `verbose`); other exceptions are bugs and propagate."""
  try:
    yield
  except UserError as e:
    if verbose:
      raise
    fail(e)
