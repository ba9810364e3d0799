"""The progress watchdog (`trainer.watchdog`): each call to the ranks is bounded by its own
earlier durations; past the bound every rank's stack is dumped and the ranks that did not answer
are named with their process state. Real Ray ranks; one is stopped with SIGSTOP mid-call, as a
wedged rank would sit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcrl import gpu_evidence
from hpcrl.diagnosis import read_diagnoses
from tests.conftest import REPO, shows_stack, wait_until
from trainer import watchdog
from trainer.watchdog import (
    Bounds,
    at,
    behind_in_collectives,
    call_key,
    diagnose,
    process_state,
    suspect_nodes,
    where,
)


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


def test_a_requeued_run_starts_from_the_durations_its_earlier_run_kept(tmp_path: Path) -> None:
    """The run directory keeps each call's latest durations; a requeued run's first call of a kind
    still gets the floor (its start-up), the next ones the bound learned before the requeue."""
    kept = tmp_path / "watchdog" / "actor_rollout_ref.json"
    first = Bounds.load(kept, floor_s=600, multiple=5, min_s=2, warmup=3)
    assert first.bound("gen/actor.generate") == 600 and not kept.exists()  # nothing kept yet: the floor
    for s in (10.0, 20.0, 30.0):
        first.record("gen/actor.generate", s)
    first.record("update_actor/actor.update_actor", 4.0)  # one only: fewer than `warmup`
    assert first.bound("gen/actor.generate") == 100
    rerun = Bounds.load(kept, floor_s=600, multiple=5, min_s=2, warmup=3)
    assert rerun.bound("gen/actor.generate") == 600  # its first call: compile, cold caches
    rerun.record("gen/actor.generate", 50.0)
    assert rerun.bound("gen/actor.generate") == 5 * 25.0  # median(10, 20, 30, 50), not the floor
    assert "4 earlier calls (3 of the runs before the requeue) (25.0 s)" in rerun.describe("gen/actor.generate")
    rerun.record("update_actor/actor.update_actor", 5.0)
    assert rerun.bound("update_actor/actor.update_actor") == 600  # too few before the requeue to learn from
    # what the rerun keeps for the next one: the earlier runs' durations, then its own, the latest `KEPT`
    assert json.loads(kept.read_text())["gen/actor.generate"] == [10.0, 20.0, 30.0, 50.0]
    for _ in range(Bounds.KEPT):
        rerun.record("gen/actor.generate", 1.0)
    assert json.loads(kept.read_text())["gen/actor.generate"] == [1.0] * Bounds.KEPT
    kept.write_text("{not json")  # a damaged file: a first run's floor, and it is written anew
    damaged = Bounds.load(kept, floor_s=600, multiple=5, min_s=2, warmup=3)
    damaged.record("gen/actor.generate", 3.0)
    assert damaged.bound("gen/actor.generate") == 600 and json.loads(kept.read_text()) == {"gen/actor.generate": [3.0]}


def test_calls_are_keyed_by_the_phase_they_run_in() -> None:
    """The validation's rollout keeps a history of its own: a validation set many times the
    training batch would otherwise run past the bound learned from the training rollouts."""
    assert call_key("actor", "generate") == "actor.generate" and where().step is None
    with at(step=4):
        with at("gen"):
            assert call_key("actor", "generate") == "gen/actor.generate" and where().step == 4
        with at("validate", 5):
            assert call_key("actor", "generate") == "validate/actor.generate" and where().step == 5
        assert where().phase is None and where().step == 4
    assert where().phase is None and where().step is None


def test_a_stopped_rank_blames_its_node_d_state_on_several_nodes_blames_none() -> None:
    def lagging(*pairs: tuple[str, str | None]) -> list[dict[str, Any]]:
        return [{"node": node, "state": state} for node, state in pairs]

    assert suspect_nodes(lagging(("a", "S"), ("b", "T"))) == (["b"], ". A stopped or D-state process points at its node")
    assert suspect_nodes(lagging(("a", "D"), ("a", "S"), ("b", None)))[0] == ["a"]  # one node's I/O
    assert suspect_nodes(lagging(("a", "S"), ("b", "R"), ("c", None))) == ([], "")  # waiting or unknown: no node
    nodes, why = suspect_nodes(lagging(("a", "D"), ("b", "D"), ("c", "T")))
    assert nodes == ["c"], nodes
    assert why.startswith(". Ranks in uninterruptible I/O (D) on 2 nodes: a shared file system") and why.endswith(
        "none is blamed for it; a stopped process points at its node"), why


def test_the_flight_recorders_name_the_rank_that_did_not_come_to_the_collective() -> None:
    def rank(r: int, node: str, enqueued: int | None) -> dict[str, Any]:
        groups = None if enqueued is None else {"0": {"last_enqueued": enqueued, "last_completed": 1}}
        return {"rank": r, "node": node, "nccl_trace_groups": groups}

    ranks = [rank(0, "a", 2), rank(1, "a", 1), rank(2, "b", 2), rank(3, "b", None)]  # rank 3: no dump
    assert behind_in_collectives(ranks) == (". By the flight recorders, the others enqueued collective #2 and "
                                            "these ranks did not: rank 1 on node `a` (#1)")
    assert behind_in_collectives([rank(0, "a", 2), rank(1, "b", 2)]) == ""  # all at the same one
    assert behind_in_collectives([rank(0, "a", 2), rank(1, "b", None)]) == ""  # one dump: nothing to compare


def _ranks_sleeping(tmp_path: Path, n: int) -> list[subprocess.Popen[str]]:
    """`n` processes that registered the stack dump as a rank does (`stacks/rank_<r>.txt`) and sleep."""
    code = ("import sys, time\nfrom pathlib import Path\nfrom trainer.watchdog import register_stack_dump\n"
            "register_stack_dump(Path(sys.argv[1]))\nprint('ready', flush=True)\ntime.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "stacks" / f"rank_{r}.txt")],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(n)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        # asleep, not still returning from the print (a busy machine may hold it there): the tests
        # name each rank's state
        wait_until(lambda proc=proc: process_state(proc.pid) == "S", "the rank asleep")  # type: ignore[misc]
    return procs


@contextlib.contextmanager
def _second_rank_stopped(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Two sleeping ranks (:func:`_ranks_sleeping`), the second stopped (`T`); both killed after."""
    procs = _ranks_sleeping(tmp_path, 2)
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait_until(lambda: process_state(procs[1].pid) == "T", "stopped state")
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def without_py_spy(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-spy missing (or not allowed to read the ranks): the watchdog signals them instead."""
    monkeypatch.setattr(watchdog, "py_spy_dump", lambda pid, path: False)


def test_the_stopped_rank_is_named_first_and_the_waiting_ones_stacks_are_written(
        tmp_path: Path, without_py_spy: None) -> None:
    """Every rank pending, as when one is stopped and the others wait on it in a collective: the
    stopped one is named first, its node is the suspect, the waiting rank's stack is on disk by
    the time :func:`diagnose` returns (the group is killed next), the stopped one's when it runs
    again (by the signal, without py-spy)."""
    with _second_rank_stopped(tmp_path) as procs:
        host = socket.gethostname()
        nodes = [{"rank": r, "hostname": host, "ip": "127.0.0.1", "pid": p.pid} for r, p in enumerate(procs)]
        bounds = Bounds(floor_s=600, multiple=5, min_s=2, warmup=2)
        for s in (1.0, 2.0):
            bounds.record("update_actor/actor.update_actor", s)
        with at("update_actor", 7):
            summary, details = diagnose(nodes, [0, 1], "actor", "update_actor", 12.3, bounds, tmp_path / "stacks")
        assert summary.startswith("worker group `actor`: `update_actor` in phase `update_actor` of step 7 has run "
                                  "12 s, past its bound (5 x the median of 2 earlier calls (1.5 s), at least 2 s); "
                                  f"2 of 2 rank(s) have not answered: rank 1 on node `{host}` (pid {procs[1].pid}, "
                                  f"stopped (T)); rank 0 on node `{host}` (pid {procs[0].pid}, sleeping (waiting)) "
                                  "(the other 1 may only be waiting on the first in a collective). A stopped or "
                                  "D-state process points at its node"), summary
        assert (details["phase"], details["step"], details["bound_s"], details["elapsed_s"]) == ("update_actor", 7, 7.5, 12.3)
        assert details["suspect_nodes"] == [host]
        assert [(r["rank"], r["state"], r["answered"], r["stack_by"]) for r in details["ranks"]] == [
            (0, "S", False, "signal"), (1, "T", False, "signal")]
        assert 'File "<string>", line 6 in <module>' in (tmp_path / "stacks" / "rank_0.txt").read_text()
        stopped_stack = tmp_path / "stacks" / "rank_1.txt"
        assert stopped_stack.read_text().startswith("# pid ") and "File " not in stopped_stack.read_text()  # a stopped process runs no handler
        os.kill(procs[1].pid, signal.SIGCONT)
        wait_until(lambda: 'File "<string>", line' in stopped_stack.read_text(), "stack of the continued rank")


def test_gpu_errors_blame_their_node_and_each_rank_says_why_it_has_no_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's kernel log has an Xid since the ranks started (the command runner, the one seam,
    answers from `tests/data/gpu/`): its node is a suspect though no rank is stopped or in `D`
    state, and the summary says why. The ranks run no flight-recorder thread (a stopped one runs
    no thread at all): each rank's `nccl_trace_note` says so, and no dump is waited for."""
    journal = (REPO / "tests" / "data" / "gpu" / "journal_xid.txt").read_text()
    monkeypatch.setattr(gpu_evidence, "run_command",
                        lambda argv: (0, journal) if argv[0] == "journalctl" else None)
    with _second_rank_stopped(tmp_path) as procs:
        host = socket.gethostname()
        nodes = [{"rank": r, "hostname": host, "ip": "127.0.0.1", "pid": p.pid} for r, p in enumerate(procs)]
        summary, details = diagnose(nodes, [0], "actor", "generate", 700.0, Bounds(), None,
                                    tmp_path / "nccl_trace", since=0.0)
    assert details["suspect_nodes"] == [host]  # rank 0 only waits (S); the Xids blame the node
    assert (f". GPU errors point at node(s) `{host}`: Xid 74 on GPU 0000:b9:00; Xid 120 on GPU 0000:23:00; "
            "Xid 79 on GPU 0000:3b:00. Flight recorder: ") in summary, summary
    assert summary.endswith("nccl_trace/rank_<r> (0 of 2 rank(s))"), summary
    assert details["gpu"][host]["tools"] == ["journalctl"] and details["gpu"][host]["notes"] == []
    assert [(r["nccl_trace"], r["nccl_trace_note"]) for r in details["ranks"]] == [
        (None, "the rank listens for no dump request (it started without the watchdog)"),
        (None, "the rank is stopped (T): none of its threads runs")]
    assert "stack" not in details["ranks"][0]  # no stacks asked for


def test_no_gpu_tools_is_no_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_evidence, "run_command", lambda argv: None)  # no tool installed
    nodes = [{"rank": 0, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}]
    summary, details = diagnose(nodes, [0], "actor", "generate", 700.0, Bounds(), None, since=0.0)
    assert details["suspect_nodes"] == [] and "Flight recorder" not in summary
    assert summary.endswith(f"(pid {os.getpid()}, running). No GPU evidence (no GPU tools on "
                            f"{socket.gethostname()})"), summary


def test_a_later_run_appends_to_the_stacks_of_the_run_before(tmp_path: Path, without_py_spy: None) -> None:
    """A requeued run's ranks register their dump in the same run directory: the stacks of the
    hang that ended the run before stay, and the next dump is waited for past the old one."""
    def one_run() -> dict[str, Any]:
        """A run's rank 0, sleeping, diagnosed as stuck: the diagnosis' details."""
        procs = _ranks_sleeping(tmp_path, 1)
        try:
            nodes = [{"rank": 0, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": procs[0].pid}]
            return diagnose(nodes, [0], "actor", "generate", 700.0, Bounds(), tmp_path / "stacks")[1]
        finally:
            procs[0].kill()
            procs[0].wait()

    first = one_run()
    second = one_run()  # the rerun's rank 0
    text = (tmp_path / "stacks" / "rank_0.txt").read_text()
    offset = second["ranks"][0]["stack_offset"]
    assert first["ranks"][0]["stack_offset"] > 0 and offset > first["ranks"][0]["stack_offset"]
    assert text.count("# pid ") == 2 and text.count('File "<string>", line') == 2, text  # line 5 or 6: printing or asleep
    assert 'File "<string>", line' in text[offset:], text


def test_py_spy_reads_every_ranks_stack_at_once_the_stopped_ones_too(tmp_path: Path) -> None:
    """With py-spy (a dev dependency, so CI has it): the stacks are read from the processes' memory,
    the stopped rank's as well, before :func:`diagnose` returns; no rank is signalled."""
    if not (Path(sys.executable).with_name("py-spy").exists() or shutil.which("py-spy")):
        if os.environ.get("CI") == "true":
            pytest.fail("py-spy is not installed (`pip install -e '.[dev]'` installs it)")
        pytest.skip("py-spy is not installed")
    with _second_rank_stopped(tmp_path) as procs:
        nodes = [{"rank": r, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": p.pid} for r, p in enumerate(procs)]
        _, details = diagnose(nodes, [1], "actor", "update_actor", 700.0, Bounds(), tmp_path / "stacks")
        assert [(r["state"], r["stack_by"]) for r in details["ranks"]] == [("S", "py-spy"), ("T", "py-spy")]
        for rank in (0, 1):
            text = (tmp_path / "stacks" / f"rank_{rank}.txt").read_text()
            # line 5 or 6: stopped while printing `ready` or asleep
            assert f"py-spy dump of pid {procs[rank].pid}" in text and re.search(r"<module> \(<string>:[56]\)", text), text
            assert "File " not in text  # no signal handler ran


def test_process_state_reads_a_stopped_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(os.getpid()) == "R"
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid) == "T", "stopped state")
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


def test_ranks_on_other_nodes_are_read_there_all_at_once(ray_local: Any, tmp_path: Path) -> None:
    """Ranks whose host is not the driver's: their states are read, and their stacks asked for, by
    a task pinned to their node (here the one node of a local cluster, under another name); the
    ranks of a node not in the cluster have an unknown state, and a long list is cut short."""
    with _second_rank_stopped(tmp_path) as procs:
        ip = ray_local.nodes()[0]["NodeManagerAddress"]
        nodes = [{"rank": r, "hostname": "node-b", "ip": ip, "pid": p.pid} for r, p in enumerate(procs)]
        nodes += [{"rank": r, "hostname": "node-c", "ip": "192.0.2.7", "pid": 4000 + r} for r in range(2, 8)]
        summary, details = diagnose(nodes, list(range(8)), "actor", "generate", 700.0, Bounds(), tmp_path / "stacks")
    assert [r["state"] for r in details["ranks"]] == ["S", "T"] + [None] * 6
    assert details["suspect_nodes"] == ["node-b"]
    assert shows_stack((tmp_path / "stacks" / "rank_0.txt").read_text())  # py-spy's, or the signal's
    assert (f"8 of 8 rank(s) have not answered: rank 1 on node `node-b` (pid {procs[1].pid}, stopped (T)); "
            f"rank 0 on node `node-b` (pid {procs[0].pid}, sleeping (waiting)); rank 2 on node `node-c` "
            "(pid 4002, state unknown); rank 3") in summary, summary
    assert "rank 6" not in summary and "and 3 more (every rank in `diagnosis.jsonl`) (the other 7 may" in summary, summary
    assert "past its bound (the first calls' floor, 600 s (`trainer.watchdog.floor_s`))" in summary, summary


@pytest.mark.slow
def test_a_stopped_rank_is_named_with_its_state_and_the_others_stacks_are_dumped(ray_local: Any, tmp_path: Path) -> None:
    from trainer.workers.group import WorkerFailure
    from trainer.workers.ray_group import make_placement_group, start_colocated

    stacks = tmp_path / "stacks"
    group = start_colocated({"actor": Worker}, None, 1, slot=make_placement_group(1, 2), world_size=2,
                            stacks=stacks, traces=tmp_path / "nccl_trace")["actor"]
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
    # the answering rank's dump thread ran (these ranks form no process group); the stopped one's cannot
    assert (ranks[0]["nccl_trace"], ranks[0]["nccl_trace_note"]) == (None, "this rank is in no process group")
    assert ranks[1]["nccl_trace_note"] == "the rank is stopped (T): none of its threads runs"
    if shutil.which("nvidia-smi") is None and shutil.which("amd-smi") is None:
        assert f"No GPU evidence (no GPU tools on {group.nodes[1]['hostname']})" in text, text
    assert 2 < took < 30, took  # fired at its learned bound, not at the floor
    # the answering rank's threads' stacks: py-spy's at once (the stopped rank's too), else on the signal
    wait_until(lambda: shows_stack((stacks / "rank_0.txt").read_text()), "stack of the answering rank")
    if ranks[1]["stack_by"] == "py-spy":
        assert shows_stack((stacks / "rank_1.txt").read_text()), (stacks / "rank_1.txt").read_text()
    with pytest.raises(ray_local.exceptions.RayActorError):  # the group was ended, the stopped rank too
        ray_local.get(group.actors[1].call.remote("actor", "node_info"), timeout=30)


def _wait_for_rows(metrics: Path, rows: int, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < rows:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the trainer ended early ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"{metrics} did not reach {rows} rows within {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_run_with_a_stopped_rank_ends_with_the_diagnosis(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`python -m trainer` on two Ray ranks; after two steps (every call of a step then has its
    two durations) rank 1 is stopped with SIGSTOP. The run ends (status 1) at the learned bound,
    far below the floor, with a `hang` diagnosis naming rank 1 as stopped and its node as the
    suspect; the other rank's stack is written; `hpcrl status` reads the summary from there."""
    from tests.trainer.test_distributed import overrides
    from trainer.rewards.toy import write_toy_digits

    data, run = tmp_path / "toy", tmp_path / "run"
    write_toy_digits(data, train_size=64, val_size=4, seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HPCRL_"))}
    env["PYTHONPATH"] = str(REPO)
    floor = 300
    argv = [sys.executable, "-m", "trainer", *overrides(
        tiny_model_dir, data, run, "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=500", "trainer.save_freq=-1", "trainer.test_freq=-1",
        f"trainer.watchdog.floor_s={floor}", "trainer.watchdog.warmup=2", "trainer.watchdog.min_s=20",
        "trainer.watchdog.poll_s=0.5")]
    proc = subprocess.Popen(argv, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim: dict[str, Any] = {}
    try:
        _wait_for_rows(run / "metrics.jsonl", 2, proc, timeout=400)
        victim = json.loads((run / "workers.json").read_text())["actor_rollout_ref"][1]
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=floor)
        ended = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if victim and process_state(victim["pid"]) is not None:
            os.kill(victim["pid"], signal.SIGKILL)
    assert proc.returncode == 1, (proc.returncode, out[-2000:], err[-3000:])
    hangs = [d for d in read_diagnoses(run) if d["kind"] == "hang"]
    assert len(hangs) == 1, read_diagnoses(run)
    hang = hangs[0]
    host = socket.gethostname()
    assert hang["group"] == "actor_rollout_ref" and hang["step"] >= 3 and hang["phase"], hang
    assert hang["bound_s"] < floor and hang["elapsed_s"] <= hang["bound_s"] + 30, hang  # the learned bound
    assert f"rank 1 on node `{host}` (pid {victim['pid']}, stopped (T))" in hang["summary"], hang["summary"]
    assert hang["suspect_nodes"] == [host]
    ranks = {r["rank"]: r for r in hang["ranks"]}
    assert ranks[1]["state"] == "T" and not ranks[1]["answered"]
    assert shows_stack(Path(ranks[0]["stack"]).read_text())  # the other rank's threads, written before the kill
    # rank 0's recorder (gloo's): the collective it waits in when it has not answered (rank 1 never
    # joins it), none pending when it has (a rollout, whose ranks do not meet)
    assert ranks[0]["nccl_trace"] == str(run / "nccl_trace" / "rank_0"), ranks[0]
    pending = r"none pending" if ranks[0]["answered"] else r"waiting in gloo:\w+ #\d+"
    assert re.match(rf"gloo's flight recorder( \(this torch build has no NCCL\))?: \d+ entries, {pending}$",
                    ranks[0]["nccl_trace_note"]), ranks[0]
    assert ranks[1]["nccl_trace"] is None and "stopped (T)" in ranks[1]["nccl_trace_note"]
    assert hang["gpu"][host]["suspect"] == []  # a CPU node: no GPU errors, nobody blamed for them
    assert "trainer: watchdog: worker group `actor_rollout_ref`" in out + err, (out[-2000:], err[-3000:])
    assert ended < floor
    status = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=120)
    assert f"rank 1 on node `{host}`" in status.stdout + status.stderr, status.stdout + status.stderr
