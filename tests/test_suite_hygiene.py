"""The suite leaves the user's home alone: each test runs with a private HOME, and a run that
writes into the real one anyway (through a path not derived from HOME) fails, naming the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, home_changes, home_snapshot

WRITES_TO_HOME = """\
import os
from pathlib import Path

def test_writes_where_ray_and_caches_would():
    (Path.home() / ".ray").mkdir()
    (Path.home() / ".ray" / "auth_token").write_text("token")
    cache = Path(os.path.expanduser("~/.cache/somelib"))
    cache.mkdir(parents=True)
    assert os.environ["HOME"] != os.environ["OUTER_HOME"]

def test_sees_no_file_of_the_other_test():
    assert not (Path.home() / ".ray").exists()
"""

LEAKS = """\
import os
from pathlib import Path

def test_leaks_by_absolute_path():
    Path(os.environ["OUTER_HOME"], "leaked.txt").write_text("x")
"""


def run_inner(tmp_path: Path, name: str, text: str, home: Path) -> subprocess.CompletedProcess[str]:
    """A pytest run of one test file under this suite's conftest, as user `home`."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "conftest.py").write_text(
        f"import sys; sys.path.insert(0, {str(REPO)!r})\nfrom tests.conftest import *  # noqa\n")
    (folder / f"test_{name}.py").write_text(text)
    env = {**os.environ, "HOME": str(home), "OUTER_HOME": str(home)}
    env.pop("HPCRL_TEST_HOME_IGNORE", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--basetemp={tmp_path / (name + '-tmp')}", str(folder)],
        cwd=folder, env=env, text=True, capture_output=True, timeout=120)


def user_home(tmp_path: Path) -> Path:
    home = tmp_path / "user"
    (home / ".config" / "app").mkdir(parents=True)
    (home / ".config" / "app" / "settings").write_text("keep")
    (home / ".bashrc").write_text("# keep\n")
    return home


def test_tests_write_to_a_private_home_not_the_users(tmp_path: Path) -> None:
    home = user_home(tmp_path)
    before = home_snapshot(home)
    res = run_inner(tmp_path, "writer", WRITES_TO_HOME, home)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 passed" in res.stdout, res.stdout
    assert home_changes(before, home_snapshot(home)) == []


def test_a_write_into_the_users_home_fails_the_run(tmp_path: Path) -> None:
    home = user_home(tmp_path)
    res = run_inner(tmp_path, "leaker", LEAKS, home)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 passed" in res.stdout  # the test itself passed: the home check failed the run
    assert "changed the user's home" in res.stderr and "+ leaked.txt" in res.stderr, res.stderr


def test_home_changes_lists_added_removed_and_changed(tmp_path: Path) -> None:
    home = user_home(tmp_path)
    before = home_snapshot(home)
    (home / ".bashrc").write_text("# changed, and longer\n")
    (home / ".config" / "app" / "settings").unlink()
    (home / ".ray").mkdir()
    assert home_changes(before, home_snapshot(home)) == [
        "+ .ray", "- .config/app/settings", "~ .bashrc"]
