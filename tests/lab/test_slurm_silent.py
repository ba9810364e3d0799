"""Slurm's controller stops answering mid-run (hung, as on a busy cluster): the job goes on,
`hpcrl status` says that Slurm did not answer instead of calling the job finished, and once the
controller answers again the run ends complete with nothing lost."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_hpcrl
from tests.lab.test_agent import finished, run_logs, submit, write_site

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PAYLOAD = """\
import os, pathlib, sys, time
run = pathlib.Path(os.environ["HPCRL_RUN_DIR"])
(run / "payload-started").write_text("")
while not (run / "controller-back").exists():   # the test says when the controller answers again
    time.sleep(0.2)
time.sleep(2)
(run / "payload-done").write_text("")
"""


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {path}")
        time.sleep(0.2)


def test_a_hung_controller_is_not_a_finished_job(lab, tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    write_site(sites, "lab-bare", "slurmlab", tmp_path / "runs", "container:\n  runtime: none\n")
    script = tmp_path / "payload.py"
    script.write_text(PAYLOAD)
    run_dir = tmp_path / "runs" / "silent"
    job = submit(lab, sites, "lab-bare", run_dir, payload=[sys.executable, str(script)])
    wait_for(run_dir / "payload-started", timeout=120)
    controller = int((lab.paths.pids / "slurmctld.pid").read_text())
    env = {**lab.env, "HPCRL_SLURM_PATIENCE_S": "0"}
    os.kill(controller, signal.SIGSTOP)
    try:
        status = run_hpcrl(["status", str(run_dir)], env)
    finally:
        os.kill(controller, signal.SIGCONT)
    assert status.returncode == 0, status.stderr
    assert "Slurm did not answer" in status.stdout, status.stdout
    assert "no longer known" not in status.stdout and ": running" in status.stdout, status.stdout
    (run_dir / "controller-back").write_text("")
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
    assert (run_dir / "payload-done").exists()
    after = run_hpcrl(["status", str(run_dir)], lab.env)
    assert "Slurm did not answer" not in after.stdout and ": finished" in after.stdout, after.stdout
