"""Several agents on this machine as the nodes of one Slurm-like job, with real Ray."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "ray", reason="the agent tests start real Ray clusters (`pip install hpcrl[train]`)"
)

pytestmark = pytest.mark.slow

from hpcrl.netaddr import AddressError, NetworkPolicy, choose_address, local_addresses  # noqa: E402
from tests.hpcrl.agent.agent_helpers import leftovers, make_run, start_agent, wait_for_text  # noqa: E402


def has_global_ipv6() -> bool:
    try:
        choose_address(local_addresses(), NetworkPolicy(family="ipv6"))
    except AddressError:
        return False
    return True


def slurm_env(job_id: str, nodes: int) -> dict[str, str]:
    host = os.uname().nodename
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST": ",".join([host] * nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
    }


def test_two_agent_job_survives_join_and_ends_fast_when_a_worker_dies(tmp_path: Path) -> None:
    """Two agents on this host as ranks 0 and 1 of one Slurm-like job (over IPv6 where this
    machine has a global IPv6 address); kill rank 1's agent."""
    v6 = has_global_ipv6()
    family = "ipv6" if v6 else "ipv4"
    run = make_run(tmp_path, f"9{os.getpid()}", {"PAYLOAD_SLEEP": "300"}, nodes=2, family=family)
    slurm = slurm_env(run.name, 2)
    head = start_agent(run, {**slurm, "SLURM_NODEID": "0"})
    worker = start_agent(run, {**slurm, "SLURM_NODEID": "1"})
    try:
        wait_for_text(run / "0" / "logs" / "payload.log", "one task ran on each of 2 nodes", 150)
        killed_at = time.monotonic()
        worker.kill()
        out, _ = head.communicate(timeout=60)
        ended_after = time.monotonic() - killed_at
    finally:
        for p in (head, worker):
            if p.poll() is None:
                p.kill()
    assert head.returncode == 1, out
    assert ended_after < 30, f"job took {ended_after:.1f} s to end"
    assert "(rank 1)" in out and ("no longer alive" in out or "heartbeat" in out)
    payload_log = (run / "0" / "logs" / "payload.log").read_text()
    assert "payload: 2 alive nodes" in payload_log
    if v6:
        address = json.loads((run / "0" / "rendezvous.json").read_text())["gcs_address"]
        assert address.startswith("[") and f"cluster at address: {address}" in payload_log
    time.sleep(1)  # the worker's Ray dies of its parent-death signal (SIGKILL: it blocks SIGTERM)
    # the killed agent could not remove its temp dir; its next run on that node does
    assert leftovers(run, ranks=(0,)) == []
    assert len(list((run / "0" / "nodes").glob("*.json"))) == 2
    for stale in Path("/tmp").glob(f"hr-{run.name}-*-1-*"):
        shutil.rmtree(stale)


def test_a_payload_started_with_the_head_alone_sees_the_others_join(tmp_path: Path) -> None:
    """`payload_start: head-alive` (the trainer's): the head starts the payload as soon as its
    own Ray is up, before the worker's agent has even started; the worker joins while the
    payload runs, and the head records it."""
    run = make_run(tmp_path, f"7{os.getpid()}", {"PAYLOAD_WAIT_NODES": "2"}, nodes=2,
                   payload_start="head-alive")
    slurm = slurm_env(run.name, 2)
    head = start_agent(run, {**slurm, "SLURM_NODEID": "0"})
    worker = None
    try:
        wait_for_text(run / "0" / "logs" / "payload.log", "payload: started with 1 alive nodes", 120)
        worker = start_agent(run, {**slurm, "SLURM_NODEID": "1"})
        out, _ = head.communicate(timeout=120)
        worker.communicate(timeout=60)
    finally:
        for p in (head, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert head.returncode == 0, out
    assert "1/2 nodes joined, the others join while it starts (`payload_start: head-alive`); " \
        "starting the payload" in out
    assert out.index("starting the payload") < out.index("all 2 nodes joined")
    assert "one task ran on each of 2 nodes" in (run / "0" / "logs" / "payload.log").read_text()
    assert worker.returncode == 0
    assert leftovers(run, ranks=(0, 1)) == []


def test_join_timeout_names_the_nodes_that_did_not_arrive(tmp_path: Path) -> None:
    """Three nodes, only rank 0 and rank 1 start; the head gives up naming rank 2."""
    run = make_run(tmp_path, f"8{os.getpid()}", {}, nodes=3, agent={"join_timeout_s": 25})
    slurm = slurm_env(run.name, 3)
    head = start_agent(run, {**slurm, "SLURM_NODEID": "0"})
    worker = start_agent(run, {**slurm, "SLURM_NODEID": "1"})
    try:
        out, _ = head.communicate(timeout=90)
        worker.communicate(timeout=60)
    finally:
        for p in (head, worker):
            if p.poll() is None:
                p.kill()
    assert head.returncode == 1
    assert "2/3 nodes joined" in out
    host = os.uname().nodename
    assert (
        f"only 2/3 nodes joined the Ray cluster within 25 s; missing: {host} (rank 2: its agent never wrote a node file)"
        in out
    )
    assert worker.returncode == 0  # it was told to stop; the head reports the failure
    assert leftovers(run, ranks=(0, 1)) == []
