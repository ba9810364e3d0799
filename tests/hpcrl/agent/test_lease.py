"""One job per run directory: the head's lease on `RUN/lease.json`.

The one faked seam is `squeue`: a small script first on PATH printing real `squeue` output kept in
`tests/data/slurm/` (or Slurm's own "Invalid job id" for a job it no longer knows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.agent.lease import LeaseError, release_lease, take_lease
from hpcrl.rundir import read_lease
from hpcrl.slurm_env import job_context
from tests.conftest import DATA, write_exe

FAKE_SQUEUE = """#!{python}
import os, sys
open(os.environ["FAKE_SQUEUE_LOG"], "a").write(" ".join(sys.argv[1:]) + "\\n")
sys.stdout.write(open(os.environ["FAKE_SQUEUE"]).read())
sys.exit(int(os.environ.get("FAKE_SQUEUE_RC", "0")))
"""


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake `squeue` first on PATH; returns the file logging its arguments."""
    write_exe(tmp_path / "bin" / "squeue", FAKE_SQUEUE.format(python=sys.executable))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SQUEUE_LOG", str(tmp_path / "squeue.log"))
    monkeypatch.setenv("HPCRL_SLURM_PATIENCE_S", "0")
    return tmp_path / "squeue.log"


def says(monkeypatch: pytest.MonkeyPatch, fixture: str, rc: int = 0) -> None:
    monkeypatch.setenv("FAKE_SQUEUE", str(DATA / "slurm" / fixture))
    monkeypatch.setenv("FAKE_SQUEUE_RC", str(rc))


def ctx(job: str, run: int, restart: int = 0):  # type: ignore[no-untyped-def]
    return job_context({"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node1", "SLURM_NODEID": "0",
                        "SLURM_RESTART_COUNT": str(restart), "HPCRL_RESTART": str(run)})


def test_the_head_leases_the_run_directory_naming_its_job(tmp_path: Path, squeue: Path) -> None:
    assert take_lease(tmp_path, ctx("12", 0)) is None
    held = read_lease(tmp_path)
    assert held is not None and held["job_id"] == "12" and held["run"] == 0
    assert held["pid"] == os.getpid() and held["host"] == "node1"
    assert (tmp_path / "lease.json").stat().st_mode & 0o077 == 0
    release_lease(tmp_path, ctx("12", 0))
    assert read_lease(tmp_path) is None and not squeue.exists()


def test_a_requeued_run_of_the_same_job_takes_the_lease_over(tmp_path: Path,
                                                            squeue: Path) -> None:
    """Slurm keeps the job id across a requeue: the rerun takes over the lease its first run
    left (killed before giving it back) without asking Slurm; the first run's late teardown
    then leaves the rerun's lease alone."""
    take_lease(tmp_path, ctx("12", 0))
    assert take_lease(tmp_path, ctx("12", 1, restart=1)) is None
    release_lease(tmp_path, ctx("12", 0))  # the first run's teardown, late
    assert read_lease(tmp_path)["run"] == 1  # type: ignore[index]
    assert not squeue.exists()  # the same job: Slurm is not asked


def test_another_job_is_refused_while_slurm_lists_the_holder(
        tmp_path: Path, squeue: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    take_lease(tmp_path, ctx("2", 0))
    before = (tmp_path / "lease.json").read_text()
    for fixture, state in (("squeue_running.txt", "RUNNING"), ("squeue_pending.txt", "PENDING")):
        says(monkeypatch, fixture)
        with pytest.raises(LeaseError) as err:
            take_lease(tmp_path, ctx("13", 1))
        assert f"is held by job 2 (`{tmp_path / 'lease.json'}`: run 0 on `node1`)" in str(err.value)
        assert f"Slurm lists it as {state}" in str(err.value) and "hpcrl cancel 2" in str(err.value)
        assert (tmp_path / "lease.json").read_text() == before  # untouched
    assert squeue.read_text().splitlines()[0].startswith("-h -j 2 -o ")
    says(monkeypatch, "scontrol_controller_down.txt", rc=1)  # Slurm does not answer: refused
    with pytest.raises(LeaseError, match="Slurm could not say whether it still runs"):
        take_lease(tmp_path, ctx("13", 1))
    assert not list(tmp_path.glob(".lease.json.*"))  # no temporary left


def test_the_lease_of_a_job_slurm_no_longer_lists_is_taken_over(
        tmp_path: Path, squeue: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancelled job whose head was killed before giving its lease back: `--resume`'s new job
    takes it over and says so."""
    take_lease(tmp_path, ctx("2", 0))
    says(monkeypatch, "scontrol_unknown.txt", rc=1)  # Slurm forgot it
    note = take_lease(tmp_path, ctx("13", 1))
    assert note == "took over the run directory's lease from job 2, which no longer runs"
    assert read_lease(tmp_path)["job_id"] == "13"  # type: ignore[index]
    (tmp_path / "lease.json").write_text("{not json")  # damaged: nobody known holds it
    assert take_lease(tmp_path, ctx("14", 2)) is not None
    assert read_lease(tmp_path)["job_id"] == "14"  # type: ignore[index]


def test_a_local_runs_lease_is_held_while_its_agent_lives(tmp_path: Path) -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        local = {"job_id": "local-ab12", "run": 0, "host": "node1", "pid": alive.pid}
        (tmp_path / "lease.json").write_text(json.dumps(local))
        with pytest.raises(LeaseError, match=rf"its agent \(pid {alive.pid}\) still runs"):
            take_lease(tmp_path, ctx("13", 1))
        (tmp_path / "lease.json").write_text(json.dumps({**local, "host": "login1"}))
        with pytest.raises(LeaseError, match="ran on host `login1`, where this node cannot tell"):
            take_lease(tmp_path, ctx("13", 1))
    finally:
        alive.kill()
        alive.wait()
    (tmp_path / "lease.json").write_text(json.dumps(local))
    assert take_lease(tmp_path, ctx("13", 1)) is not None


def test_two_jobs_taking_over_a_stale_lease_at_once_one_wins(tmp_path: Path) -> None:
    """Job 14's head judges job 2's lease stale while job 13's head takes it over: 14 moves
    13's fresh lease aside, sees it is not the one it judged, puts it back, and stops."""
    (tmp_path / "lease.json").write_text(json.dumps({"job_id": "2", "run": 0, "host": "node1",
                                                     "pid": 1}))

    def over_meanwhile(holder, host):  # type: ignore[no-untyped-def]
        assert take_lease(tmp_path, ctx("13", 1), runs=lambda h, _: None) is not None
        return None  # job 2 is over

    with pytest.raises(LeaseError, match="is held by job 13 .*took the lease over a moment ago"):
        take_lease(tmp_path, ctx("14", 2), runs=over_meanwhile)
    assert read_lease(tmp_path)["job_id"] == "13"  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease.json"]
