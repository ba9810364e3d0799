"""Running untrusted Python code in a bounded child process, without blocking the event loop.

The child is `python -I` (the configured interpreter, by default the trainer's, in isolated
mode) started through a small launcher:

- **namespaces**: through `unshare --pid --fork --kill-child` and, unless the network is allowed,
  `--net` (a network namespace holds only a downed loopback: nothing is reachable). As root
  that is plain `unshare`; otherwise a user namespace (`--user --map-root-user`) is tried. Which
  of these worked is probed once per process and reported with every result: no isolation is
  claimed that was not obtained. In a pid namespace the launcher is pid 1: when it ends, the
  kernel kills everything the code started, daemons included;
- **a lower user**: when the trainer runs as root, the launcher drops to `uid` (the python
  tool's `user`, `nobody`) before the code runs, so that the code cannot touch the trainer's
  files or processes, and so that `RLIMIT_NPROC` (which root ignores) binds; that user must be
  able to read the interpreter (:func:`check_interpreter`);
- **rlimits**: CPU seconds (SIGXCPU, then SIGKILL a second later), address space, file size,
  open files, no core files, and tasks (`RLIMIT_NPROC` counts every task of the user on the
  node, so the limit is the user's tasks at start plus `max_processes`; in a user namespace,
  where Linux >= 5.14 counts that namespace's tasks alone, `max_processes` itself);
- **the launcher forks** and the code runs in the child, so the code's parent is the launcher,
  never the trainer; the environment is cleared before the code runs (`os.environ` is empty);
- **private temporary space**: with a mount namespace too (`--mount`), `/tmp`, `/var/tmp` and
  `/dev/shm` are fresh tmpfs of `max_tmp_bytes` each, and so is the working directory (its
  `main.py` copied in at the same path): whatever the code writes there is bounded, never
  reaches the node's disks or other jobs' files, and vanishes with the run. Without one, the
  code's user may write where the node lets it (the result's `isolation.note` says so);
- a private working directory (removed afterwards), stdin empty (`/dev/null`), stdout and
  stderr read as they come and capped: past `max_output_bytes` on either, the process is stopped;
- a wall-clock timeout kills the whole process group (the child is a session leader).

Without a pid namespace (no `unshare`), what escaped the process group is looked for by its
command line (the launcher's forks) and killed; a program the code started with `exec` in a new
session is not found, and outlives the run. The result's `isolation.note` says when this holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Isolation", "SandboxError", "SandboxLimits", "SandboxResult", "check_interpreter", "isolation",
           "run_python"]

LAUNCHER = r"""
import json, os, resource, sys, traceback
spec = json.loads(sys.argv[1])

def user_tasks(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == uid:
                    n += len(os.listdir("/proc/" + pid + "/task"))
            except OSError:
                pass
    return n

def limit(res, soft, hard):  # never above the hard limit the node already set
    now = resource.getrlimit(res)[1]
    if now != resource.RLIM_INFINITY:
        soft, hard = min(soft, now), min(hard, now)
    resource.setrlimit(res, (soft, hard))

uid = os.getuid() if spec["uid"] is None else spec["uid"]
if spec["private_tmp"]:  # in our own mount namespace, still root in it: fresh bounded tmpfs
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def tmpfs(target, mode, owner=None):
        opts = "size=%d,mode=%s" % (spec["tmp_bytes"], mode)
        if owner is not None:
            opts += ",uid=%d,gid=%d" % owner
        if libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4, opts.encode()):  # nosuid, nodev
            err = ctypes.get_errno()
            raise OSError(err, "mount a tmpfs on %s: %s" % (target, os.strerror(err)))

    with open("main.py", "rb") as f:
        main = f.read()
    here = os.getcwd()
    for shared in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(shared) and not os.path.islink(shared):
            tmpfs(shared, "1777")
    os.umask(0o022)  # the working directory's parents, recreated in the new /tmp, stay traversable
    os.makedirs(here, exist_ok=True)
    tmpfs(here, "0700", None if spec["uid"] is None else (spec["uid"], spec["gid"]))
    os.chdir(here)
    with open("main.py", "wb") as f:
        f.write(main)
    if spec["uid"] is not None:
        os.chown("main.py", spec["uid"], spec["gid"])
    del libc, tmpfs, main, here
for name, (soft, hard) in spec["rlimits"].items():
    limit(getattr(resource, "RLIMIT_" + name), soft, hard)
# RLIMIT_NPROC counts the user's tasks (the launcher's among them once it runs as that user);
# in a new user namespace (Linux >= 5.14) only those of that namespace, `unshare` and the
# launcher: try that bound first, and if even the launcher cannot fork (an older kernel counting
# every task of the user), count the user's tasks on the node
loose = user_tasks(uid) + (spec["uid"] is not None) + spec["max_processes"]
strict = 2 + spec["max_processes"] if spec["userns"] else loose
limit(resource.RLIMIT_NPROC, strict, max(strict, loose))
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
os.umask(0o077)
try:
    pid = os.fork()
except BlockingIOError:
    limit(resource.RLIMIT_NPROC, loose, loose)
    pid = os.fork()
else:
    if pid == 0:
        limit(resource.RLIMIT_NPROC, strict, strict)
if pid:
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)
os.environ.clear()
sys.argv = ["main.py"]
sys.stdout.reconfigure(line_buffering=True)
with open("main.py", encoding="utf-8") as f:
    source = f.read()
code_globals = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
del spec, f, pid, uid, loose, strict
try:
    exec(compile(source, "main.py", "exec"), code_globals)
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""
"""Run as `python -I -c LAUNCHER SPEC` in the working directory holding `main.py` (SPEC names
it too, so that every process of a run can be found by its command line)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds of one run (the python tool's config keys of the same names)."""

    timeout: float = 30.0
    """Wall-clock seconds before the process group is killed."""
    cpu_time: int = 30
    """RLIMIT_CPU seconds (SIGXCPU)."""
    memory_limit_mb: int = 1024
    """RLIMIT_AS, MiB of address space."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file the code may write."""
    max_output_bytes: int = 64 << 10
    """stdout and stderr are each kept up to this many bytes; past it the process is stopped."""
    max_processes: int = 16
    """Tasks (processes and threads) the code may run at once, itself included."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_tmp_bytes: int = 64 << 20
    """Size of each private tmpfs (the working directory, `/tmp`, `/var/tmp`, `/dev/shm`) where
    the node grants a mount namespace."""
    allow_network: bool = False
    """Run without a network namespace."""
    uid: int | None = None
    """The user the code runs as (when the trainer is root); None: the trainer's user."""
    gid: int | None = None
    python: str = sys.executable
    """The interpreter that runs the code (in isolated mode, `-I`)."""
    tmp_dir: str | None = None
    """Where the private working directories are made (None: the system's temporary directory)."""


@dataclass(frozen=True)
class Isolation:
    """The namespaces obtained for runs with or without network."""

    prefix: tuple[str, ...]
    """The `unshare ...` words put before the command (empty: none obtained)."""
    note: str = ""
    """Why isolation is missing, when it is."""

    @property
    def network(self) -> bool:
        return "--net" in self.prefix

    @property
    def pid_namespace(self) -> bool:
        return "--pid" in self.prefix

    @property
    def private_tmp(self) -> bool:
        """A mount namespace: the working directory and the temporary directories are tmpfs of
        the run's own."""
        return "--mount" in self.prefix


@dataclass
class SandboxResult:
    """What one run produced."""

    stdout: bytes
    stderr: bytes
    returncode: int | None
    """The launcher's status: the code's exit code, 128+N for a signal N, or negative when the
    launcher itself was killed; None when it could not be collected."""
    timed_out: bool
    output_truncated: bool
    wall_s: float
    isolation: Isolation
    workdir: str

    @property
    def signal(self) -> int | None:
        """The signal that ended the code, when one did."""
        rc = self.returncode
        if rc is None:
            return None
        if rc < 0:
            return -rc
        return rc - 128 if 128 < rc < 128 + 65 else None


_ISOLATION: dict[bool, Isolation] = {}
_USABLE: set[tuple[str, int | None]] = set()


class SandboxError(RuntimeError):
    """The sandbox cannot run code as configured on this node."""


def _unshare_words(allow_network: bool, mount: bool = True) -> tuple[str, ...]:
    words = ["unshare"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user"]
    words += ["--pid", "--fork", "--kill-child"] + (["--mount"] if mount else [])
    if not allow_network:
        words.append("--net")
    return tuple(words)


#: The probe of a mount namespace: a tmpfs mounted on /tmp inside it (util-linux's `unshare`
#: makes the namespace's mounts private: nothing reaches the node's).
_PROBE_MOUNT = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "if libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 6, b'size=1m'):\n"
                "    sys.exit('mount: errno %d' % ctypes.get_errno())")


def _probe(words: tuple[str, ...], code: str) -> tuple[bool, str]:
    try:
        res = subprocess.run([*words, sys.executable, "-I", "-S", "-c", code], env={},
                             stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        return res.returncode == 0, res.stderr.decode(errors="replace").strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)


def isolation(allow_network: bool) -> Isolation:
    """The namespaces this node grants (probed once per process for each `allow_network`): pid,
    network unless allowed, and mount (private temporary space) where a tmpfs can be mounted in
    it; without the last, the others alone, said in the note."""
    if allow_network in _ISOLATION:
        return _ISOLATION[allow_network]
    if shutil.which("unshare") is None:
        found = Isolation((), "`unshare` (util-linux) is not installed: no pid, network or mount isolation")
    else:
        words = _unshare_words(allow_network)
        ok, err = _probe(words, _PROBE_MOUNT)
        if ok:
            found = Isolation(words)
        else:
            plain = _unshare_words(allow_network, mount=False)
            ok, err2 = _probe(plain, "pass")
            found = Isolation(plain, (
                f"no mount namespace (`{' '.join(words)}` with a tmpfs: {err}): the code may write to "
                "the node's temporary directories")) if ok else Isolation((), (
                f"`{' '.join(plain)}` failed on this node ({err2}): no pid, network or mount isolation"))
    _ISOLATION[allow_network] = found
    return found


def check_interpreter(python: str, uid: int | None, gid: int | None) -> None:
    """Refuse an interpreter that cannot import its standard library as user `uid` (a Python
    under a home only its owner can read, say), naming the fix. Checked once per pair."""
    if (python, uid) in _USABLE:
        return
    as_user = {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}
    try:
        res = subprocess.run([python, "-I", "-c", "import json, socket, subprocess"], env={},
                             cwd="/", stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                             **as_user)
        ok, why = res.returncode == 0, res.stderr.decode(errors="replace").strip()[-300:]
    except (OSError, subprocess.SubprocessError) as e:
        ok, why = False, str(e)
    if not ok:
        who = "this user" if uid is None else f"uid {uid}"
        raise SandboxError(
            f"python tool: `{python}` cannot run as {who} ({why}); set the tool's `python:` to "
            f"an interpreter that user can read (e.g. `/usr/bin/python3`)"
            + ("" if uid is None else ", or `user: null` to run the code as root (weaker: root "
               "ignores RLIMIT_NPROC and may write wherever root may)"))
    _USABLE.add((python, uid))


def _make_workdir(code: str, limits: SandboxLimits) -> str:
    workdir = tempfile.mkdtemp(prefix="hpcrl-python-", dir=limits.tmp_dir)
    main = Path(workdir, "main.py")
    main.write_text(code, encoding="utf-8")
    if limits.uid is not None:  # the code's user owns both, whatever the trainer's umask
        for path in (workdir, main):
            os.chown(path, limits.uid, limits.gid if limits.gid is not None else -1)
    return workdir


def _remove(workdir: str) -> None:
    """Remove `workdir`, also where the code took away its own permissions (a user other than
    root cannot enter a directory it locked). Links are never followed."""
    try:
        shutil.rmtree(workdir)
        return
    except OSError:
        pass
    os.chmod(workdir, stat.S_IRWXU)
    for root, dirs, _ in os.walk(workdir):  # top-down: a directory is opened before walked into
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, stat.S_IRWXU)
                except OSError:
                    pass
    shutil.rmtree(workdir, ignore_errors=True)


def _spec(limits: SandboxLimits, workdir: str, iso: Isolation) -> str:
    rlimits = {"CPU": (limits.cpu_time, limits.cpu_time + 1),
               "AS": (limits.memory_limit_mb << 20,) * 2,
               "FSIZE": (limits.max_file_bytes,) * 2,
               "NOFILE": (limits.max_open_files,) * 2,
               "CORE": (0, 0)}
    return json.dumps({"rlimits": rlimits, "max_processes": limits.max_processes,
                       "uid": limits.uid, "gid": limits.gid, "workdir": workdir,
                       "userns": "--user" in iso.prefix, "private_tmp": iso.private_tmp,
                       "tmp_bytes": limits.max_tmp_bytes})


class _Collect(asyncio.SubprocessProtocol):
    """Keeps up to `cap` bytes of stdout (fd 1) and of stderr (fd 2), and tells when the process
    exited (`exited`, even while a process it left holds the pipes), when a stream passed `cap`
    (`full`) and when every pipe closed (`closed`)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = {1: bytearray(), 2: bytearray()}
        self.exited, self.full, self.closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        keep = self.kept[fd]
        room = max(0, self.cap - len(keep))
        keep += data[:room]
        if len(data) > room:
            self.full.set()

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


def _kill_leftovers(workdir: str) -> None:
    """Kill what a run left that escaped its process group (a new session), where no pid
    namespace ends it: the launcher's forks, which all carry `workdir` in their command line."""
    mark = workdir.encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if mark in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does (the caller checks
    :func:`check_interpreter` once before)."""
    iso = isolation(limits.allow_network)
    workdir = await asyncio.to_thread(_make_workdir, code, limits)
    try:
        return await _run(iso, workdir, limits)
    finally:
        await asyncio.to_thread(_remove, workdir)


async def _run(iso: Isolation, workdir: str, limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    transport, proto = await asyncio.get_running_loop().subprocess_exec(
        lambda: _Collect(limits.max_output_bytes),
        *iso.prefix, limits.python, "-I", "-c", LAUNCHER, _spec(limits, workdir, iso), cwd=workdir,
        env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        waits = [asyncio.create_task(proto.exited.wait()), asyncio.create_task(proto.full.wait())]
        done, _ = await asyncio.wait(waits, timeout=limits.timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        _killpg(transport.get_pid())  # what the code left running, or all of it on timeout/overflow
        if not iso.pid_namespace:
            await asyncio.to_thread(_kill_leftovers, workdir)
        for event, bound in ((proto.exited, 10), (proto.closed, 2)):
            try:
                await asyncio.wait_for(event.wait(), bound)
            except TimeoutError:
                pass
        return SandboxResult(bytes(proto.kept[1]), bytes(proto.kept[2]), transport.get_returncode(),
                             timed_out=not done, output_truncated=proto.full.is_set(),
                             wall_s=time.monotonic() - start, isolation=iso, workdir=workdir)
    finally:
        transport.close()
