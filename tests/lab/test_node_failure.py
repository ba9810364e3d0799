"""Whole nodes failing mid-run on the Slurm lab, with the real trainer on three nodes, then two.

First a worker node's network is cut (its link goes down: slurmd, Ray and the trainer's rank
lose every peer while its agent goes on beating through the shared run directory, so only the
GCS can tell), then, in the requeued run, the head node dies (every process of the node:
slurmd, its job steps, the agent, Ray and the trainer's rank, killed at once). Each time the surviving
agents notice within 30 s, the job is requeued with the lost node added to its `ExcNodeList`
(keeping the user's `--exclude`), and the rerun resumes from the newest complete checkpoint on a
spare node, or on one node fewer when none is left. Slurm itself keeps the requeued job `COMPLETING` until it marks the dead node down
(`SlurmdTimeout`, 300 s by default; 30 s in this lab), so the rerun starts after that."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl.rundir import REQUEUE_DECIDED, REQUEUE_DONE, read_state
from tests.lab.test_requeue import (
    assets,  # noqa: F401 - the module fixture: tiny model and toy task
    check_metrics,
    finished,
    logs,
    overrides,
    resumed_from,
    saved,
    sites,  # noqa: F401 - fixture
    submit,
    wait_for_step,
    write_site,
)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

SLURMD_TIMEOUT = "30"
"""How long Slurm waits before it marks a silent node down (the lab's; real sites: 300 s)."""


def kill_node(lab, host: str) -> int:
    """SIGKILL every process in `host`'s network namespace: slurmd, slurmstepd, the agent, Ray,
    the trainer. Returns how many there were."""
    ns = next(h.netns for h in lab.cfg.compute if h.name == host)
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          check=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def cut_network(lab, host: str) -> None:
    """Take `host`'s only link down: its processes live on, cut off from every other node."""
    ns = next(h.netns for h in lab.cfg.compute if h.name == host)
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)


def node_loss(run_dir: Path, restart: int, timeout: float = 60) -> tuple[dict, dict]:
    """The requeue decision and the requeue of run `restart` after a node loss."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_state(run_dir, restart)
        decided = [r for r in rows if r["event"] == REQUEUE_DECIDED and r.get("lost_nodes")]
        done = [r for r in rows if r["event"] == REQUEUE_DONE]
        if decided and done:
            return decided[0], done[0]
        time.sleep(0.2)
    raise AssertionError(f"no requeue after the node loss in run {restart}\n{logs(run_dir)}")


def test_a_cut_off_worker_then_a_dead_head_requeue_on_a_spare_then_on_one_node_fewer(
        lab_manager, sites, assets, tmp_path):  # noqa: F811 - fixtures
    """A 3-node job that may run on 2 (`slurm.min_nodes: 2`) on a lab of 5 nodes, one excluded
    by the user: run 0 on 3 nodes loses a worker (network cut) and resumes on the spare; run 1
    loses its head and, with no spare left, resumes on the 2 survivors with a world of 2 ranks
    from the checkpoint 3 ranks wrote."""
    lab = lab_manager.get(nodes=5, extra={"SlurmdTimeout": SLURMD_TIMEOUT})
    try:
        write_site(sites, "nodefail", tmp_path / "runs", nodes=3, slow_s=0.25, slow_runs="0,1")
        site = sites / "nodefail.yaml"  # with the user's own exclusion, kept through every requeue
        site.write_text(site.read_text().replace(
            "slurm:\n", "slurm:\n  min_nodes: 2\n  extra_sbatch: ['--exclude=node5']\n"))
        run_dir = tmp_path / "runs" / "nodefail"
        args = [a.replace("=4", "=6") if "batch_size" in a else a  # splits over 3 and 2 ranks
                for a in overrides(assets, steps=12, save_freq=2)]
        job = submit(lab, sites, "nodefail", run_dir, args)
        placed, noticed = [], []
        for restart, rank in ((0, 1), (1, 0)):  # a worker is cut off, then the head dies
            wait_for_step(lab, job, run_dir, restart, (restart + 1) * 4 - 1, timeout=400)
            nodes = lab.run("scontrol", "show", "hostnames", lab.job(job)["NodeList"]).stdout.split()
            assert len(nodes) == 3, nodes
            placed.append(nodes)
            victim = nodes[rank]
            t0 = time.time()
            if rank == 1:
                cut_network(lab, victim)
            else:
                assert kill_node(lab, victim) > 0
            decided, done = node_loss(run_dir, restart)
            assert decided["lost_nodes"] == [victim], decided
            noticed.append(decided["time"] - t0)
            assert noticed[-1] < 30, f"{noticed[-1]:.1f} s to notice that {victim} failed"
            assert "set `ExcNodeList=" in done["message"], done
            shrunk = "and `NumNodes=2-2 NumTasks=2 NumCPUs=" in done["message"]
            assert shrunk == (restart == 1), done  # no spare left the second time
            newest = max(saved(run_dir, restart))
            wait_for_step(lab, job, run_dir, restart + 1, newest + 1, timeout=300)
            assert resumed_from(run_dir, restart + 1) == newest, logs(run_dir)
        rec = finished(lab, job, run_dir)
        assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "2", (rec, logs(run_dir))
        lost = [placed[0][1], placed[1][0]]
        assert rec["ExcNodeList"] == ",".join(["node5", *lost]), rec
        last = lab.run("scontrol", "show", "hostnames", rec["NodeList"]).stdout.split()
        assert len(last) == 2 and not set(last) & {"node5", *lost}, (last, lost)
        agent_log = next((run_dir / "2" / "logs").glob("agent-0-*.log")).read_text()
        assert agent_log.count("job asked for 3 nodes, the allocation has 2; using 2") == 1
        payload_log = (run_dir / "2" / "logs" / "payload.log").read_text()
        assert "(saved on 3 rank(s)) on 2 rank(s)" in payload_log, payload_log[-2000:]
        assert "trainer.nnodes=${oc.env:HPCRL_NUM_NODES}" in agent_log
        check_metrics(run_dir, 12)
        print(f"noticed the cut-off worker after {noticed[0]:.1f} s, the dead head after "
              f"{noticed[1]:.1f} s; the last run had {len(last)} nodes")
    finally:
        lab_manager.discard()  # one of its nodes is cut off, one dead
