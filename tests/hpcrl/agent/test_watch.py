"""The head's view of the joining cluster (`GcsWatch`), fed the GCS watcher's lines as they
come from `gcs_watch.py`; the node files are the agents' own (`rendezvous.write_node`)."""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.jobfile import JobFileError, parse_job
from hpcrl.agent.node import BEAT_S, AgentError, Heartbeat, Node
from hpcrl.agent.watch import GcsWatch, dead_nodes
from hpcrl.jobspec import JobSpec, JobSpecError
from hpcrl.rundir import RunPaths
from hpcrl.slurm_env import job_context

ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
       "SLURM_NODEID": "0"}


def head(tmp_path: Path, clock: Callable[[], float] | None = None, **agent: float
         ) -> tuple[GcsWatch, RunPaths]:
    ctx = job_context(ENV)
    paths = RunPaths(tmp_path, 0)
    paths.nodes.mkdir(parents=True)
    paths.logs.mkdir(parents=True, exist_ok=True)
    job = parse_job({"payload": ["x"], "nodes": 3, "payload_start": "head-alive",
                     "profile": {"agent": agent}})
    node = Node(tmp_path, ENV, ctx, paths, job, logging.getLogger("t"), lambda *a: ([], {}), {},
                tmp_path / "tmp")
    peers = rdv.Peers(paths, expected=3, clock=clock) if clock else None
    return GcsWatch(node, queue.Queue(), peers), paths


def arrive(paths: RunPaths, rank: int) -> None:
    rdv.write_node(paths, rank, {"host": f"n{rank + 1}", "address": "10.0.0.1",
                                 "node_manager_port": 7000 + rank, "state": "starting"})


def gcs(watch: GcsWatch, *ranks: int) -> None:
    watch.lines.put(json.dumps({"alive": [f"10.0.0.1:{7000 + r}" for r in ranks], "dead": []}))


def test_nodes_still_joining_are_not_lost_but_a_joined_node_that_leaves_is(tmp_path: Path) -> None:
    watch, paths = head(tmp_path)
    for rank in (0, 1):
        arrive(paths, rank)
    gcs(watch, 0)
    assert watch.progress() is False
    assert paths.head_alive.exists() and watch.seen == {0}
    assert watch.lost_nodes() is None  # rank 1 arrived and is still starting Ray; rank 2 absent
    assert watch.cut_off() == []
    assert watch.missing() == ["n2 (rank 1: agent is `starting`, not yet in the Ray cluster)",
                               "n3 (rank 2: its agent never wrote a node file)"]
    arrive(paths, 2)
    gcs(watch, 0, 1, 2)
    assert watch.progress() is True and watch.complete
    gcs(watch, 0, 2)
    watch.refresh()
    lost = watch.lost_nodes()
    assert lost is not None and lost.cause == "Ray on node `n2` (rank 1) is no longer alive in the GCS"
    arrive(paths, 1)  # its agent beats on (a network cut): still cut off from the cluster
    assert watch.cut_off() == [(1, "n2")]


def test_head_only_wait_returns_once_the_head_is_alive(tmp_path: Path) -> None:
    watch, paths = head(tmp_path)
    arrive(paths, 0)
    gcs(watch, 0)
    never = lambda: None  # noqa: E731
    assert watch.wait_for_cluster(Heartbeat(paths, job_context(ENV)), never, never, head_only=True) is None
    assert watch.seen == {0} and not watch.complete


def test_joining_that_outlives_the_timeout_names_the_missing_nodes(tmp_path: Path) -> None:
    watch, paths = head(tmp_path, join_timeout_s=0)
    arrive(paths, 0)
    gcs(watch, 0)
    with pytest.raises(AgentError, match=r"only 1/3 nodes joined the Ray cluster within 0 s; "
                       r"missing: n2 \(rank 1: its agent never wrote a node file\); n3"):
        watch.progress()


def test_payload_start_is_checked_in_the_job_file_and_the_spec() -> None:
    assert parse_job({"payload": ["x"]}).payload_start == "all-joined"  # older job.json files
    with pytest.raises(JobFileError, match="`payload_start` is 'soon'; expected one of "
                       "all-joined, head-alive"):
        parse_job({"payload": ["x"], "payload_start": "soon"})
    spec = JobSpec(site="s", profile={}, payload=("x",), nodes=2, max_requeues=0,
                   payload_start="head-alive")
    assert JobSpec.from_json(spec.to_json()) == spec
    old = json.loads(spec.to_json())
    del old["payload_start"]
    assert JobSpec.from_dict(old).payload_start == "all-joined"
    with pytest.raises(JobSpecError, match="`payload_start` is 'soon'"):
        JobSpec.from_dict({**old, "payload_start": "soon"})


def test_a_node_whose_clock_is_behind_lives_and_a_silent_one_is_dead_after_the_timeout(
        tmp_path: Path) -> None:
    """Liveness is the file's content changing, timed on the head's own clock: rank 1's clock is
    15 s behind the head's (its files say so), rank 2 stops beating; timeout 10 s."""
    now = [1000.0]
    watch, paths = head(tmp_path, clock=lambda: now[0], heartbeat_timeout_s=10)
    writers = {r: rdv.NodeFileWriter(paths.node_file(r)) for r in (0, 1, 2)}

    def beat(rank: int, count: int, skew_s: float = 0.0) -> None:
        record = rdv.node_record(rank, count, {"host": f"n{rank + 1}", "state": "running"})
        writers[rank].write({**record, "time": time.time() - skew_s})

    for count in range(1, 12):  # 22 s of the head's clock
        beat(0, count)
        beat(1, count, skew_s=15.0)
        if count == 1:
            beat(2, count)  # then silent
        lost = watch.lost_nodes()
        silent_for = now[0] - 1000.0
        if silent_for <= 10:
            assert lost is None, silent_for
        else:
            assert lost is not None and lost.cause == "agent on `n3` (rank 2) stopped its heartbeat"
        assert 1 not in watch.peers.stale(10)  # type: ignore[union-attr]
        now[0] += BEAT_S


def test_after_a_failure_a_node_that_beats_on_lives_and_a_silent_one_is_dead(
        tmp_path: Path) -> None:
    """`dead_nodes` waits until each other node's file changed after the failure (alive) or
    stayed the same for `heartbeat_timeout_s` of the head's clock (dead)."""
    now, count = [500.0], [1]
    watch, paths = head(tmp_path, heartbeat_timeout_s=10)
    writers = {r: rdv.NodeFileWriter(paths.node_file(r)) for r in (1, 2)}
    for r in (1, 2):
        writers[r].write(rdv.node_record(r, 1, {"host": f"n{r + 1}", "state": "running"}))

    def clock() -> float:  # each look of the head: half a second on, and rank 1 beat again
        now[0] += 0.5
        count[0] += 1
        writers[1].write(rdv.node_record(1, count[0], {"host": "n2", "state": "running"}))
        return now[0]

    heartbeat = Heartbeat(paths, job_context(ENV))
    heartbeat._peers = rdv.Peers(paths, expected=3, clock=clock)
    assert dead_nodes(watch.node, heartbeat) == [(2, "n3")]
    assert 10 < now[0] - 500.0 < 15  # dead once silent for the timeout, not before
