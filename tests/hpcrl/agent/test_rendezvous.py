from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrl.agent import rendezvous as rdv


def paths(tmp_path: Path, restart: int = 0) -> rdv.RunPaths:
    p = rdv.RunPaths(tmp_path / "run", restart)
    p.run_dir.mkdir(exist_ok=True)
    rdv.create_run_dirs(p, "node1")
    return p


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_dir_is_private_and_token_is_0600(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o755)
    p = paths(tmp_path)
    assert mode(p.run_dir) == 0o700 and mode(p.root) == 0o700
    token = rdv.write_token(p)
    assert mode(token) == 0o600
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) >= 0


def test_missing_run_dir_is_not_created(tmp_path: Path) -> None:
    p = rdv.RunPaths(tmp_path / "not-shared", 0)
    with pytest.raises(rdv.RendezvousError, match="does not exist on node `node2`.*shared"):
        rdv.create_run_dirs(p, "node2")
    assert not p.run_dir.exists()


def test_foreign_open_run_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "shared"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    monkeypatch.setattr(os, "getuid", lambda: 4242)  # as if another user owned it
    with pytest.raises(rdv.RendezvousError, match="readable by others"):
        rdv.secure_dir(d)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers() | st.text(max_size=20)))
def test_atomic_json_round_trip(tmp_path_factory: pytest.TempPathFactory, data: dict) -> None:
    path = tmp_path_factory.mktemp("j") / "x.json"
    rdv.atomic_write_json(path, data)
    assert rdv.read_json(path) == data
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary left


def test_readers_never_see_half_written_files(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    big = {"k": "x" * 200_000}
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                data = rdv.read_json(path)
            except json.JSONDecodeError as exc:  # would mean a torn read
                seen.append(str(exc))
                return
            if data is not None:
                assert data == big

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(30):
        rdv.atomic_write_json(path, big)
    stop.set()
    t.join()
    assert seen == []


def test_wait_for_publication_returns_once_written(tmp_path: Path) -> None:
    p = paths(tmp_path)

    def later() -> None:
        time.sleep(0.3)
        rdv.publish(p, {"address": "10.77.0.11"})

    threading.Thread(target=later).start()
    start = time.monotonic()
    info = rdv.wait_for_publication(p, "node1", timeout_s=10)
    assert info["address"] == "10.77.0.11" and info["version"] == rdv.RENDEZVOUS_VERSION
    assert time.monotonic() - start < 5


def test_wait_for_publication_times_out_naming_the_head(tmp_path: Path) -> None:
    p = paths(tmp_path)
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    with pytest.raises(rdv.RendezvousError, match="head node `node1` did not publish"):
        rdv.wait_for_publication(p, "node1", 2.0, clock=lambda: now[0], sleep=sleep)
    assert sleeps and max(sleeps) <= 0.1  # polls at 100 ms or better


def test_wait_for_publication_gives_up_on_stop(tmp_path: Path) -> None:
    p = paths(tmp_path)
    rdv.request_stop(p, 2, "node3", "Ray exited")
    stop = rdv.read_stop(p)
    assert stop is not None
    with pytest.raises(rdv.RendezvousError, match="node3 asked to stop"):
        rdv.wait_for_publication(p, "node1", 10, keep_waiting=lambda: f"{stop['by']} asked to stop")


def test_version_mismatch_is_explained(tmp_path: Path) -> None:
    p = paths(tmp_path)
    rdv.atomic_write_json(p.rendezvous, {"version": 99})
    with pytest.raises(rdv.RendezvousError, match="same hpcrl version"):
        rdv.wait_for_publication(p, "node1", 1)


def test_first_stop_request_wins(tmp_path: Path) -> None:
    p = paths(tmp_path)
    assert rdv.request_stop(p, 1, "node2", "raylet died")
    assert not rdv.request_stop(p, 0, "node1", "payload exited with status 0", 0)
    stop = rdv.read_stop(p)
    assert stop is not None and stop["by"] == "node2" and stop["rank"] == 1
    assert [x.name for x in p.root.iterdir() if x.name.startswith(".stop")] == []


def test_missing_nodes_are_named(tmp_path: Path) -> None:
    p = paths(tmp_path)
    rdv.write_node(p, 0, {"host": "node1", "state": "running"})
    rdv.write_node(p, 1, {"host": "node2", "state": "starting"})
    arrived = rdv.read_nodes(p)
    assert sorted(arrived) == [0, 1]
    missing = rdv.missing_nodes(["node1", "node2", "node3"], arrived, joined={0})
    assert missing == [
        "node2 (rank 1: agent is `starting`, not yet in the Ray cluster)",
        "node3 (rank 2: its agent never wrote a node file)",
    ]


def test_node_files_are_rewritten_in_place_and_a_torn_read_is_no_news(tmp_path: Path) -> None:
    p = paths(tmp_path)
    clock = [100.0]
    peers = rdv.Peers(p, clock=lambda: clock[0])
    writer = rdv.NodeFileWriter(p.node_file(1))
    writer.write(rdv.node_record(1, 1, {"host": "node2", "state": "running", "x": "y" * 50}))
    inode = p.node_file(1).stat().st_ino
    assert peers.read()[1]["beat"] == 1
    writer.write(rdv.node_record(1, 2, {"host": "node2", "state": "running"}))  # shorter
    assert p.node_file(1).stat().st_ino == inode  # no create, no rename
    clock[0] = 105.0
    assert peers.read()[1]["beat"] == 2 and peers.changed_after(1, 101.0)
    p.node_file(1).write_bytes(b'{"rank": 1, "be')  # what a read mid-rewrite may see
    clock[0] = 130.0
    assert peers.read()[1]["beat"] == 2  # the last complete content, not news
    assert peers.stale(20) == [1] and peers.silent_s(1) == 25.0
    writer.close()
    peers.close()


def test_canary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    nonce = rdv.write_canary(run)
    rdv.verify_canary(run, nonce, "node2")
    with pytest.raises(rdv.RendezvousError, match="different"):
        rdv.verify_canary(run, "0" * 32, "node2")
    with pytest.raises(rdv.RendezvousError, match="node `node3` cannot read"):
        rdv.verify_canary(tmp_path / "elsewhere", nonce, "node3")


def test_a_run_directory_of_another_job_is_refused(tmp_path: Path) -> None:
    """`RUN/<N>/` of another job (its agents' state lines, its head's publication: the stop
    request and rendezvous there are not this job's) is refused before anything is written;
    this job's own, or a new one, is accepted."""
    from hpcrl.runstate import AGENT_STARTED, StateWriter

    p = paths(tmp_path)
    rdv.check_new_run(p, "12")  # new
    StateWriter(p.run_dir, 0, 0, "node1").append(AGENT_STARTED, pid=1, nodes=1, job_id="12")
    rdv.request_stop(p, 0, "node1", "payload exited with status 3 after the stop request")
    rdv.check_new_run(p, "12")  # its own run
    with pytest.raises(rdv.RendezvousError, match=r"holds the run of job 12, not of this job 13"):
        rdv.check_new_run(p, "13")
    rdv.check_new_run(rdv.RunPaths(p.run_dir, 1), "13")  # the next free one is fine
    (tmp_path / "b").mkdir()
    other = paths(tmp_path / "b")
    rdv.publish(other, {"job_id": "7", "gcs_address": "10.0.0.1:6379"})
    with pytest.raises(rdv.RendezvousError, match="job 7, not of this job 8"):
        rdv.check_new_run(other, "8")


def test_a_worker_never_joins_another_jobs_publication(tmp_path: Path) -> None:
    p = paths(tmp_path)
    rdv.publish(p, {"job_id": "7", "gcs_address": "10.0.0.1:6379"})
    assert rdv.wait_for_publication(p, "node1", 1.0, job_id="7")["job_id"] == "7"
    with pytest.raises(rdv.RendezvousError, match="published by job 7, not by this job 8"):
        rdv.wait_for_publication(p, "node1", 1.0, job_id="8")
def test_fs_type_is_that_of_the_deepest_mount_holding_the_path(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("rootfs / ext4 rw 0 0\nmds@o2ib:/fs /scratch lustre rw 0 0\n"
                      "srv:/home /scratch/nfs\\040dir nfs4 rw 0 0\n")
    assert rdv.fs_type(Path("/scratch/nfs dir/run"), mounts) == "nfs4"
    assert rdv.fs_type(Path("/scratch/run"), mounts) == "lustre"
    assert rdv.fs_type(Path("/scratchy"), mounts) == "ext4"
    assert rdv.fs_type(Path("/x"), tmp_path / "none") == ""
