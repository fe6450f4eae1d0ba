"""The Python tool: runs model-written code, isolated by the Linux kernel.

Python-level hooks are no security boundary, so each call runs a fresh
interpreter behind namespaces, mounts, rlimits and seccomp, in three processes:

  caller --Popen--> A `python -I -S sandbox.py` (the bootstrap, end of file)
    A  [as root: hide 0700 ancestors of the interpreter, become uid 65534]
       unshare(user, mount, net, pid, ipc, uts, cgroup), mounts, fork B; kills
       B at timeout_s and exits only once the whole namespace is gone
    B  PID 1 of the new PID namespace: mounts its /proc, forks C, reaps
    C  rlimits, no_new_privs, seccomp, then exec `python main.py` in the workdir

A bootstrap interpreter, not `preexec_fn` nor util-linux `unshare`: the caller
is multi-threaded (JAX), where preexec_fn may deadlock and unshare(CLONE_NEWUSER)
fails; the binary cannot order the mount, seccomp and rlimit steps. Python 3.11
has no os.unshare, hence ctypes.

- Network: a new network namespace (a down `lo` only). seccomp allows socket()
  for AF_INET, AF_INET6 and AF_NETLINK only: path AF_UNIX sockets (Ray, dbus)
  and AF_VSOCK reach past network namespaces. No io_uring (sockets past seccomp).
- Writes: mount_setattr(AT_RECURSIVE) makes every mount read-only; the workdir
  (an empty host temp dir) and /dev/shm get size-capped tmpfs that die with the
  namespace. No nested user namespaces (user.max_user_namespaces=0): the code
  cannot regain mount rights.
- Processes: since Linux 5.14 RLIMIT_NPROC counts per user namespace, so a fresh
  one gives the code its own count, however many threads the job runs. Root is
  exempt from RLIMIT_NPROC, hence uid 65534. check() verifies all this.
- Time, memory: RLIMIT_CPU, RLIMIT_AS (per process: max_procs x memory_mb in
  all), RLIMIT_FSIZE; once PID 1 dies the kernel kills its whole namespace.
- A minimal environment, stdin /dev/null, its own /proc: the caller is invisible.
Not covered: reads. The code reads what the job's user can (as root: only
world-readable files and the interpreter's directories).
"""

import ctypes
import dataclasses
import errno
import json
import os
import platform
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

# unshare(2): user, mount, cgroup, uts, ipc, pid and network namespaces.
_NAMESPACES = 0x10000000 | 0x20000 | 0x2000000 | 0x4000000 | 0x8000000 \
    | 0x20000000 | 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_ARCHS = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}  # socket()
_SETUP_FAILED, _TIMED_OUT = 125, 124   # A's exit codes, with a "sandbox:" line
_LATE = b"\nsandbox: timed out\n"     # (this one for the timeout).
_NOBODY, _INSIDE = 65534, 1000         # Root runs as nobody; the uid inside.


class SandboxUnavailable(Exception):
  """The kernel isolation cannot be set up here (one line says what)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  timeout_s: float = 5.0          # Wall clock; the whole process tree is killed.
  cpu_s: int = 5                  # RLIMIT_CPU
  memory_mb: int = 256            # RLIMIT_AS, per process
  max_procs: int = 16             # Processes + threads of the code at once.
  max_output_bytes: int = 4096    # stdout+stderr returned, truncated beyond.
  max_file_bytes: int = 1 << 20   # RLIMIT_FSIZE; the workdir holds 16 x this.


class PythonSandbox:
  """`sandbox(code)` -> the observation: the output (stdout and stderr as
  interleaved), or "error: ..." then the output. Never raises; call check()
  at job start to refuse to run unprotected."""
  name, arg = "python", "code"

  def __init__(self, limits=SandboxLimits(), python=sys.executable):
    self.limits, self.python = limits, python

  def check(self) -> None:
    if sys.platform != "linux" or platform.machine() not in _ARCHS:
      raise SandboxUnavailable(f"python sandbox: needs Linux on x86_64/aarch64,"
                               f" not {sys.platform} {platform.machine()}")
    if not os.access(self.python, os.X_OK):
      raise SandboxUnavailable(f"python sandbox: {self.python} is not executable")
    limits = dataclasses.replace(self.limits,
                                 timeout_s=max(self.limits.timeout_s, 10.0))
    lines = self._run(_PROBE, limits).strip().splitlines() or ["no output"]
    if lines != ["ok"]:
      raise SandboxUnavailable("python sandbox unavailable: " + (
          lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1]}"))

  def __call__(self, code: str) -> str:
    try:
      return self._run(code, self.limits)
    except Exception as e:   # A tool failure is an observation, never a raise.
      return f"error: sandbox failed: {type(e).__name__}: {e}"

  def _run(self, code, limits):
    work = tempfile.mkdtemp(prefix="sandbox-")   # A reads main.py, covers it.
    env = {"PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work,
           # Threads count as processes: one per numerical library.
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    try:
      with open(os.path.join(work, "main.py"), "w") as f:
        f.write(code)
      cfg = json.dumps({"workdir": work, **dataclasses.asdict(limits)})
      with subprocess.Popen(
          [self.python, "-I", "-S", os.path.abspath(__file__), cfg],
          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, env=env, cwd="/",
          start_new_session=True) as proc:
        # A enforces timeout_s; this deadline is a backstop should A hang.
        head, tail, total = _read(proc.stdout.fileno(), limits.max_output_bytes,
                                  time.monotonic() + limits.timeout_s + 2)
        try:
          rc = proc.wait(timeout=1.0)
          late = rc == _TIMED_OUT and tail.endswith(_LATE)
        except subprocess.TimeoutExpired:
          os.killpg(proc.pid, signal.SIGKILL)   # A is unreaped: pgid is ours.
          rc, late = proc.wait(), True
    finally:
      shutil.rmtree(work, ignore_errors=True)
    # "main.py", not "/tmp/sandbox-x1y2z3/main.py": no noise in observations.
    head, tail = (part.replace(work.encode() + b"/", b"") for part in (head, tail))
    return _observe(rc, late, head, tail, total, limits)


def _read(fd, cap, deadline):
  """The first and the last `cap` bytes of the output, and its length."""
  head, tail, total = b"", b"", 0
  while time.monotonic() < deadline:
    if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        break
      head, tail = head + chunk[:cap - len(head)], (tail + chunk)[-cap:]
      total += len(chunk)
  return head, tail, total


def _observe(rc, late, head, tail, total, limits):
  """An "error: ..." line if the run failed, then the (truncated) output."""
  if rc == _SETUP_FAILED and b"\nsandbox: " in tail:
    return "error: sandbox setup failed: " + tail.rsplit(
        b"\nsandbox: ", 1)[1].decode(errors="replace").strip()
  if late and tail.endswith(_LATE):   # A's line is no output of the code.
    total, tail = total - len(_LATE), tail[:-len(_LATE)]
  cap = limits.max_output_bytes
  text = (head[:total] if total <= cap else head[:cap // 2]
          + b"\n[...truncated...]\n" + tail[-(cap - cap // 2):])
  text = text.decode(errors="replace")
  if rc == 0 and not late:
    return text
  if late:
    first = f"error: timed out after {limits.timeout_s} s"
  elif b"MemoryError" in tail:
    first = f"error: memory limit ({limits.memory_mb} MB)"
  elif rc == 128 + signal.SIGXCPU:
    first = f"error: cpu time limit ({limits.cpu_s} s)"
  elif 128 < rc < 160:
    first = f"error: killed by {signal.Signals(rc - 128).name}"
  else:
    first = f"error: exit code {rc}"
  return first + ("\n" + text if text else "")


# check() runs this inside the sandbox: each protection must bite.
_PROBE = """import errno, os, resource, socket
bad = []
if [n for _, n in socket.if_nameindex()] != ["lo"]: bad.append("network namespace")
try: socket.socket(socket.AF_UNIX); bad.append("seccomp socket filter")
except PermissionError: pass
try: open("/.sandbox-probe", "w"); bad.append("read-only mounts")
except OSError as e: e.errno == errno.EROFS or bad.append("read-only mounts")
try:
  for limit in (None, 3):   # A fork must work whatever else the user runs, and
    if limit:               # fail once A, B and this process make 3.
      resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    if os.fork() == 0: os._exit(0)
    os.wait()
  bad.append("RLIMIT_NPROC")
except BlockingIOError:
  if limit is None: bad.append("RLIMIT_NPROC per user namespace (Linux < 5.14?)")
print("ok" if not bad else "not enforced here: " + ", ".join(bad))
"""


# ----------------------------------------------------------- the bootstrap, A
def _libc_call(libc, what, *args, fn=None):
  if (fn or getattr(libc, what))(*args) < 0:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


def _prctl(libc, *args):
  args = [ctypes.c_ulong(a) for a in args] + [ctypes.c_ulong(0)] * (5 - len(args))
  _libc_call(libc, "prctl", *args)


def _hide_ancestors(libc, paths):
  """As root: cover each ancestor that uid 65534 cannot enter (/root, 0700)
  with an empty tmpfs, then bind back only the interpreter's `paths`."""
  hidden, covered = {}, set()
  for path in sorted(set(paths)):   # Parents first.
    parts = path.split("/")
    for anc in ("/".join(parts[:i]) for i in range(2, len(parts) + 1)):
      if not os.stat(anc).st_mode & 0o001:
        hidden[path] = (anc, os.open(path, os.O_PATH))   # Before covering.
        break
  for path, (anc, fd) in hidden.items():
    if anc not in covered:
      covered.add(anc)
      _libc_call(libc, "mount", b"tmpfs", anc.encode(), b"tmpfs", 0, b"mode=755")
    os.makedirs(path, exist_ok=True)
    _libc_call(libc, "mount", f"/proc/self/fd/{fd}".encode(), path.encode(),
               None, _MS_BIND | _MS_REC, None)
    os.close(fd)


def _seccomp(libc):
  """socket() for AF_INET, AF_INET6, AF_NETLINK only; no io_uring, no x32."""
  arch, nr_socket = _ARCHS[platform.machine()]
  allow, deny = 0x7FFF0000, 0x50000 | errno.EPERM
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06   # BPF; jumps skip jt/jf lines.
  prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x80000000),  # Kill.
          (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, deny),  # x32
          (jeq, 0, 1, 425), (ret, 0, 0, deny),                        # io_uring
          (jeq, 1, 0, nr_socket), (ret, 0, 0, allow),
          (ld, 0, 0, 16), (jeq, 2, 0, 2), (jeq, 1, 0, 10), (jeq, 0, 1, 16),
          (ret, 0, 0, allow), (ret, 0, 0, deny)]

  class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
  code = b"".join(struct.pack("=HBBI", *op) for op in prog)
  _prctl(libc, 38, 1)   # PR_SET_NO_NEW_PRIVS
  _libc_call(libc, "prctl", ctypes.c_ulong(22), ctypes.c_ulong(2),  # SECCOMP
             ctypes.byref(Prog(len(prog), code)))


def _boot(cfg):
  libc = ctypes.CDLL(None, use_errno=True)
  work, pid = cfg["workdir"], 0
  try:
    with open(os.path.join(work, "main.py")) as f:
      code = f.read()
    os.umask(0o022)
    if os.geteuid() == 0:
      _libc_call(libc, "unshare", 0x20000)   # A private mount namespace first.
      _libc_call(libc, "mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)
      exe = os.path.abspath(sys.executable)   # The venv, its base, the binary.
      _hide_ancestors(libc, [os.path.dirname(os.path.dirname(exe)),
                             sys.base_prefix, os.path.dirname(os.path.realpath(exe))])
      os.setgroups([])
      os.setgid(_NOBODY)
      os.setuid(_NOBODY)
      _prctl(libc, 4, 1)   # PR_SET_DUMPABLE, reset by setuid: uid_map needs it.
    uid, gid = os.getuid(), os.getgid()
    _libc_call(libc, "unshare", _NAMESPACES)
    for path, text in (("/proc/self/setgroups", "deny"),
                       ("/proc/self/uid_map", f"{_INSIDE} {uid} 1"),
                       ("/proc/self/gid_map", f"{_INSIDE} {gid} 1"),
                       ("/proc/sys/user/max_user_namespaces", "0")):
      with open(path, "w") as f:
        f.write(text)
    _prctl(libc, 1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    # struct mount_attr {set, clr, propagation, userns_fd}: all mounts
    # read-only and nosuid, and private (nothing propagates to the host).
    attr = (ctypes.c_uint64 * 4)(1 | 2, 0, _MS_PRIVATE, 0)
    _libc_call(libc, "mount_setattr", ctypes.c_long(442), ctypes.c_int(-100),
               b"/", ctypes.c_uint(0x8000), attr, ctypes.c_size_t(32),
               fn=libc.syscall)
    size = f"size={16 * cfg['max_file_bytes']},nr_inodes=4096"
    for where, mode in ((work, "0700"), ("/dev/shm", "1777")):
      if os.path.isdir(where):
        _libc_call(libc, "mount", b"tmpfs", where.encode(), b"tmpfs",
                   _MS_NOSUID | _MS_NODEV, f"{size},mode={mode}".encode())
    os.chdir(work)   # Into the tmpfs.
    with open("main.py", "w") as f:
      f.write(code)
    pid = os.fork()
  except Exception as e:
    _fail(e)
  if pid:   # A: wait for B, kill it at the timeout, exit after the namespace.
    late = not select.select([os.pidfd_open(pid)], [], [], cfg["timeout_s"])[0]
    if late:
      os.kill(pid, signal.SIGKILL)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if late:
      os.write(2, _LATE)
    os._exit(_TIMED_OUT if late else status if status >= 0 else 128 - status)
  try:   # B, PID 1: a /proc of this PID namespace, then C.
    _prctl(libc, 1, signal.SIGKILL)
    _libc_call(libc, "mount", b"proc", b"/proc", b"proc",
               _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    child = os.fork()
    if child == 0:   # C: limits, seccomp, exec.
      for res, value in ((resource.RLIMIT_CPU, cfg["cpu_s"]),
                         (resource.RLIMIT_AS, cfg["memory_mb"] << 20),
                         (resource.RLIMIT_FSIZE, cfg["max_file_bytes"]),
                         (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, cfg["max_procs"] + 2)):  # A, B
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later.
        resource.setrlimit(res, (value, value + (res == resource.RLIMIT_CPU)))
      _seccomp(libc)
      for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
      os.closerange(3, 1 << 16)
      os.execve(sys.executable, [sys.executable, "-E", "-s", "-u", "-B",
                                 "main.py"], os.environ)
  except Exception as e:
    _fail(e)
  while True:   # B reaps orphans; C's exit ends the namespace.
    done, status = os.waitpid(-1, 0)
    if done == child:
      status = os.waitstatus_to_exitcode(status)
      os._exit(status if status >= 0 else 128 - status)


def _fail(e):
  os.write(2, f"\nsandbox: {e}\n".encode())
  os._exit(_SETUP_FAILED)


if __name__ == "__main__":
  _boot(json.loads(sys.argv[1]))
