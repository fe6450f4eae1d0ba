"""JAX's persistent compilation cache for a job (`--compilation_cache`).

A job that resumes after a preemption, a rerun of the same config, and the
processes and Ray workers a job starts (they inherit JAX_COMPILATION_CACHE_DIR)
load the programs an earlier process compiled instead of compiling them
again. JAX keys an entry on the program, its compile options, XLA_FLAGS, the
devices and the jax version, so a hit is the same executable.

  auto   <workdir>/xla_cache on GPU and TPU (on a shared workdir every host
         and every restart finds it); off on CPU, where programs are cheap
         to compile and a sharded program loaded from the cache can
         deadlock in its collectives on several fake devices unless
         XLA:CPU's concurrency-optimized scheduler is off
         (docs/architecture.md). JAX_COMPILATION_CACHE_DIR, when set, wins.
  off    no cache (unless JAX_COMPILATION_CACHE_DIR is set: JAX reads it).
  PATH   that directory (a local path or one JAX's file API opens, gs://).
"""

from __future__ import annotations

import collections
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from rlhf_jax.errors import ConfigError

ENV = "JAX_COMPILATION_CACHE_DIR"
CPU_SAFE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_EVENTS = {"/jax/compilation_cache/cache_hits": "loaded",
           "/jax/compilation_cache/cache_misses": "written"}
_counts: collections.Counter = collections.Counter()
_listening = False


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event in _EVENTS:
    _counts[_EVENTS[event]] += 1


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
  del kwargs
  if event == "/jax/compilation_cache/compile_time_saved_sec":
    _counts["saved_s"] += duration_secs


def cache_dir(setting: str, workdir: str, backend: str) -> str | None:
  """Where this job's cache goes for `--compilation_cache=setting`."""
  if setting == "off":
    return None
  if setting == "auto":
    if os.environ.get(ENV):
      return os.environ[ENV]
    return None if backend == "cpu" else os.path.join(workdir, "xla_cache")
  return setting


def setup(setting: str, workdir: str, *, xla_flags: str | None = None
          ) -> str | None:
  """Turns the cache on before the job's first compile (and for the
  processes it starts); returns its directory, or None when off.

  Raises:
    ConfigError: a cache on several CPU devices with XLA:CPU's
      concurrency-optimized scheduler on (the deadlock above).
  """
  path = cache_dir(setting, workdir, jax.default_backend())
  if path is None:
    return None
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  if (jax.default_backend() == "cpu" and jax.local_device_count() > 1
      and CPU_SAFE_FLAG not in flags.split()):
    raise ConfigError(
        f"--compilation_cache={setting} on {jax.local_device_count()} CPU "
        f"devices needs XLA_FLAGS={CPU_SAFE_FLAG}: a sharded program loaded "
        "from the cache can deadlock in its collectives otherwise "
        "(docs/architecture.md); or use --compilation_cache=off")
  jax.config.update("jax_compilation_cache_dir", path)
  os.environ[ENV] = path  # Children read it when they import JAX.
  # JAX decides at its first compile whether a cache is in use: decide again.
  compilation_cache.reset_cache()
  global _listening
  if not _listening:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _listening = True
  return path


def summary(path: str) -> str:
  """One line: what this process loaded from and wrote to the cache."""
  return (f"compilation cache {path}: {_counts['loaded']} programs loaded "
          f"({_counts['saved_s']:.1f} s of compiling saved), "
          f"{_counts['written']} compiled and written")
