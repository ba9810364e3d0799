"""What the sandbox tests share: an interpreter the sandbox user can run, small limits, and the
two kinds of trainer the sandbox must hold under: root (the code's sandbox is built by `nobody`)
and an ordinary user (as nearly every Slurm job runs). The ordinary trainer is a process of an
unprivileged uid with no account (:data:`ORDINARY_UID`) started with `setpriv` when the tests
run as root, or this process when they already run as an ordinary user. It imports a copy of the
sandbox's two modules (standard library alone), since the tests' virtualenv may sit under a
home that user cannot read."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import CI, REPO
from trainer.agent.tools import sandbox
from trainer.agent.tools.sandbox import (
    Isolation,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    usable_python,
)

ROOT = os.geteuid() == 0
ORDINARY_UID = 61234
"""The ordinary trainer's uid and gid when the tests run as root: no account, no files, no
processes of its own on the node."""


def drop_user() -> tuple[int | None, int | None]:
    """Whom the code runs as: `nobody` when the tests run as root, else the tests' own user."""
    if not ROOT:
        return None, None
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def sandbox_python(uid: int | None = None, gid: int | None = None) -> str:
    """This interpreter when user `uid` (default: the sandbox user) can run it, else the system's
    Python 3 (as root, `nobody` cannot read an interpreter installed under root's home)."""
    if uid is None:
        uid, gid = drop_user()
    try:
        return usable_python(uid, gid)
    except SandboxError as e:
        pytest.skip(f"no Python the sandbox user can run on this node: {e}")


def small_limits(tmp_path: Path, **changes: object) -> SandboxLimits:
    """Limits small enough that every hostile case ends within a few seconds."""
    uid, gid = drop_user()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    base = SandboxLimits(timeout=20, cpu_time=10, memory_limit_mb=256, max_file_bytes=1 << 20,
                         max_output_bytes=10_000, max_processes=8, max_open_files=32,
                         uid=uid, gid=gid, python=sandbox_python(), tmp_dir=str(work))
    return replace(base, **changes)  # type: ignore[arg-type]


def needs(condition: bool, reason: str) -> None:
    """Skip where this machine cannot run the case, but fail under CI=true."""
    if not condition:
        if CI:
            pytest.fail(f"required under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


SESSION_KEY = """\
import ctypes, platform
_libc = ctypes.CDLL(None, use_errno=True)
_keyctl, _add_key = {"x86_64": (250, 248), "aarch64": (219, 217)}[platform.machine()]
_libc.syscall(_keyctl, 1, None)  # a session keyring of this process's own
assert _libc.syscall(_add_key, b"user", b"hpcrl-test-secret", b"s3cret", 6, ctypes.c_long(-3)) > 0
"""
"""Run by the trainer before the sandbox: a secret key in its session keyring (where Kerberos or
AFS tickets live on many clusters)."""

_DRIVER = """\
import asyncio, base64, dataclasses, json, os, sys
if os.environ.get("HPCRL_TEST_SESSION_KEY"):
    exec(os.environ["HPCRL_TEST_SESSION_KEY"])
sys.path.insert(0, sys.argv[1])
import sandbox
limits = sandbox.SandboxLimits(**json.loads(sys.argv[2]))
res = asyncio.run(sandbox.run_python(sys.argv[3], limits))
out = dataclasses.asdict(res)
out["stdout"], out["stderr"] = (base64.b64encode(res.stdout).decode(), base64.b64encode(res.stderr).decode())
print(json.dumps(out))
"""


class Trainer:
    """A trainer of one kind (`root` or `ordinary`) that runs code in the sandbox as that kind of
    trainer would, with its own directory (`home`, mode 0700) holding a private file."""

    def __init__(self, kind: str, base: Path, mode: str = "strict") -> None:
        self.kind, self.mode = kind, mode
        self.subprocess = kind == "ordinary" and ROOT
        if self.subprocess:
            self.uid = self.gid = ORDINARY_UID
        else:
            self.uid, self.gid = os.getuid(), os.getgid()
        self.base = base
        self.home = base / "home"
        self.work = base / "work"
        for d in (self.home, self.work):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, self.uid, self.gid) if ROOT else None
            d.chmod(0o700)
        self.secret = self.home / "secret.txt"
        self.secret.write_text("the trainer's own")
        self.secret.chmod(0o600)
        if ROOT:
            os.chown(self.secret, self.uid, self.gid)
        if self.subprocess:  # the sandbox's own modules, where that user can read them
            self.modules = base / "modules"
            self.modules.mkdir()
            for name in ("sandbox.py", "sandbox_launch.py"):
                shutil.copy(Path(sandbox.__file__).with_name(name), self.modules / name)
            self.modules.chmod(0o755)
            self.python = sandbox_python(self.uid, self.gid)
        else:
            self.python = sandbox_python()

    def limits(self, **changes: object) -> SandboxLimits:
        code_uid, code_gid = drop_user() if self.kind == "root" else (None, None)
        base = SandboxLimits(timeout=20, cpu_time=10, memory_limit_mb=256, max_file_bytes=1 << 20,
                             max_output_bytes=10_000, max_processes=8, max_open_files=32,
                             uid=code_uid, gid=code_gid, python=self.python, tmp_dir=str(self.work),
                             mode=self.mode)
        return replace(base, **changes)  # type: ignore[arg-type]

    def run(self, code: str, session_key: bool = False, **changes: object) -> SandboxResult:
        """`code` in the sandbox; with `session_key`, the trainer holds :data:`SESSION_KEY` first."""
        limits = self.limits(**changes)
        if session_key and not self.subprocess:
            exec(SESSION_KEY, {})
        if not self.subprocess:
            import asyncio
            return asyncio.run(sandbox.run_python(code, limits))
        proc = subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", self.python, "-I",
             "-c", _DRIVER, str(self.modules), json.dumps(dataclasses.asdict(limits)), code],
            env={"HOME": str(self.home), "PATH": "/usr/bin:/bin",
                 **({"HPCRL_TEST_SESSION_KEY": SESSION_KEY} if session_key else {})},
            cwd=self.home, capture_output=True,
            text=True, timeout=limits.timeout + 60)
        assert proc.returncode == 0, f"the ordinary trainer's process failed: {proc.stderr[-2000:]}"
        out = json.loads(proc.stdout)
        out["stdout"], out["stderr"] = base64.b64decode(out["stdout"]), base64.b64decode(out["stderr"])
        out["isolation"] = Isolation(**out["isolation"])
        return SandboxResult(**out)


@contextlib.contextmanager
def make_trainer(kind: str, tmp_path: Path, mode: str = "strict") -> Iterator[Trainer]:
    """A :class:`Trainer` (its directories removed afterwards); the root kind needs root (under
    CI=true it must run)."""
    if kind == "root":
        needs(ROOT, "the root trainer's cases need the tests to run as root")
        yield Trainer(kind, tmp_path / "trainer", mode)
    elif ROOT:  # a directory the unprivileged uid can reach (pytest's are root's alone)
        base = Path(tempfile.mkdtemp(prefix="hpcrl-sandbox-test-"))
        base.chmod(0o755)
        try:
            yield Trainer(kind, base, mode)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    else:
        yield Trainer(kind, tmp_path / "trainer", mode)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (every process of a run names its workdir)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


__all__ = ["ORDINARY_UID", "REPO", "ROOT", "Trainer", "drop_user", "make_trainer", "needs",
           "processes_mentioning", "sandbox_python", "small_limits", "wait_until"]
