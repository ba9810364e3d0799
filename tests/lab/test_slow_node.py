"""A slow node left out on request, on the Slurm lab, with the real trainer on two nodes.

The trainer's rank on the job's second node is throttled by the kernel (a CPU cgroup of its own
with 1 ms of CPU time each 20 ms: `cpu.cfs_quota_us` on cgroup v1, `cpu.max` on v2), as a node
with a throttled GPU or a busy neighbour runs: alive and answering, only slow. The trainer names
the node slow after `trainer.watchdog.slow_steps` (2) steps (its rollout's pace per generated
token against the other node's, against up to about 2x from step to step without the throttle
on the lab's shared cores, hence `slow_factor=3`); the job's site sets
`slurm.exclude_slow`, and a third node is idle, so the head asks the trainer to checkpoint and
requeues the job with the node added to its `ExcNodeList` (the user's `--exclude` kept); the
rerun resumes from that checkpoint on the spare."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl.agent.slow import SLOW_NODES
from hpcrl.diagnosis import read_diagnoses
from hpcrl.runstate import REQUEUE_DECIDED, REQUEUE_DONE, read_state
from tests.conftest import run_hpcrl
from tests.lab.config import INSTANCE
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

PERIOD_US, QUOTA_US = 20_000, 1_000
"""The throttled rank's CPU: 1 ms each 20 ms, a twentieth of one CPU (a tenth gave it 3x to 5.4x
the other rank's pace, too near the bound)."""


def _cpu_cgroup(name: str) -> tuple[Path, dict[str, str]] | None:
    """A new CPU cgroup `name` and what to write into it for the throttle (v1, else v2), or None
    where this machine has neither controller to give."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1 / name, {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(QUOTA_US)}
    v2 = Path("/sys/fs/cgroup")
    try:
        controllers = (v2 / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    if "cpu" not in controllers:
        return None
    (v2 / "cgroup.subtree_control").write_text("+cpu")  # the root cgroup may enable it for its children
    return v2 / name, {"cpu.max": f"{QUOTA_US} {PERIOD_US}"}


@contextlib.contextmanager
def throttled(pid: int) -> Iterator[Path]:
    """Process `pid` (all its threads) in a CPU cgroup of its own until the block ends; then the
    cgroup is removed (its process is moved back first where it still lives)."""
    found = _cpu_cgroup(f"hpcrl-lab{INSTANCE}-slow-{os.getpid()}")
    if found is None:
        pytest.skip("no CPU cgroup controller (v1 `cpu` or v2 `cpu.max`) here to throttle a rank with")
    group, limits = found
    group.mkdir()
    try:
        for name, value in limits.items():
            (group / name).write_text(value)
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for left in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(left)
        group.rmdir()


def wait_for_requeue(run_dir: Path, timeout: float) -> tuple[dict, dict]:
    """Run 0's requeue decision without the slow node, and the requeue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_state(run_dir, 0)
        decided = [r for r in rows if r["event"] == REQUEUE_DECIDED and r.get("lost_nodes")]
        done = [r for r in rows if r["event"] == REQUEUE_DONE]
        if decided and done:
            return decided[0], done[0]
        time.sleep(0.2)
    raise AssertionError(f"no requeue without the slow node\n{logs(run_dir)}")


def test_a_slowed_node_is_named_and_the_job_requeued_without_it_resumes_on_the_spare(
        lab_manager, sites, assets, tmp_path):  # noqa: F811 - fixtures
    """2 nodes of a 4-node lab, node4 excluded by the user, node3 idle: the rank on the second
    node throttled after step 2 is named slow, the job checkpoints and is requeued excluding
    node4 and it, and resumes on node3 from that checkpoint; 8 steps in all."""
    began = time.monotonic()
    lab = lab_manager.get(nodes=4)
    write_site(sites, "slownode", tmp_path / "runs", nodes=2)
    site = sites / "slownode.yaml"
    site.write_text(site.read_text().replace(
        "slurm:\n", "slurm:\n  exclude_slow: true\n  extra_sbatch: ['--exclude=node4']\n"))
    run_dir = tmp_path / "runs" / "slownode"
    args = [*overrides(assets, steps=8, save_freq=4),
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1",  # a rank on each node, in Ray's workers
            "trainer.watchdog.slow_factor=3", "trainer.watchdog.slow_steps=2"]
    job = submit(lab, sites, "slownode", run_dir, args)
    wait_for_step(lab, job, run_dir, 0, 2, timeout=300)
    nodes = lab.run("scontrol", "show", "hostnames", lab.job(job)["NodeList"]).stdout.split()
    assert nodes == ["node1", "node2"], nodes
    ranks = json.loads((run_dir / "workers.json").read_text())["actor_rollout_ref"]
    victim = next(r for r in ranks if r["hostname"] == nodes[1])
    t0 = time.time()
    with throttled(victim["pid"]):
        decided, done = wait_for_requeue(run_dir, timeout=300)
    slow = [d for d in read_diagnoses(run_dir) if d["kind"] == "slow"]
    assert len(slow) == 1 and slow[0]["nodes"] == [nodes[1]], (slow, logs(run_dir))
    assert f"node `{nodes[1]}` (rank(s) {victim['rank']}) is slow" in slow[0]["summary"], slow
    assert slow[0]["pace_s_per_token"] > 3 * slow[0]["others_s_per_token"], slow
    assert slow[0]["step"] >= 3, slow  # named for the throttle: a step after it began counted
    noted = [r for r in read_state(run_dir, 0) if r["event"] == SLOW_NODES]
    assert [(n["nodes"], n["action"]) for n in noted] == [([nodes[1]], "exclude")], noted
    assert "1 idle spare node(s) can take its place" in noted[0]["message"], noted
    assert decided["lost_nodes"] == [nodes[1]], decided
    assert f"node `{nodes[1]}` is slow (the trainer named it; `--exclude-slow`)" in decided["message"], decided
    assert f"set `ExcNodeList=node4,{nodes[1]}`" in done["message"], done
    status = run_hpcrl(["status", str(run_dir)], lab.env).stdout
    assert "diagnosis (slow," in status and f"node `{nodes[1]}`" in status, status
    newest = max(saved(run_dir, 0))
    wait_for_step(lab, job, run_dir, 1, newest + 1, timeout=300)
    resumed = time.time() - t0
    assert resumed_from(run_dir, 1) == newest, logs(run_dir)
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, logs(run_dir))
    assert rec["ExcNodeList"] == f"node4,{nodes[1]}", rec
    last = lab.run("scontrol", "show", "hostnames", rec["NodeList"]).stdout.split()
    assert last == ["node1", "node3"], last
    check_metrics(run_dir, 8)
    print(f"slowed at step 2; named slow after {slow[0]['time'] - t0:.1f} s (at step {slow[0]['step']}), "
          f"requeued after {done['time'] - t0:.1f} s from the checkpoint of step {newest}, its first step "
          f"resumed after {resumed:.1f} s; the test took {time.monotonic() - began:.0f} s")
