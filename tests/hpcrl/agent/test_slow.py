"""The head's answer to a node the trainer named slow (:mod:`hpcrl.agent.slow`): named and kept
without `--exclude-slow`; with it, a stop request and then the requeue of a node loss (the node in
`ExcNodeList`, the user's exclusions kept) when a spare node is idle or `slurm.min_nodes` allows
fewer, and kept when neither. Slurm's answers (`scontrol show job`, `sinfo`, the requeue and the
exclusion) are the faked seams, as in `test_requeue.py`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import pytest

import hpcrl.agent.requeuer as requeuer_mod
from hpcrl import runstate
from hpcrl.agent import requeue as rq
from hpcrl.agent.jobfile import load_job, parse_job
from hpcrl.agent.requeuer import Requeuer
from hpcrl.agent.slow import SLOW_NODES, SlowNodes
from hpcrl.agent.stop import Deadline, SignalInbox, StopControl
from hpcrl.diagnosis import DIAGNOSIS_FILE, slow_nodes, write_diagnosis
from hpcrl.rundir import RunPaths
from hpcrl.slurm_env import job_context
from tests.conftest import write_exe

NODES = ["node1", "node2", "node3"]


def test_a_working_node_is_left_out_only_when_the_job_can_go_on_without_it() -> None:
    assert rq.spared_without(2, leaving=1, spares=1, min_nodes=None) == "1 idle spare node(s) can take its place"
    assert rq.spared_without(2, leaving=1, spares=0, min_nodes=None) is None  # it would wait
    assert rq.spared_without(2, leaving=1, spares=0, min_nodes=2) is None
    assert "on 2 of its 3 nodes (`slurm.min_nodes` 2)" in str(rq.spared_without(3, 1, 0, 2))
    assert rq.spared_without(3, leaving=2, spares=0, min_nodes=2) is None  # 1 left, 2 needed
    assert "on 2 of its 3 nodes" in str(rq.spared_without(3, leaving=2, spares=1, min_nodes=2))


def test_only_this_run_s_slow_diagnoses_name_nodes(tmp_path: Path) -> None:
    with (tmp_path / DIAGNOSIS_FILE).open("w") as f:  # an earlier run's
        f.write(json.dumps({"time": time.time() - 3600, "kind": "slow", "summary": "s", "nodes": ["node1"]}) + "\n")
    since = time.time()
    write_diagnosis(tmp_path, "hang", "stuck", suspect_nodes=["node3"], nodes=["node3"])
    write_diagnosis(tmp_path, "slow", "node2 is slow", nodes=["node2"])
    assert slow_nodes(tmp_path, since) == ["node2"]


def _slow(tmp_path: Path, exclude_slow: bool, min_nodes: int | None = None) -> tuple[SlowNodes, StopControl]:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({
        "payload": ["x"], "nodes": 2, "max_requeues": 2,
        "profile": {"slurm": {"exclude_slow": exclude_slow, "min_nodes": min_nodes}}}))
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NODEID": "0",
           "SLURM_JOB_NUM_NODES": "2"}
    ctx = job_context(env, hostname=lambda: "node1")
    job, log = load_job(run), logging.getLogger("test-slow")
    inbox, deadline = SignalInbox(), Deadline(None)
    stop = StopControl(job, RunPaths(run, 0), inbox, deadline, log)
    started = time.time()
    write_diagnosis(run, "slow", "node `node2` is slow", nodes=["node2.cluster"], ranks=[1])
    write_diagnosis(run, "slow", "a container's name", nodes=["c0ffee"], ranks=[2])
    return SlowNodes(Requeuer(ctx, job, run, inbox, log, stop, deadline), started - 1), stop


def _slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle: list[str]) -> list[tuple]:
    """`scontrol show job` says the user excluded node5; `sinfo` lists `idle`; the requeue and
    the exclusion are recorded."""
    bin_dir = tmp_path / "bin"
    write_exe(bin_dir / "sinfo", "#!/bin/sh\nprintf '" + "".join(f"{n}\\n" for n in idle) + "'\n")
    write_exe(bin_dir / "scontrol", "#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'node5\\nnode2\\n'\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(requeuer_mod, "show_job", lambda job: {"ExcNodeList": "node5", "Partition": "debug",
                                                              "NumCPUs": "4"})
    calls: list[tuple] = []
    monkeypatch.setattr(rq, "scontrol_requeue", lambda t: calls.append(("requeue", t)))
    monkeypatch.setattr(rq, "scontrol_exclude", lambda *a: calls.append(("exclude", *a)))
    return calls


def _events(slow: SlowNodes) -> list[dict]:
    return [r for r in runstate.read_state(slow.requeuer.run_dir) if r["event"] == SLOW_NODES]


def test_without_the_flag_a_slow_node_is_named_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    slow, stop = _slow(tmp_path, exclude_slow=False)
    calls = _slurm(tmp_path, monkeypatch, idle=["node3"])
    with caplog.at_level(logging.WARNING, "test-slow"):
        slow.check(stop)
    assert stop.reason is None and calls == []
    (event,) = _events(slow)
    assert event["nodes"] == ["node2"] and event["action"] == "kept"
    assert "named node(s) `node2` slow" in caplog.text and "`hpcrl submit --exclude-slow`" in caplog.text
    assert "host(s) c0ffee slow, which are no node of this job" in caplog.text
    slow.check(stop)  # named once: the next look (after SLOW_LOOK_S) finds nothing new
    slow._looked = 0.0
    slow.check(stop)
    assert len(_events(slow)) == 1
    assert slow.requeue(stop, 3, "payload exited with status 3") is None


def test_with_the_flag_and_a_spare_the_run_checkpoints_and_is_requeued_without_the_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, stop = _slow(tmp_path, exclude_slow=True)
    calls = _slurm(tmp_path, monkeypatch, idle=["node3", "node5"])  # node5 is the user's exclusion
    slow.check(stop)
    assert stop.reason is not None and "1 idle spare node(s) can take its place" in stop.reason
    assert calls == []  # nothing before the checkpoint
    (event,) = _events(slow)
    assert event["action"] == "exclude" and "`ExcNodeList=node5,node2`" in event["message"]
    out = slow.requeue(stop, 3, "payload exited with status 3 after the stop request")
    assert out is not None and out.exit_code == 3
    assert "node `node2` is slow (the trainer named it; `--exclude-slow`); requeueing job 77" in out.cause
    assert calls == [("requeue", "77"), ("exclude", "77", "node5,node2", ())]
    decided = [r for r in runstate.read_state(slow.requeuer.run_dir) if r["event"] == runstate.REQUEUE_DECIDED]
    assert decided[-1]["lost_nodes"] == ["node2"] and decided[-1]["exclude"] == "node5,node2"


def test_with_the_flag_but_no_spare_the_node_stays_unless_the_run_may_shrink(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, stop = _slow(tmp_path / "a", exclude_slow=True)
    calls = _slurm(tmp_path, monkeypatch, idle=["node5"])  # idle, but excluded by the user
    slow.check(stop)
    assert stop.reason is None and calls == []
    (event,) = _events(slow)
    assert event["action"] == "kept" and "no spare node is idle" in event["message"]
    shrinks, stop = _slow(tmp_path / "b", exclude_slow=True, min_nodes=1)
    shrinks.check(stop)
    assert stop.reason is not None and "the run may go on on 1 of its 2 nodes" in stop.reason
    out = shrinks.requeue(stop, 3, "x")
    assert out is not None and "on 1 nodes instead of 2" in out.cause
    assert calls == [("requeue", "77"), ("exclude", "77", "node5,node2", ["NumNodes=1-1", "NumTasks=1", "NumCPUs=2"])]


def test_a_stop_asked_for_another_reason_is_not_a_slow_node_requeue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, stop = _slow(tmp_path, exclude_slow=True)
    calls = _slurm(tmp_path, monkeypatch, idle=["node3"])
    stop.ask("Slurm's time-limit warning reached the batch script")
    slow.check(stop)
    assert _events(slow)[0]["action"] == "kept" and "already stopping" in _events(slow)[0]["message"]
    assert slow.requeue(stop, 3, "x") is None and calls == []


def test_the_flag_and_the_profile_key_reach_the_job_file() -> None:
    from hpcrl.cli import build_parser
    from hpcrl.commands._common import prepare
    from hpcrl.profiles import profile_to_dict

    assert parse_job({"payload": ["x"]}).exclude_slow is False
    assert parse_job({"payload": ["x"], "profile": {"slurm": {"exclude_slow": True}}}).exclude_slow is True
    parser: argparse.ArgumentParser = build_parser()
    profile, _ = prepare(parser.parse_args(["render", "--site", "slurmlab", "--exclude-slow"]))
    assert profile.slurm.exclude_slow is True  # and so in `job.json`'s profile, for the head
    assert parse_job({"payload": ["x"], "profile": profile_to_dict(profile)}).exclude_slow is True
    profile, _ = prepare(parser.parse_args(["render", "--site", "slurmlab"]))
    assert profile.slurm.exclude_slow is False  # the profile's default
