"""`hpcrl.agent_entry`: what each submitit task calls, equivalent to `python -m hpcrl.agent`.
The success path runs under real Slurm in the lab tests; here the real agent's failure path."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

import hpcrl


def test_agent_entry_runs_the_real_agent_and_raises_on_failure(tmp_path: Path, capfd, monkeypatch) -> None:
    for key in [k for k in list(__import__("os").environ) if k.startswith(("SLURM_", "HPCRL_"))]:
        monkeypatch.delenv(key)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = list(sys.argv)
    with pytest.raises(SystemExit) as exc:
        hpcrl.agent_entry(str(run_dir))
    assert exc.value.code == 1
    assert sys.argv == before
    err = capfd.readouterr().err
    assert "job.json" in err and "hpcrl submit" in err, err


def test_agent_entry_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(hpcrl.agent_entry)) is hpcrl.agent_entry
