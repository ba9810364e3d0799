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


def test_the_head_runs_ray_at_once() -> None:
    result = launch("-", "0", "--", "--version")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("version, refused", [
    ("2.45.0", True), ("2.51.9", True), ("1.13.0", True), ("2.52.0", False), ("2.60.0", False),
    ("3.0.0.dev0", False)])
def test_a_ray_without_token_auth_is_refused_naming_its_version(
        tmp_path: Path, version: str, refused: bool) -> None:
    # the one seam: a `ray` package of the given version ahead of the real one
    fake = tmp_path / "site" / "ray"
    (fake / "scripts").mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (fake / "scripts" / "__init__.py").write_text("")
    (fake / "scripts" / "scripts.py").write_text("def main():\n    print('ray ran')\n")
    result = subprocess.run([sys.executable, str(LAUNCHER), "-", "0", "--", "start"],
                            capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    if refused:
        assert result.returncode == 4 and "ray ran" not in result.stdout
        assert f"the container has Ray {version}; hpcrl needs Ray >= 2.52" in result.stderr
        assert "RAY_AUTH_MODE=token" in result.stderr and "ray[default]>=2.52" in result.stderr
    else:
        assert result.returncode == 0 and "ray ran" in result.stdout, result.stderr


def test_the_agent_reports_the_refusal(tmp_path: Path) -> None:
    from hpcrl.agent.watch import _launcher_refusal

    log = tmp_path / "ray-start.log"
    log.write_text("noise\nray_launch: the container has Ray 2.45.0; hpcrl needs Ray >= 2.52 ...\n")
    assert _launcher_refusal(log) == "ray_launch: the container has Ray 2.45.0; hpcrl needs Ray >= 2.52 ..."
    log.write_text("Traceback: something else\n")
    assert _launcher_refusal(log) is None and _launcher_refusal(tmp_path / "none") is None
