"""Running untrusted Python code in a sandbox of its own, without blocking the event loop.

The code runs in `python -I` (the configured interpreter, by default the trainer's) under the
launcher of :mod:`trainer.agent.tools.sandbox_launch`, whose docstring says step by step what
each mode builds. In short:

- **`strict`** (the default) is built with only what an ordinary user may do, so that it holds
  the same when the trainer is an ordinary user (as nearly every Slurm job runs) and when it is
  root (which first drops to the tool's `user`): new user, mount, pid, IPC, UTS, cgroup and
  network namespaces; a new read-only root holding the system directories, the interpreter's
  own paths (read-only) and one scratch tmpfs of `max_tmp_bytes` for `/tmp`, `/var/tmp`,
  `/dev/shm` and the working directory; its own `/proc`; no capabilities, `no_new_privs`, no
  nested user namespaces; the whole call's memory held under `memory_limit_mb` by its pid 1.
  The job's home, run directory, checkpoints, Unix sockets and other users' processes are not
  there to reach. Where the node cannot build it, the tool refuses to start and says why.
- **`rlimits`**, which a site names to accept less where the node grants no unprivileged user
  namespaces (`HPCRL_PYTHON_SANDBOX=rlimits`, in the site profile's `env:`): rlimits per
  process, a lower user when the trainer is root, and nothing else: the code reads and writes
  wherever its user may and reaches the network.

In both, a wall-clock timeout kills the whole process group, stdout and stderr are capped, the
environment is empty and stdin is `/dev/null`. Without a pid namespace (`rlimits`), what escaped
the process group is looked for by its command line (the launcher's forks) and killed.
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
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MODES", "MODE_ENV", "Isolation", "SandboxError", "SandboxLimits", "SandboxResult",
           "check_interpreter", "isolation", "probe", "run_python", "sandbox_mode", "usable_python"]

MODES = ("strict", "rlimits")
"""The sandbox's modes, strongest first."""
MODE_ENV = "HPCRL_PYTHON_SANDBOX"
"""The variable by which a site (its profile's `env:`) names a weaker mode than `strict`."""
LAUNCHER = Path(__file__).with_name("sandbox_launch.py").read_text(encoding="utf-8")
"""Run as `python -I -c LAUNCHER SPEC` in the working directory holding `main.py` (SPEC names
it too, so that every process of a run can be found by its command line)."""


def sandbox_mode() -> str:
    """The mode the site named in `HPCRL_PYTHON_SANDBOX`, else `strict`."""
    mode = os.environ.get(MODE_ENV, "").strip() or "strict"
    if mode not in MODES:
        raise SandboxError(f"`{MODE_ENV}={mode}` names no sandbox mode; use one of {', '.join(MODES)} "
                           "(docs/agent-loops.md, 'The python tool's sandbox')")
    return mode


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds of one run (the python tool's config keys of the same names)."""

    timeout: float = 30.0
    """Wall-clock seconds before the process group is killed."""
    cpu_time: int = 30
    """RLIMIT_CPU seconds of each process (SIGXCPU)."""
    memory_limit_mb: int = 1024
    """MiB the whole call may hold (`strict`: every process of it together, its memfd files and
    shared memory, summed by its pid 1 every 20 ms); also each process's RLIMIT_AS."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file the code may write."""
    max_output_bytes: int = 64 << 10
    """stdout and stderr are each kept up to this many bytes; past it the process is stopped."""
    max_processes: int = 16
    """Tasks (processes and threads) the code may run at once, itself included."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_tmp_bytes: int = 64 << 20
    """`strict`: the size of the one scratch tmpfs that holds the working directory, `/tmp`,
    `/var/tmp` and `/dev/shm` together."""
    allow_network: bool = False
    """Run without a network namespace (`strict` only: `rlimits` never isolates the network)."""
    uid: int | None = None
    """The user the code runs as when the trainer is root; None: the trainer's user."""
    gid: int | None = None
    python: str = sys.executable
    """The interpreter that runs the code (in isolated mode, `-I`)."""
    tmp_dir: str | None = None
    """Where the private working directories are made (None: the system's temporary directory)."""
    mode: str = "strict"
    """`strict` or `rlimits` (:data:`MODES`): see the module's docstring."""


@dataclass(frozen=True)
class Isolation:
    """What a run's sandbox held."""

    mode: str
    network: bool
    """The network was out of reach (a network namespace with only loopback in it)."""
    note: str = ""
    """What is missing, when something is."""

    @property
    def pid_namespace(self) -> bool:
        return self.mode == "strict"

    @property
    def private_tmp(self) -> bool:
        """The working directory and the temporary directories are the run's own tmpfs, and the
        node's files are out of sight but for the read-only system and interpreter paths."""
        return self.mode == "strict"


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
    report: dict[str, object] = field(default_factory=dict)
    """What the sandbox's pid 1 said: `peak_bytes`, or `killed: memory` with `held_bytes` and
    `limit_bytes`, or `setup_error`."""

    @property
    def signal(self) -> int | None:
        """The signal that ended the code, when one did."""
        rc = self.returncode
        if rc is None:
            return None
        if rc < 0:
            return -rc
        return rc - 128 if 128 < rc < 128 + 65 else None

    @property
    def memory_exceeded(self) -> bool:
        return self.report.get("killed") == "memory"

    @property
    def setup_error(self) -> str | None:
        error = self.report.get("setup_error")
        return None if error is None else str(error)


_INTERPRETERS: dict[tuple[str, int | None], tuple[str, ...]] = {}
_PROBED: dict[tuple[object, ...], str] = {}


class SandboxError(RuntimeError):
    """The sandbox cannot run code as configured on this node."""


def isolation(limits: SandboxLimits) -> Isolation:
    """What a run under `limits` holds (the mode's promise; :func:`probe` checks it on the node)."""
    if limits.mode == "strict":
        return Isolation("strict", network=not limits.allow_network,
                         note="" if not limits.allow_network else "the network is allowed")
    return Isolation("rlimits", network=False, note=(
        "mode `rlimits` (named by the site): no namespaces; the code reads and writes wherever "
        "its user may, sees the node's processes and sockets, and reaches the network"))


_PATHS = ("import json, os, sys\nprint(json.dumps([sys.prefix, sys.exec_prefix, sys.base_prefix, "
          "sys.base_exec_prefix, os.path.dirname(os.path.abspath(sys.executable))] + "
          "[p for p in sys.path if p]))")


def check_interpreter(python: str, uid: int | None, gid: int | None) -> tuple[str, ...]:
    """The paths `python` needs (prefixes and import path), checked by running it as user `uid`;
    refuse an interpreter that user cannot run (a Python under a home only its owner can read,
    say), naming the fix. Checked once per pair."""
    if (python, uid) in _INTERPRETERS:
        return _INTERPRETERS[(python, uid)]
    as_user = {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}
    try:
        res = subprocess.run([python, "-I", "-c", "import json, socket, subprocess\n" + _PATHS],
                             env={}, cwd="/", stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=60, **as_user)
        ok, why = res.returncode == 0, res.stderr.decode(errors="replace").strip()[-300:]
    except (OSError, subprocess.SubprocessError) as e:
        ok, why = False, str(e)
    if not ok:
        who = "this user" if uid is None else f"uid {uid}"
        raise SandboxError(
            f"python tool: `{python}` cannot run as {who} ({why}); set the tool's `python:` to "
            f"an interpreter that user can read (e.g. `/usr/bin/python3`)")
    paths = tuple(json.loads(res.stdout))
    _INTERPRETERS[(python, uid)] = paths
    return paths


def usable_python(uid: int | None, gid: int | None, candidates: tuple[str, ...] = ()) -> str:
    """The first of `candidates` (default: this interpreter, then the system's Python 3) that
    user `uid` can run (root's interpreter often sits under a home `nobody` cannot read);
    :class:`SandboxError` naming each refusal when none can."""
    tried = []
    for python in candidates or (sys.executable, "/usr/bin/python3"):
        try:
            check_interpreter(python, uid, gid)
            return python
        except SandboxError as e:
            tried.append(str(e))
    raise SandboxError("; ".join(tried))


#: What :func:`probe` runs in the sandbox: the claims of `strict`, checked from inside.
_PROBE_STRICT = r"""
import ctypes, os, socket
status = dict(line.split(':\t', 1) for line in open('/proc/self/status').read().splitlines() if ':\t' in line)
bad = [k for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapInh', 'CapAmb') if int(status[k], 16)]
bad += [] if status.get('NoNewPrivs', '0').strip() == '1' else ['NoNewPrivs']
libc = ctypes.CDLL(None, use_errno=True)
bad += [] if libc.unshare(0x10000000) else ['a nested user namespace could be created']
bad += [] if libc.umount2(b'/tmp', 2) else ['/tmp could be unmounted']
bad += [] if sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1', str(os.getpid())] else [
    'processes outside the sandbox are visible']
print('ok' if not bad else 'NOT HELD: ' + '; '.join(bad))
"""


def probe(limits: SandboxLimits) -> None:
    """Build the sandbox once and check from inside what its mode promises; raise
    :class:`SandboxError` naming what failed and the fix. Cached per interpreter, user, mode and
    network setting."""
    key = (limits.python, limits.uid, limits.mode, limits.allow_network, limits.tmp_dir)
    if key in _PROBED:
        return
    if limits.mode not in MODES:
        raise SandboxError(f"sandbox mode `{limits.mode}` is none of {', '.join(MODES)}")
    code = _PROBE_STRICT if limits.mode == "strict" else "print('ok')"
    probe_limits = SandboxLimits(**{**limits.__dict__, "timeout": 60, "memory_limit_mb": max(
        limits.memory_limit_mb, 256)})
    res = asyncio.run(run_python(code, probe_limits))
    said = (res.stdout + res.stderr).decode(errors="replace").strip()
    if said == "ok" and res.returncode == 0:
        _PROBED[key] = said
        return
    why = res.setup_error or said[-500:] or f"exit status {res.returncode}"
    raise SandboxError(
        f"python tool: the `{limits.mode}` sandbox cannot be built on this node: {why}. "
        + ("It needs unprivileged user namespaces (`sysctl user.max_user_namespaces` above 0; on "
           "Ubuntu also `kernel.apparmor_restrict_unprivileged_userns=0`) and a /proc that is not "
           "masked (a container runtime's masked /proc: podman `--security-opt unmask=/proc/*`). "
           f"Ask the site's admins for these, or accept weaker isolation by naming it: "
           f"`{MODE_ENV}: rlimits` in the site profile's `env:` (docs/agent-loops.md, 'The "
           "python tool's sandbox', says what each mode holds)" if limits.mode == "strict" else ""))


def _make_workdir(code: str, limits: SandboxLimits) -> str:
    workdir = tempfile.mkdtemp(prefix="hpcrl-python-", dir=limits.tmp_dir)
    main = Path(workdir, "main.py")
    main.write_text(code, encoding="utf-8")
    if limits.uid is not None and os.geteuid() == 0:  # the code's user owns both, whatever the umask
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


def _cap_last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


def _spec(limits: SandboxLimits, workdir: str, status_fd: int) -> str:
    rlimits = {"CPU": (limits.cpu_time, limits.cpu_time + 1),
               "AS": (limits.memory_limit_mb << 20,) * 2,
               "FSIZE": (limits.max_file_bytes,) * 2,
               "NOFILE": (limits.max_open_files,) * 2,
               "MSGQUEUE": (0, 0),
               "CORE": (0, 0)}
    uid = limits.uid if os.geteuid() == 0 else None
    paths = check_interpreter(limits.python, uid, limits.gid) if limits.mode == "strict" else ()
    return json.dumps({"mode": limits.mode, "rlimits": rlimits, "max_processes": limits.max_processes,
                       "uid": uid, "gid": limits.gid, "workdir": workdir,
                       "allow_network": limits.allow_network, "tmp_bytes": limits.max_tmp_bytes,
                       "memory_bytes": limits.memory_limit_mb << 20, "ro_paths": list(paths),
                       "status_fd": status_fd, "cap_last_cap": _cap_last_cap()})


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


def _read_report(fd: int) -> dict[str, object]:
    """The JSON lines pid 1 (or the launcher) wrote on the status pipe, merged."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    report: dict[str, object] = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except ValueError:
            pass
    return report


async def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does (the caller checks
    :func:`probe` once before)."""
    workdir = await asyncio.to_thread(_make_workdir, code, limits)
    try:
        return await _run(isolation(limits), workdir, limits)
    finally:
        await asyncio.to_thread(_remove, workdir)


async def _run(iso: Isolation, workdir: str, limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    read_end, write_end = os.pipe()
    try:
        spec = await asyncio.to_thread(_spec, limits, workdir, write_end)
        transport, proto = await asyncio.get_running_loop().subprocess_exec(
            lambda: _Collect(limits.max_output_bytes),
            limits.python, "-I", "-c", LAUNCHER, spec, cwd=workdir, env={},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=(write_end,))
    finally:
        os.close(write_end)
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
                             wall_s=time.monotonic() - start, isolation=iso, workdir=workdir,
                             report=_read_report(read_end))
    finally:
        transport.close()
        os.close(read_end)
