"""A local Ray cluster whose traffic stays on loopback (127.0.0.1).

Left to itself, Ray 2.60 sends packets off the machine while it starts a
local cluster: it finds the node's address by a UDP connect to a public
DNS resolver's port 53, then serves and connects on the interface address
it got back (not 127/8); and its API-server process (started even with the
dashboard off, to run `UsageStatsHead`) asks cloud metadata servers (the
link-local metadata address, a DNS lookup of metadata.google.internal)
which cloud it runs on, whether usage stats are on or off. `init_local`
closes each of these, for the jobs'
local clusters (`rollout/elastic.py`) and the tests' alike:

  ray = ray_local.init_local(num_cpus=3, temp_dir=short_dir)

tests/test_loopback_only.py traces the syscalls of such a start and fails
on any address outside loopback.
"""

from __future__ import annotations

import contextlib
import os

LOOPBACK = "127.0.0.1"

# Read by Ray when it is imported, in this process and in every Ray process
# (they inherit it): with it 0, `services.get_node_ip_address` returns
# 127.0.0.1 without the UDP probe of a public resolver, and `ray.init` keeps
# `_node_ip_address="127.0.0.1"` instead of rewriting it to that probe's
# answer. It only refuses `ray start --address=...` (joining another node),
# which a local cluster never does.
NODE_IP_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               # `ray.init` turns it off for release wheels; said here too so
               # that a nightly wheel does not report.
               "RAY_USAGE_STATS_ENABLED": "0"}

# For the processes `ray.init` starts (the driver's values are restored
# after it; Ray's processes, its workers among them, keep these): the API
# server's cloud probe (`usage_lib.get_cloud_from_metadata_requests`, run by
# `UsageStatsHead` even with usage stats off) uses `requests`, which honours
# them, so it asks a closed loopback port instead of the metadata servers
# and never resolves their names. Loopback HTTP (Ray's agents) stays direct;
# Ray's gRPC ignores proxies (`grpc.enable_http_proxy` is 0). An actor that
# must reach the network would need its own proxy settings (runtime_env).
_DEAD_PROXY = f"http://{LOOPBACK}:9"
_NO_PROXY = f"{LOOPBACK},localhost,::1"
PROXY_ENV = {"http_proxy": _DEAD_PROXY, "https_proxy": _DEAD_PROXY,
             "HTTP_PROXY": _DEAD_PROXY, "HTTPS_PROXY": _DEAD_PROXY,
             "no_proxy": _NO_PROXY, "NO_PROXY": _NO_PROXY,
             "all_proxy": "", "ALL_PROXY": ""}


@contextlib.contextmanager
def _env(values: dict[str, str]):
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def init_kwargs(temp_dir: str | None = None, **kwargs) -> dict:
  """`ray.init` arguments of a new local cluster on loopback: never joins
  another (address="local", whatever RAY_ADDRESS says), no dashboard.
  `temp_dir`: Ray's session and socket directory (default /tmp/ray); keep it
  short, a unix socket path holds at most 107 bytes."""
  out = dict(address="local", _node_ip_address=LOOPBACK,
             include_dashboard=False, **kwargs)
  if temp_dir is not None:
    out["_temp_dir"] = temp_dir
  return out


def init_local(temp_dir: str | None = None, **kwargs):
  """Starts a local Ray cluster on loopback (see the module docstring);
  returns the `ray` module. `kwargs` go to `ray.init`."""
  os.environ.update(NODE_IP_ENV)
  import ray  # Optional extra: pip install .[ray]
  from ray._private import ray_constants

  # A Ray imported before the variable was set read it already; the value
  # is looked up at each call (`services.get_node_ip_address`).
  ray_constants.ENABLE_RAY_CLUSTER = False
  with _env(PROXY_ENV):
    ray.init(**init_kwargs(temp_dir, **kwargs))
  got = ray.util.get_node_ip_address()
  if got != LOOPBACK:  # A later Ray that finds its address another way.
    ray.shutdown()
    raise RuntimeError(
        f"Ray {ray.__version__} started its local node on {got}, not "
        f"{LOOPBACK}; rlhf_jax/workers/ray_local.py needs updating")
  return ray

