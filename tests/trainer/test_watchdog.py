"""The progress watchdog (`trainer.watchdog`): each call to the ranks is bounded by its own
earlier durations; past the bound every rank's stack is dumped and the ranks that did not answer
are named with their process state. Real Ray ranks; one is stopped with SIGSTOP mid-call, as a
wedged rank would sit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer.watchdog import Bounds, process_state


def test_the_bound_is_the_floor_until_warmup_then_a_multiple_of_the_median() -> None:
    b = Bounds(floor_s=600, multiple=5, min_s=60, warmup=3)
    assert b.bound("actor.generate") == 600
    for s in (30.0, 10.0):
        b.record("actor.generate", s)
    assert b.bound("actor.generate") == 600  # two of three
    b.record("actor.generate", 20.0)
    assert b.bound("actor.generate") == 100  # 5 x median(10, 20, 30)
    assert b.bound("actor.update_actor") == 600  # each call its own history
    for _ in range(3):
        b.record("actor.sync", 1.0)
    assert b.bound("actor.sync") == 60  # at least min_s
    assert "5 x the median of 3 earlier calls (20.0 s)" in b.describe("actor.generate")


def test_process_state_reads_a_stopped_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(os.getpid()) == "R"
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if process_state(child.pid) == "T":
                break
            time.sleep(0.05)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None  # reaped: not on this host any more


class Worker:
    """A rank whose `work` takes `seconds`; it answers its node as a trainer rank does."""

    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int) -> None:
        self.rank = rank

    def node_info(self) -> dict[str, Any]:
        import socket

        return {"rank": self.rank, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}

    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


@pytest.fixture
def ray_local() -> Iterator[Any]:
    import ray

    from trainer.workers.ray_group import private_token_auth

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        private_token_auth()
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_a_stopped_rank_is_named_with_its_state_and_the_others_stacks_are_dumped(ray_local: Any, tmp_path: Path) -> None:
    from trainer.workers.group import WorkerFailure
    from trainer.workers.ray_group import make_placement_group, start_colocated

    stacks = tmp_path / "stacks"
    group = start_colocated({"actor": Worker}, None, 1, slot=make_placement_group(1, 2), world_size=2,
                            stacks=stacks)["actor"]
    group.watchdog = Bounds(floor_s=30, multiple=5, min_s=2, warmup=2, poll_s=0.2)
    for _ in range(2):  # the call's usual time: about 0.1 s; bound then max(2, 5 x 0.1) = 2 s
        assert group.run("work", 0.1) == [0, 1]
    stopped = group.nodes[1]["pid"]
    refs_started = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)  # rank 1 stops, as a wedged rank sits; rank 0 answers
    with pytest.raises(WorkerFailure) as failed:
        group.run("work", 0.1)
    took = time.monotonic() - refs_started
    err = failed.value
    assert err.kind == "hang", err
    text = str(err)
    assert "worker group `actor`: `work` has run" in text and "past its bound (5 x the median of 2" in text, text
    assert "1 of 2 rank(s) have not answered: rank 1 on node" in text and f"pid {stopped}, stopped (T))" in text, text
    assert "A stopped or D-state process points at its node" in text, text
    ranks = {r["rank"]: r for r in err.details["ranks"]}
    assert ranks[1]["state"] == "T" and not ranks[1]["answered"] and ranks[0]["answered"]
    assert err.details["suspect_nodes"] == [group.nodes[1]["hostname"]]  # for the head's requeue without it
    assert 2 < took < 30, took  # fired at its learned bound, not at the floor
    for _ in range(100):  # the answering rank dumps its threads' stacks on the signal
        if "File" in (stacks / "rank_0.txt").read_text():
            break
        time.sleep(0.05)
    assert "Thread 0x" in (stacks / "rank_0.txt").read_text() or "Current thread 0x" in (stacks / "rank_0.txt").read_text()
    with pytest.raises(ray_local.exceptions.RayActorError):  # the group was ended, the stopped rank too
        ray_local.get(group.actors[1].call.remote("actor", "node_info"), timeout=30)
