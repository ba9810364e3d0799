"""The heartbeat and the state file under a faulty file system: a write refused for a while
with a transient error (`ENOSPC`, `EDQUOT`, `ESTALE`, `EIO`) is tried again for up to the
heartbeat timeout instead of ending the job. Faults are injected at the one place the run
directory's writers hand bytes to the file system (`runstate.fs_write`)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcrl import runstate
from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.node import BEAT_S, Heartbeat
from hpcrl.rundir import RunPaths
from hpcrl.runstate import Retrying, StateWriter, read_state
from hpcrl.slurm_env import job_context

ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
       "SLURM_NODEID": "1"}


def faulty_seam(monkeypatch: pytest.MonkeyPatch, code: int, failures: int) -> list[int]:
    """`runstate.fs_write` raising OSError(`code`) for its next `failures` calls; returns the
    list of every call's outcome (the errno, or 0 when the write went through)."""
    real: Callable[..., None] = runstate.fs_write
    calls: list[int] = []

    def write(fd: int, data: bytes, offset: int | None = None) -> None:
        if sum(1 for c in calls if c) < failures:
            calls.append(code)
            raise OSError(code, os.strerror(code))
        calls.append(0)
        real(fd, data, offset)

    monkeypatch.setattr(runstate, "fs_write", write)
    return calls


def node(tmp_path: Path, said: list[str], patience_s: float = 15.0) -> Heartbeat:
    paths = RunPaths(tmp_path, 0)
    paths.nodes.mkdir(parents=True)
    return Heartbeat(paths, job_context(ENV), retry=Retrying(patience_s, said.append))


def test_heartbeats_refused_with_enospc_are_tried_again_and_the_node_lives_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    hb = node(tmp_path, said)
    calls = faulty_seam(monkeypatch, errno.ENOSPC, failures=3)
    hb.write("starting")  # a state change: retried until written
    assert calls == [errno.ENOSPC] * 3 + [0]
    assert rdv.read_nodes(hb.paths)[1]["state"] == "starting" and hb.count == 1
    assert len(said) == 2 and "failed (ENOSPC: No space left on device); trying again for up " \
        "to 15 s" in said[0] and "works again after" in said[1]  # said once, not per try
    reader = rdv.Peers(hb.paths)
    before = reader.read()[1]["beat"]
    calls = faulty_seam(monkeypatch, errno.EDQUOT, failures=4)
    hb.last -= BEAT_S  # the next beat is due
    for _ in range(200):  # the agent's loop: a refused beat never raises within the patience
        hb.beat("running")
        if hb.count == 2:
            break
        hb.retry.next_try = 0.0  # (skip the backoff's wait)
    assert calls == [errno.EDQUOT] * 4 + [0]
    assert reader.read()[1]["beat"] == before + 1
    assert len(said) == 4 and "EDQUOT" in said[2]


def test_a_state_line_refused_with_estale_lands_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    calls = faulty_seam(monkeypatch, errno.ESTALE, failures=2)
    StateWriter(tmp_path, 0, 0, "n1", Retrying(15.0, said.append)).append(
        runstate.AGENT_STARTED, pid=1, nodes=1)
    assert calls == [errno.ESTALE, errno.ESTALE, 0]
    assert [r["event"] for r in read_state(tmp_path)] == [runstate.AGENT_STARTED]
    assert len(said) == 2


def test_a_fault_that_outlasts_the_heartbeat_timeout_ends_it_and_others_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    hb = node(tmp_path, said, patience_s=0.3)
    faulty_seam(monkeypatch, errno.EIO, failures=10**6)
    with pytest.raises(OSError, match=r"writing the heartbeat .* failed for 0\.\d s, longer "
                       r"than the 0.3 s the file system is given: `heartbeat_timeout_s`") as err:
        hb.write("starting")
    assert err.value.errno == errno.EIO and len(said) == 1
    calls = faulty_seam(monkeypatch, errno.EACCES, failures=1)
    with pytest.raises(PermissionError):  # not transient: no retry
        StateWriter(tmp_path, 0, 0, "n1", Retrying(15.0, said.append)).append("x")
    assert calls == [errno.EACCES] and len(said) == 1
