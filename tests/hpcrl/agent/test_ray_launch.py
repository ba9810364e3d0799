"""`ray_launch.py`: a worker's Ray CLI runs only once the head node is alive."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the launcher runs Ray's CLI (`pip install hpcrl[train]`)")

LAUNCHER = Path(__file__).resolve().parents[3] / "hpcrl" / "agent" / "ray_launch.py"


def launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_usage() -> None:
    result = launch("go", "5")
    assert result.returncode == 2 and "usage: ray_launch.py" in result.stderr


def test_runs_ray_once_the_file_appears(tmp_path: Path) -> None:
    import ray

    go = tmp_path / "head-alive"
    threading.Timer(1.0, go.write_text, args=("1\n",)).start()
    started = time.monotonic()
    result = launch(str(go), "60", "--", "--version")
    assert result.returncode == 0, result.stderr
    assert ray.__version__ in result.stdout
    assert time.monotonic() - started >= 1.0  # it waited for the file


def test_gives_up_naming_the_file(tmp_path: Path) -> None:
    go = tmp_path / "head-alive"
    result = launch(str(go), "0.2", "--", "--version")
    assert result.returncode == 3
    assert str(go) in result.stderr and "did not come up" in result.stderr
    assert "ray, version" not in result.stdout
