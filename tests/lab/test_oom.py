"""A rank killed for memory on the Slurm lab, with the real trainer on two nodes.

After step 2 the trainer's rank on the job's second node is moved into a memory cgroup of its own
whose limit it soon exceeds (v1 charges only what the rank touches after the move: a few MiB of a
step's allocations; v2 counts what it holds), and the kernel's OOM killer ends it. The run's error
names the rank, its node, the process, what it held and the cgroup's limit, says that a requeue
would not help, and the job ends without one: no requeue loop on the same plan and nodes.
`hpcrl status` shows the diagnosis."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcrl.diagnosis import read_diagnoses
from tests.conftest import run_hpcrl
from tests.lab.test_requeue import (
    assets,  # noqa: F401 - the module fixture: tiny model and toy task
    finished,
    logs,
    overrides,
    sites,  # noqa: F401 - fixture
    submit,
    wait_for_step,
    write_site,
)
from tests.trainer.test_memory_death import _memory_cgroup_or_skip, _remove

pytestmark = [pytest.mark.lab, pytest.mark.slow]

LIMIT = 4 << 20
"""The cgroup's limit: on v1 below what one step newly allocates (the rank's earlier pages stay
charged where they were), on v2 below what the rank holds."""


@contextlib.contextmanager
def memory_limited(pid: int) -> Iterator[Path]:
    """Process `pid` in a memory cgroup limited to :data:`LIMIT` until the block ends; then the
    cgroup is removed (once the killed process has left it)."""
    cgroup = _memory_cgroup_or_skip(LIMIT)
    try:
        (cgroup / "cgroup.procs").write_text(str(pid))
        yield cgroup
    finally:
        for left in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (cgroup.parent / "cgroup.procs").write_text(left)
        _remove(cgroup)


def test_a_rank_killed_for_memory_is_named_and_the_job_ends_without_a_requeue(
        lab, sites, assets, tmp_path):  # noqa: F811 - fixtures
    write_site(sites, "oomnode", tmp_path / "runs", nodes=2)
    run_dir = tmp_path / "runs" / "oomnode"
    args = [*overrides(assets, steps=8, save_freq=4), "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    job = submit(lab, sites, "oomnode", run_dir, args)
    wait_for_step(lab, job, run_dir, 0, 2, timeout=300)
    ranks = json.loads((run_dir / "workers.json").read_text())["actor_rollout_ref"]
    nodes = sorted({r["hostname"] for r in ranks})
    victim = next(r for r in ranks if r["hostname"] == nodes[1])
    with memory_limited(victim["pid"]) as cgroup:
        rec = finished(lab, job, run_dir, timeout=300)
    assert rec["JobState"] == "FAILED" and rec["Restarts"] == "0", (rec, logs(run_dir))
    deaths = [d for d in read_diagnoses(run_dir) if d["kind"] == "oom"]
    assert len(deaths) == 1, (read_diagnoses(run_dir), logs(run_dir))
    text = deaths[0]["summary"]
    assert f"rank {victim['rank']} on node `{nodes[1]}`" in text, text
    assert f"was killed for memory by the kernel's OOM killer: process {victim['pid']} (" in text, text
    assert f"the limit of its cgroup /{cgroup.name} is {LIMIT / 1e9:.2f} GB" in text or \
        f"(the `oom_kill` count of its cgroup `{cgroup}` rose" in text, text
    assert "A requeue would not help" in text and "Fix: lower the memory a rank holds" in text, text
    assert "holding " in text, text  # its resident memory at death, from the kernel's record
    status = run_hpcrl(["status", str(run_dir)], lab.env).stdout
    assert "diagnosis (oom," in status and f"node `{nodes[1]}`" in status, status
    print(f"killed for memory after step 2: {text}")
