"""The trainer's diagnoses as the launcher reads them (:mod:`hpcrl.diagnosis`): which nodes the
watchdog blamed in this run, for the head agent's requeue without them."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpcrl.diagnosis import (
    DIAGNOSIS_FILE,
    as_job_nodes,
    blamed_nodes,
    read_diagnoses,
    write_diagnosis,
)


def test_only_this_run_s_hang_diagnoses_blame_nodes(tmp_path: Path) -> None:
    old = time.time() - 3600
    with (tmp_path / DIAGNOSIS_FILE).open("w") as f:  # an earlier run's, an hour ago
        f.write(json.dumps({"time": old, "kind": "hang", "summary": "s", "suspect_nodes": ["gpu001"]}) + "\n")
    since = time.time()
    write_diagnosis(tmp_path, "oom", "killed for memory", suspect_nodes=["gpu002"])  # not a hang
    write_diagnosis(tmp_path, "hang", "rank 5 stopped", suspect_nodes=["gpu017"])
    write_diagnosis(tmp_path, "hang", "no node at fault", suspect_nodes=[])
    assert blamed_nodes(tmp_path, since) == ["gpu017"]
    assert blamed_nodes(tmp_path, old) == ["gpu001", "gpu017"]
    assert blamed_nodes(tmp_path / "nothing-here", since) == []
    assert len(read_diagnoses(tmp_path)) == 4


def test_blamed_hosts_become_the_job_s_slurm_node_names_or_are_set_apart() -> None:
    job = ["gpu017", "gpu018", "login.example"]
    assert as_job_nodes(["gpu018"], job) == (["gpu018"], [])
    assert as_job_nodes(["gpu017.cluster.local", "gpu017"], job) == (["gpu017"], [])  # one node, once
    assert as_job_nodes(["login"], job) == (["login.example"], [])
    assert as_job_nodes(["3f9c2a1b7d4e", "gpu018"], job) == (["gpu018"], ["3f9c2a1b7d4e"])  # a container's own name
    assert as_job_nodes([], job) == ([], [])
