"""Pure parsers of Slurm's output, on outputs recorded from Slurm 22.05."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcrl.jobs import run_dir_from_stdout
from hpcrl.slurm import (
    QueueEntry,
    SlurmError,
    check_job_id,
    describe_job,
    parse_sbatch_output,
    parse_scontrol_show_job,
    parse_squeue,
    run_slurm,
)
from tests.conftest import DATA, write_exe

SLURM = DATA / "slurm"


def test_sbatch_output_plain_and_parsable() -> None:
    assert parse_sbatch_output((SLURM / "sbatch_output.txt").read_text()) == "4"
    assert parse_sbatch_output((SLURM / "sbatch_parsable.txt").read_text()) == "5"
    assert parse_sbatch_output("77;cluster2\n") == "77"
    with pytest.raises(SlurmError, match="could not find a job id"):
        parse_sbatch_output("sbatch: error: Batch job submission failed: Invalid partition\n")


def test_scontrol_running_job_with_odd_name() -> None:
    info = parse_scontrol_show_job((SLURM / "scontrol_show_job_running.txt").read_text())
    assert info["JobId"] == "2"
    assert info["JobName"] == "we'ird $(job) `n`-mini"
    assert info["JobState"] == "RUNNING" and info["Restarts"] == "0"
    assert info["NodeList"] == "vm" and info["NumNodes"] == "1"
    assert info["AllocNode:Sid"] == "localhost:4101" and info["CPUs/Task"] == "1"
    assert info["StdOut"] == "/tmp/hpcrl-minival/runs/sig/logs/slurm-2.out"
    assert info["TRES"] == "cpu=1,node=1,billing=1"
    assert run_dir_from_stdout(info["StdOut"]) == Path("/tmp/hpcrl-minival/runs/sig")


def test_scontrol_path_with_spaces_and_states() -> None:
    failed = parse_scontrol_show_job((SLURM / "scontrol_show_job_failed.txt").read_text())
    assert failed["JobState"] == "FAILED" and failed["ExitCode"] == "3:0"
    pending = parse_scontrol_show_job((SLURM / "scontrol_show_job_pending.txt").read_text())
    assert pending["JobState"] == "PENDING" and pending["Reason"] == "JobHeldUser"
    assert pending["NodeList"] == "" and pending["NumNodes"] == "1-1"
    sub = parse_scontrol_show_job((SLURM / "scontrol_show_job_submitit.txt").read_text())
    assert run_dir_from_stdout(sub["StdOut"]) == Path("/tmp/hpcrl-minival/runs/subm")
    text = (SLURM / "scontrol_show_job_failed.txt").read_text().replace(
        "/tmp/hpcrl-minival/runs/sig", "/tmp/run with spaces")
    spaced = parse_scontrol_show_job(text)
    assert spaced["StdOut"] == "/tmp/run with spaces/logs/slurm-2.out"
    assert spaced["Command"] == "/tmp/run with spaces/job.sbatch"
    assert parse_scontrol_show_job((SLURM / "scontrol_unknown.txt").read_text()) == {}
    assert parse_scontrol_show_job("") == {}
    assert describe_job(failed)[2] == "JobState: FAILED"


def test_squeue_lines() -> None:
    (running,) = parse_squeue((SLURM / "squeue_running.txt").read_text())
    assert running == QueueEntry("2", "RUNNING", "0:03", "2:00", 1, "vm",
                                 "we'ird $(job) `n`-mini")
    pending = parse_squeue((SLURM / "squeue_pending.txt").read_text())
    assert [e.job_id for e in pending] == ["5", "4"]
    assert pending[0].reason == "(JobHeldUser)" and pending[0].time_limit == "UNLIMITED"
    assert parse_squeue("\n") == []
    with pytest.raises(SlurmError, match="unexpected squeue line"):
        parse_squeue("2 RUNNING\n")


def test_job_ids() -> None:
    assert check_job_id("42") == "42" and check_job_id("42_3") == "42_3"
    for bad in ["", "abc", "4;rm -rf /", "-1", "42 43"]:
        with pytest.raises(SlurmError):
            check_job_id(bad)


def test_a_shielded_command_outlives_the_sigterm_of_its_own_job(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """After `scontrol requeue` Slurm sends SIGTERM to every process of the job: the command
    that follows (setting `ExcNodeList`) must not die of it; an unshielded one does."""
    write_exe(tmp_path / "scontrol", "#!/bin/sh\nkill -TERM $$\necho updated\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert run_slurm(["scontrol", "update"], shielded=True) == "updated\n"
    with pytest.raises(SlurmError, match="status -15"):
        run_slurm(["scontrol", "update"])


def test_kill_wait_is_read_from_scontrol_show_config() -> None:
    from hpcrl.slurm import parse_kill_wait

    text = "JobRequeue              = 1\nKillOnBadExit           = 0\nKillWait                = 30 sec\n"
    assert parse_kill_wait(text) == 30
    assert parse_kill_wait("KillOnBadExit = 0\n") is None
