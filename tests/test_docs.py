"""The documentation site builds, strictly, from docs/ and the code.

`mkdocs build --strict` (what `make docs` runs) fails on any warning: a link to a page or anchor
that does not exist, a page left out of the navigation, a reference generator
(`docs/gen/reference.py`) that raises because the code it reads changed. The build runs here so
that every CI run builds the site; it needs the `docs` extra (the Makefile's venv installs it)
and skips without it, except under CI=true, where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CI, REPO


def _need_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocs_gen_files")
               if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"the docs extra is not installed (missing {', '.join(missing)}): pip install -e '.[docs]'"
        if CI:
            pytest.fail(f"required under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


def test_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    _need_mkdocs()
    # the theme's and mkdocs' banners about mkdocs 2 are no warning of this site's
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\s+-", line)]
    assert proc.returncode == 0 and not warnings, log
    for page in ("reference/site-profile-keys", "reference/trainer-keys",
                 "reference/verl-examples", "reference/cli"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
