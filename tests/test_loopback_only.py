"""Traffic stays on loopback: a local Ray cluster, the sandbox test and an
offline W&B run.

Project rule: code, tests, CI and benchmarks send traffic only to loopback
(127.0.0.0/8, ::1) or into network namespaces a test made itself. Each test
here runs a subprocess under `strace -f` and fails on any address a
connect, bind, sendto, sendmsg or sendmmsg names outside loopback: DNS
queries to a resolver and cloud metadata probes (the link-local metadata address) included,
refused attempts too. A bind to the wildcard (0.0.0.0, ::) fails as well,
unless WILDCARD_BINDS names it. AF_UNIX and AF_NETLINK are fine.

Where strace is missing or may not trace (ptrace refused), the tests skip
in one line; under CI=true they fail instead.
"""

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSCALLS = "connect,bind,sendto,sendmsg,sendmmsg"
# Traced too, to name the program of each call.
PROCESSES = "execve,clone,clone3,fork,vfork"
# Binds to 0.0.0.0 or :: that no setting of the library avoids, as
# (program substring, call, port). None: Ray 2.60 binds its servers to the
# node address (127.0.0.1, `ray_local`) and the sandbox test to 127.0.0.1.
WILDCARD_BINDS: tuple[tuple[str, str, int], ...] = ()

# A sockaddr as strace 5-6 prints it (not one quoted inside a buffer, where
# strace escapes the quotes).
_V4 = re.compile(r'\{sa_family=AF_INET, sin_port=htons\((\d+)\), '
                 r'sin_addr=inet_addr\("([^"\\]*)"\)')
_V6 = re.compile(r'\{sa_family=AF_INET6, sin6_port=htons\((\d+)\), [^{}]*?'
                 r'inet_pton\(AF_INET6, "([^"\\]*)"')
_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. )?(\w+)[( ]")
_EXEC = re.compile(r'^(\d+)\s+execve\("[^"]*", \[(.*?)\]')
_CHILD = re.compile(r"^(\d+)\s+.*\b(?:clone3?|v?fork)\b.*= (\d+)$")


def _in_ci() -> bool:
  return os.environ.get("CI") == "true"


def _strace_or_skip() -> None:
  """Skips (fails under CI=true) where strace cannot trace here."""
  why = None
  if shutil.which("strace") is None:
    why = "strace is not installed"
  else:
    probe = subprocess.run(["strace", "-f", "-o", os.devnull, "true"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
      if "Operation not permitted" not in probe.stderr:
        pytest.fail(f"strace failed: {probe.stderr.strip()}")
      why = "strace may not trace here (ptrace: Operation not permitted)"
  if why:
    if _in_ci():
      pytest.fail(f"CI=true, and {why}")
    pytest.skip(why)


def addresses(trace: str):
  """(pid, program, call, address, port) of every inet sockaddr in an
  `strace -f -o` log, and the lines with one this parser did not read."""
  programs, found, unread = {}, [], []
  for line in trace.splitlines():
    if m := _EXEC.match(line):
      programs[m[1]] = " ".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m[2]))
    elif m := _CHILD.match(line):   # Forks and threads: the parent's program.
      programs.setdefault(m[2], programs.get(m[1], ""))
    if "{sa_family=AF_INET" not in line:
      continue
    head = _LINE.match(line)
    if not head:
      unread.append(line)
      continue
    pid, call = head[1], head[2]
    got = _V4.findall(line) + _V6.findall(line)
    if len(got) != line.count("{sa_family=AF_INET"):
      unread.append(line)
    for port, addr in got:
      found.append((pid, programs.get(pid, ""), call, addr, int(port)))
  return found, unread


def violations(trace: str) -> list[str]:
  """The calls of `trace` that break the rule, one line each."""
  found, unread = addresses(trace)
  bad = [f"unparsed: {line}" for line in unread]
  for pid, program, call, addr, port in found:
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped:   # ::ffff:127.0.0.1 is 127.0.0.1.
      ip = ip.ipv4_mapped
    who = f"{program[:120] or '?'} (pid {pid})"
    if call == "bind" and ip.is_unspecified:
      if not any(p in program and c == call and q == port
                 for p, c, q in WILDCARD_BINDS):
        bad.append(f"wildcard {call} {addr} port {port}: {who}")
    elif not ip.is_loopback:
      bad.append(f"{call} {addr} port {port}: {who}")
  return bad


def loopback_calls(trace: str) -> int:
  return sum(ipaddress.ip_address(a.removeprefix("::ffff:")).is_loopback
             for *_, a, _ in addresses(trace)[0])


def _traced(cmd, log, timeout_s, marker):
  """Runs `cmd` under strace; returns (returncode, output, trace). On a
  timeout, kills its session and any process whose command line has
  `marker` (Ray's daemons start sessions of their own)."""
  proc = subprocess.Popen(
      ["strace", "-f", "-qq", "-e", f"trace={SYSCALLS},{PROCESSES}", "-o", log,
       *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if marker.encode() in f.read():
            os.kill(int(pid), signal.SIGKILL)
      except OSError:
        pass
    out, _ = proc.communicate()
    pytest.fail(f"timed out after {timeout_s} s: {' '.join(cmd)}\n{out}")
  with open(log) as f:
    return proc.returncode, out, f.read()


# ------------------------------------------------------------- the rules
def test_the_parser_finds_every_kind_of_address():
  trace = textwrap.dedent("""\
      10  execve("/usr/bin/python3", ["python3", "-m", "job"], 0x1 /* 3 vars */) = 0
      10  clone3({flags=CLONE_VM, child_tid=0x1}, 88) = 11
      11  connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("8.8.8.8")}, 16) = 0
      11  connect(4, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")}, 16 <unfinished ...>
      10  sendto(5, "x", 1, 0, {sa_family=AF_INET6, sin6_port=htons(53), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "2001:4860::8888", &sin6_addr), sin6_scope_id=0}, 28) = 1
      10  sendmsg(6, {msg_name={sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, msg_namelen=16}, 0) = 29
      10  bind(7, {sa_family=AF_INET, sin_port=htons(6379), sin_addr=inet_addr("0.0.0.0")}, 16) = 0
      10  bind(8, {sa_family=AF_INET6, sin6_port=htons(0), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::", &sin6_addr), sin6_scope_id=0}, 28) = 0
      10  connect(9, {sa_family=AF_INET, sin_port=htons(4000), sin_addr=inet_addr("127.0.0.2")}, 16) = 0
      10  connect(9, {sa_family=AF_INET6, sin6_port=htons(4000), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 0
      10  bind(9, {sa_family=AF_INET6, sin6_port=htons(0), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0
      10  connect(9, {sa_family=AF_UNIX, sun_path="/tmp/ray/s"}, 110) = 0
      10  sendto(9, "sa_family=AF_INET", 17, 0, NULL, 0) = 17
      """)
  bad = violations(trace)
  want = ["connect 8.8.8.8 port 53: ", "connect 169.254.169.254 port 80: ",
          "sendto 2001:4860::8888 port 53: ", "sendmsg 10.255.255.53 port 53: ",
          "wildcard bind 0.0.0.0 port 6379: ", "wildcard bind :: port 0: "]
  assert len(bad) == len(want), bad
  assert all(b.startswith(w) for b, w in zip(bad, want)), bad
  assert "python3 -m job (pid 11)" in bad[0]
  assert loopback_calls(trace) == 3


# ----------------------------------------------------------- the programs
_RAY_ROUND_TRIP = """
import os, sys
from rlhf_jax.workers import ray_local

ray = ray_local.init_local(temp_dir=sys.argv[1], num_cpus=1,
                           log_to_driver=False, configure_logging=False)
try:
  @ray.remote(num_cpus=0)
  def plus_one(x):
    return x + 1

  @ray.remote(num_cpus=0)
  class Probe:
    def where(self):
      return (ray.util.get_node_ip_address(),
              os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"))

  print("task", ray.get(plus_one.remote(1), timeout=120))
  print("actor", *ray.get(Probe.remote().where.remote(), timeout=120))
finally:
  ray.shutdown()
"""


@pytest.mark.slow   # A Ray cluster: 23-26 s traced on 2 loaded cores.
def test_a_local_ray_cluster_talks_over_loopback_only(tmp_path):
  """`ray_local.init_local` (the jobs' and the Ray tests' local cluster):
  start, a task and an actor call (own worker processes), shutdown."""
  pytest.importorskip("ray")
  _strace_or_skip()
  # Short: Ray's unix sockets live under it (107 bytes at most).
  temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
  try:
    rc, out, trace = _traced([sys.executable, "-c", _RAY_ROUND_TRIP, temp],
                             str(tmp_path / "strace.txt"), 300, temp)
    assert rc == 0, out
    assert any(n.startswith("session_") for n in os.listdir(temp)), out
  finally:
    shutil.rmtree(temp, ignore_errors=True)
  lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
  assert lines.get("task") == "2", out
  # The worker's Ray found its node on loopback, by the inherited setting.
  assert lines.get("actor") == "127.0.0.1 0", out
  assert loopback_calls(trace) > 0, "no inet call traced: strace saw nothing"
  assert not violations(trace), "\n".join(violations(trace)[:20])


def test_the_sandbox_network_test_talks_over_loopback_only(tmp_path):
  """tests/envs/test_sandbox.py::test_no_network, traced: its probes from inside
  the sandbox's network namespace name loopback only."""
  _strace_or_skip()
  rc, out, trace = _traced(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
       "no:cacheprovider", "tests/envs/test_sandbox.py::test_no_network"],
      str(tmp_path / "strace.txt"), 300, str(tmp_path))
  if rc == 0 and "1 skipped" in out and not _in_ci():
    pytest.skip("the sandbox cannot be set up here: "
                + out.strip().splitlines()[-1])
  assert rc == 0 and "1 passed" in out, out
  # strace followed into the sandbox: its attempts found no route.
  assert "ENETUNREACH" in trace and loopback_calls(trace) > 0, trace[-2000:]
  assert not violations(trace), "\n".join(violations(trace)[:20])


_WANDB_OFFLINE = """
import sys
from rlhf_jax.metrics import MetricWriter

writer = MetricWriter(sys.argv[1], wandb=({"lr": 0.1}, "loopback", "probe"))
for step in range(3):
  writer.write("rl", step, {"train/loss": 1.0 / (step + 1)})
writer.close()
print("logged", writer.path)
"""


@pytest.mark.slow   # A service launch, traced: ~11 s.
def test_an_offline_wandb_run_talks_over_loopback_only(tmp_path):
  """`logging.wandb="offline"` (`metrics.WandbRun`): W&B's service
  (wandb-core, a unix socket) starts, three records are logged and the run
  finishes without a packet leaving loopback (no error reporting, no
  update check)."""
  pytest.importorskip("wandb")
  _strace_or_skip()
  rc, out, trace = _traced([sys.executable, "-c", _WANDB_OFFLINE,
                            str(tmp_path / "run")],
                           str(tmp_path / "strace.txt"), 300,
                           str(tmp_path / "run"))
  assert rc == 0 and "logged" in out, out
  assert os.listdir(tmp_path / "run" / "wandb" / "wandb"), out
  assert "wandb-core" in trace  # Its service ran, traced.
  assert not violations(trace), "\n".join(violations(trace)[:20])
