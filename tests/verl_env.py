"""Where verl 0.9.1 runs for the tests that check this trainer against verl's own code.

verl's interpreter: `HPCRL_VERL_PYTHON`, else this one when it imports verl 0.9.1, else the
repository's `.venv-verl` (`make verl-venv`). Without one a test skips, except under CI=true with
HPCRL_REQUIRE_VERL=1 (the Makefile's verl stage), where it fails."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CI, REPO, REQUIRE_VERL


def built(venv: Path, wait_s: float | None = None) -> bool:
    """Whether `make` finished building `venv` (its `.hpcrl-installed` stamp): `make test`
    builds `.venv-verl` beside the main stage, so a test may find it half-installed. Under CI it
    waits for the stamp (`HPCRL_VENV_WAIT_S`, 1200 s) rather than skip; elsewhere it does not wait."""
    stamp = venv / ".hpcrl-installed"
    if wait_s is None:
        wait_s = float(os.environ.get("HPCRL_VENV_WAIT_S", "1200")) if CI else 0.0
    deadline = time.monotonic() + wait_s
    while not stamp.exists() and time.monotonic() < deadline:
        time.sleep(5)
    return stamp.exists()


def verl_python() -> str:
    """The interpreter verl 0.9.1 is installed in, or a skip (a failure under CI with
    HPCRL_REQUIRE_VERL=1)."""
    given = os.environ.get("HPCRL_VERL_PYTHON")
    if given:
        return given
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin and "verl_standin" not in spec.origin:
        return sys.executable
    venv = REPO / ".venv-verl" / "bin" / "python"
    if venv.parent.parent.is_dir() and built(venv.parent.parent) and venv.exists():
        return str(venv)
    reason = (f"verl 0.9.1 is not importable here and {venv} is missing or still being built "
              "(`make verl-venv` builds it)")
    if REQUIRE_VERL:
        pytest.fail(f"{reason}, but CI=true and HPCRL_REQUIRE_VERL=1 require it", pytrace=False)
    pytest.skip(reason)
