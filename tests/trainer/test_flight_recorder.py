"""The flight recorder of the trainer's ranks (:mod:`trainer.flight_recorder`): two real gloo
ranks, one blocked in a collective the other never joins; the watchdog's request reaches each
rank's dump thread through its pipe, the dumps say which collective each rank is in, and the
diagnosis names the rank that never came to it."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO, wait_until
from trainer import flight_recorder as FR
from trainer.watchdog import Bounds, diagnose, process_state

RANK = """
import os, sys, time
from pathlib import Path
from trainer import flight_recorder as FR
rank, port, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
os.environ.update(FR.recorder_env(folder))  # before the group, as a rank does
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
FR.start_listener(folder, rank)
t = torch.ones(4)
dist.all_reduce(t)
print("ready", flush=True)
if rank == 0:
    dist.all_reduce(t)  # rank 1 never joins this one
time.sleep(120)
"""


def test_a_rank_blocked_in_a_collective_dumps_where_it_waits(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from trainer.parallel import free_port

    folder = tmp_path / FR.TRACE_DIR
    # the ranks' pipes in this test's folder, not /tmp (the ranks are killed: theirs would stay)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    port = str(free_port("127.0.0.1"))
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(folder)], stdout=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    try:
        for proc in ranks:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        wait_until(lambda: process_state(ranks[0].pid) == "S", "rank 0 waiting in its all_reduce")
        host = socket.gethostname()
        nodes = [{"rank": r, "hostname": host, "ip": "127.0.0.1", "pid": p.pid} for r, p in enumerate(ranks)]
        summary, details = diagnose(nodes, [0, 1], "actor", "update_actor", 700.0, Bounds(), None, folder)
        notes = [FR.read_note(folder, r) for r in range(2)]
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    # the watchdog's summary names the rank that never came to the collective rank 0 waits in
    assert (". By the flight recorders, the others enqueued collective #2 and these ranks did not: "
            f"rank 1 on node `{host}` (#1). Flight recorder: {folder}/rank_<r> (2 of 2 rank(s))") in summary, summary
    assert [r["nccl_trace_note"] for r in details["ranks"]] == [
        "gloo's flight recorder (this torch build has no NCCL): 2 entries, waiting in gloo:all_reduce #2",
        "gloo's flight recorder (this torch build has no NCCL): 1 entries, none pending"], details["ranks"]
    assert notes[0] is not None and notes[1] is not None
    assert notes[0]["file"] == str(folder / "rank_0") and notes[0]["recorder"].startswith("gloo")
    assert notes[0]["pending"] == "gloo:all_reduce #2", notes[0]
    assert notes[0]["groups"] == {"0": {"last_enqueued": 2, "last_completed": 1}}, notes[0]
    assert notes[1]["pending"] is None and notes[1]["groups"] == {"0": {"last_enqueued": 1, "last_completed": 1}}
    trace = pickle.loads((folder / "rank_0").read_bytes())  # torch's own format, as its `fr_trace` reads
    assert [e["profiling_name"] for e in trace["entries"]] == ["gloo:all_reduce", "gloo:all_reduce"]
    assert any("all_reduce" in str(f.get("name")) for f in trace["entries"][1]["frames"]), trace["entries"][1]


def test_without_a_listener_or_a_group_the_reason_is_given(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert FR.request_dump(sleeper.pid) == ("the rank listens for no dump request (it started without "
                                                "the watchdog)")
        os.mkfifo(FR.pipe_path(sleeper.pid))  # a pipe nobody reads (its process died, say)
        why = FR.request_dump(sleeper.pid)
        assert why is not None and why.startswith("no thread of the rank reads its dump request"), why
    finally:
        FR.pipe_path(sleeper.pid).unlink(missing_ok=True)
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    note = FR.dump(tmp_path, 3)  # this test process is in no process group
    assert note["why"] == "this rank is in no process group" and "file" not in note
    assert FR.read_note(tmp_path, 3) == note and not (tmp_path / "rank_3").exists()


def test_pending_is_read_from_the_group_s_status_not_the_entry_s_state() -> None:
    """gloo's entries stay `scheduled` and are retired a while after they complete (seen on a busy
    machine: a finished all-reduce not yet retired); the group's last completed collective says."""
    def entry(seq: int, retired: bool) -> dict:
        return {"pg_id": 0, "collective_seq_id": seq, "profiling_name": "gloo:all_reduce", "state": "scheduled",
                "retired": retired, "is_p2p": False}

    status = {"0": {"last_enqueued_collective": 2, "last_started_collective": -1, "last_completed_collective": 1}}
    trace = {"entries": [entry(1, False), entry(2, False)], "pg_status": status}
    assert FR.summarise(trace) == {"entries": 2, "groups": {"0": {"last_enqueued": 2, "last_completed": 1}},
                                   "pending": "gloo:all_reduce #2"}
    assert FR.summarise({"entries": [entry(1, True)]})["pending"] is None  # no status: the entry's own word


def test_an_entry_nccl_marks_completed_is_not_pending_though_its_group_s_status_lags() -> None:
    """What NCCL's recorder gave on an H200 (torch 2.11, NCCL 2.28.9; `bench/gpu_check.py`'s
    `flight_recorder`): five all-reduces whose CUDA end events fired (`completed`), and the group's
    `last_completed` still -1. Nothing is pending; an entry not yet completed past it still is."""
    def entry(seq: int, state: str) -> dict:
        return {"pg_id": 0, "collective_seq_id": seq, "profiling_name": "nccl:all_reduce", "state": state,
                "retired": False, "is_p2p": False}

    status = {"0": {"last_enqueued_collective": 5, "last_started_collective": -1, "last_completed_collective": -1}}
    done = {"entries": [entry(s, "completed") for s in range(1, 6)], "pg_status": status}
    assert FR.summarise(done)["pending"] is None, FR.summarise(done)
    hung = {"entries": [*done["entries"][:4], entry(5, "started")], "pg_status": status}
    assert FR.summarise(hung)["pending"] == "nccl:all_reduce #5"


def test_a_rank_that_cannot_make_its_pipe_runs_on_without_dumps(tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                capsys) -> None:
    monkeypatch.setattr(FR, "pipe_path", lambda pid: tmp_path / "missing" / f"pipe-{pid}")  # no such folder
    assert FR.start_listener(tmp_path, 0) is None
    assert "no flight-recorder dumps at a watchdog fire: cannot make the pipe" in capsys.readouterr().err
