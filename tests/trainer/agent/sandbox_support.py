"""What the sandbox tests share: an interpreter the sandbox user can run, and small limits."""

from __future__ import annotations

import os
import pwd
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.agent.tools.sandbox import SandboxError, SandboxLimits, check_interpreter

ROOT = os.geteuid() == 0


def drop_user() -> tuple[int | None, int | None]:
    """Whom the code runs as: `nobody` when the tests run as root, else the tests' own user."""
    if not ROOT:
        return None, None
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def sandbox_python() -> str:
    """This interpreter when the sandbox user can run it, else the system's Python 3 (as root,
    `nobody` cannot read an interpreter installed under root's home)."""
    uid, gid = drop_user()
    tried = []
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            check_interpreter(python, uid, gid)
            return python
        except SandboxError as e:
            tried.append(str(e))
    pytest.skip(f"no Python the sandbox user can run on this node: {tried}")


def small_limits(tmp_path: Path, **changes: object) -> SandboxLimits:
    """Limits small enough that every hostile case ends within a few seconds."""
    uid, gid = drop_user()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    base = SandboxLimits(timeout=20, cpu_time=10, memory_limit_mb=256, max_file_bytes=1 << 20,
                         max_output_bytes=10_000, max_processes=8, max_open_files=32,
                         uid=uid, gid=gid, python=sandbox_python(), tmp_dir=str(work))
    return replace(base, **changes)  # type: ignore[arg-type]


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
