"""Child processes: whole session swept on stop, parent-death signal, output to the log."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.agent.procs import Child, port_holders, processes_mentioning, session_members

# A child that starts a grandchild in a process group of its own (as Ray's workers do); both
# ignore SIGTERM, so only the session sweep with SIGKILL ends them.
STUBBORN = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c",
    "import os,signal,time; os.setpgid(0,0); signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('grandchild', os.getpid(), flush=True); time.sleep(300)"])
print("child", os.getpid(), flush=True)
time.sleep(300)
"""


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_stop_sweeps_the_whole_session(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    child = Child("stubborn", [sys.executable, "-c", STUBBORN], dict(os.environ), log)
    wait_until(lambda: "grandchild" in log.read_text())
    members = session_members(child.pid)
    assert len(members) == 2 and child.pid in members
    start = time.monotonic()
    child.stop(grace_s=0.5)
    assert time.monotonic() - start < 8
    assert session_members(child.pid) == []


def test_output_is_logged_and_echoed(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    lines: list[str] = []
    child = Child(
        "echo",
        [sys.executable, "-c", "print('hello'); raise SystemExit(4)"],
        dict(os.environ),
        log,
        on_line=lines.append,
    )
    wait_until(lambda: child.poll() is not None)
    child.close()
    assert child.poll() == 4 and log.read_text() == "hello\n" and lines == ["hello\n"]


def test_child_gets_sigterm_when_the_agent_dies(tmp_path: Path) -> None:
    marker = f"hr-pdeath-{os.getpid()}"
    parent_code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from hpcrl.agent.procs import Child\n"
        f"Child('sleeper', [sys.executable, '-c', 'import time; time.sleep(300)', {marker!r}],"
        f" dict(os.environ), Path({str(tmp_path / 's.log')!r}))\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
    assert processes_mentioning(marker)
    parent.kill()
    parent.wait()
    wait_until(lambda: not processes_mentioning(marker))


def test_port_holders_names_the_process_holding_a_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        holders = port_holders(port)
        assert len(holders) == 1 and holders[0].startswith(f"pid {os.getpid()} ("), holders
    assert port_holders(port) == []
