"""Child processes of the agent: each in its own process group, none left behind.

Every child starts in a new session, and with the parent-death signal set, so that it gets
SIGTERM if the agent itself is killed. Its descendants stay in that session even when they make
process groups of their own (Ray's worker processes do), so the session is what gets swept.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Child:
    """A child process in its own session, with its output going to `log` (and `echo`)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        cwd: str | None = None,
        echo: IO[str] | None = None,
        on_line: Callable[[str], None] | None = None,
        death_signal: int = signal.SIGTERM,
    ) -> None:
        """`death_signal`: what the child gets when the agent dies (SIGKILL for a child that
        blocks SIGTERM)."""
        self.name = name
        self.log_path = log
        self._log = open(log, "a", buffering=1)  # noqa: SIM115 (closed in wait/stop)
        piped = echo is not None or on_line is not None
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(death_signal),
            text=True,
            errors="replace",
        )
        self.pid = self.proc.pid
        self._reader: threading.Thread | None = None
        if piped:
            self._reader = threading.Thread(
                target=self._pump, args=(echo, on_line), name=f"{name}-out", daemon=True
            )
            self._reader.start()

    def _pump(self, echo: IO[str] | None, on_line: Callable[[str], None] | None) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
            if on_line is not None:
                on_line(line)

    def poll(self) -> int | None:
        return self.proc.poll()

    def send(self, sig: int) -> None:
        """Send `sig` to the child itself (not its group): a forwarded signal."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tree_alive(self) -> bool:
        return bool(session_members(self.pid))

    def _kill_tree(self) -> None:
        self._killpg(signal.SIGKILL)
        kill_all(session_members(self.pid))

    def stop(self, grace_s: float, term_group: bool = True, sig: int = signal.SIGTERM
             ) -> int | None:
        """`sig` (the group, or the child alone), wait up to `grace_s`, then SIGKILL every
        process of its session; returns the child's exit code (None if it was not reaped)."""
        if self.proc.poll() is None:
            if term_group:
                self._killpg(sig)
            else:
                self.send(sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or self.tree_alive()):
            time.sleep(0.05)
        self._kill_tree()
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + 5
        while self.tree_alive() and time.monotonic() < deadline:
            self._kill_tree()
            time.sleep(0.05)
        self.close()
        return code

    def close(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._log.close()


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (e.g. a job's private temp dir)."""
    me = os.getpid()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            out.append(int(entry.name))
    return out


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _tcp_rows(port: int, proc: Path) -> list[list[str]]:
    """Rows of `/proc/net/tcp{,6}` whose local port is `port`."""
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                rows.append(fields)
    return rows


def port_holders(port: int, proc: Path = Path("/proc")) -> list[str]:
    """`pid N (command)` of each process holding a TCP socket on `port` in this network
    namespace (from `/proc/net/tcp{,6}` and the processes' socket descriptors); empty when the
    holder is not visible here (another user's process, another namespace)."""
    return _socket_holders({f"socket:[{f[9]}]" for f in _tcp_rows(port, proc) if f[9] != "0"}, proc)


def port_closing(port: int, proc: Path = Path("/proc")) -> bool:
    """True when `port` has connections in TIME_WAIT (owned by no process: a closed server's
    last connections, gone within a minute)."""
    return any(f[3] == "06" for f in _tcp_rows(port, proc))


def unix_name_holders(name: str, proc: Path = Path("/proc")) -> list[str]:
    """`pid N (command)` of each process bound to the abstract Unix socket `name`."""
    try:
        lines = (proc / "net" / "unix").read_text().splitlines()[1:]
    except OSError:
        return []
    inodes = {f"socket:[{f[6]}]" for f in map(str.split, lines) if len(f) > 7 and f[7] == f"@{name}"}
    return _socket_holders(inodes, proc)


def _socket_holders(inodes: set[str], proc: Path) -> list[str]:
    holders: list[str] = []
    if not inodes:
        return holders
    for pid_dir in sorted((p for p in proc.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        if _holds(pid_dir, inodes):
            try:
                command = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                command = "?"
            holders.append(f"pid {pid_dir.name} ({' '.join(command.split())[:120]})")
    return holders


def _holds(pid_dir: Path, sockets: set[str]) -> bool:
    try:
        fds = list((pid_dir / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:
            continue
    return False
