"""`hpcrl.agent_entry`: what each submitit task calls, equivalent to `python -m hpcrl.agent`."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import hpcrl

AGENT_MAIN = """
import json, sys
from pathlib import Path
run_dir = Path(sys.argv[1])
(run_dir / "agent-argv.json").write_text(json.dumps(sys.argv))
sys.exit(int((run_dir / "exit-code").read_text()))
"""


@pytest.fixture
def agent_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `hpcrl.agent` module (the real one is a separate part of hpcrl)."""
    pkg = tmp_path / "extra" / "agent"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(AGENT_MAIN)
    monkeypatch.setattr(hpcrl, "__path__", [*hpcrl.__path__, str(tmp_path / "extra")])
    for name in ("hpcrl.agent", "hpcrl.agent.__main__"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return tmp_path


def test_agent_entry_runs_module_main_with_run_dir(agent_package: Path) -> None:
    import json
    import sys

    run_dir = agent_package / "run"
    run_dir.mkdir()
    (run_dir / "exit-code").write_text("0")
    before = list(sys.argv)
    assert hpcrl.agent_entry(str(run_dir)) == 0
    assert json.loads((run_dir / "agent-argv.json").read_text())[1:] == [str(run_dir)]
    assert sys.argv == before
    (run_dir / "exit-code").write_text("3")
    with pytest.raises(SystemExit) as exc:
        hpcrl.agent_entry(str(run_dir))
    assert exc.value.code == 3


def test_agent_entry_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(hpcrl.agent_entry)) is hpcrl.agent_entry
