"""Shared helpers for the launcher tests."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
PYTHON = sys.executable


def write_exe(path: Path, text: str) -> Path:
    """Write an executable script."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def run_hpcrl(args: list[str], env: dict[str, str], cwd: Path = REPO
              ) -> subprocess.CompletedProcess[str]:
    """`python -m hpcrl ARGS` in a fresh process, with this checkout first on sys.path."""
    full = {**env, "PYTHONPATH": str(REPO)}
    return subprocess.run([PYTHON, "-m", "hpcrl", *args], env=full, cwd=cwd, text=True,
                          capture_output=True, timeout=60)


@pytest.fixture
def clean_env(tmp_path: Path) -> dict[str, str]:
    """A small, predictable environment (no user profile directories, no secrets)."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "HPCRL_RUN_ROOT": str(tmp_path / "runs"),
        "HPCRL_LAB_RUN_ROOT": str(tmp_path / "labruns"),
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "LANG": "C.UTF-8",
    }
