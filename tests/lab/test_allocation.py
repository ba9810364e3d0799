"""Ray sized to what Slurm granted, on the real lab (issue 16 item 1): the lab's nodes have 2 CPUs
each, a job asking `--cpus-per-task=1 --mem=...` sees exactly 1 CPU per node and its memory in
`ray.cluster_resources()`, and two such jobs share every node at once, each with its own share.

The lab's slurmd runs `TaskPlugin=task/none`: Slurm confines no job to a cgroup, so the first
test's memory comes from `SLURM_MEM_PER_NODE`. The second puts each node's agent into real
kernel cgroups itself (a profile `python` wrapper standing in for Slurm's task/cgroup) and shows
that Ray gets the cgroup's memory limit and cpuset when they are smaller than Slurm's grant."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_hpcrl

pytestmark = [pytest.mark.lab, pytest.mark.slow]
PROBE = REPO / "tests" / "payloads" / "resources_probe.py"
MIB = 1024**2
NODES = ("node1", "node2", "node3")


def write_site(sites: Path, name: str, run_root: Path, mem: str, env: str = "") -> None:
    """1 CPU and `mem` per node; the probe holds its cluster 8 s (the job gets only the
    profile's environment, so PROBE_SLEEP goes there)."""
    sites.mkdir(exist_ok=True)
    (sites / f"{name}.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\ncontainer:\n  runtime: none\n"
        f"slurm:\n  cpus_per_task: 1\n  mem: {mem}\nenv:\n  PROBE_SLEEP: \"8\"\n{env}"
    )


def submit(lab, sites: Path, site: str, run_dir: Path) -> int:
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    proc = run_hpcrl(["submit", "--site", site, "--via", "sbatch", "--run-dir", str(run_dir),
                      "--command", "--", sys.executable, str(PROBE)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split("job id: ")[1].split()[0])


def logs(run_dir: Path) -> str:
    return "\n".join(f"==> {f} <==\n{f.read_text(errors='replace')[-3000:]}"
                     for f in sorted(run_dir.rglob("*")) if f.is_file() and f.suffix in (".out", ".log"))


def test_two_jobs_share_each_node_and_each_sees_its_own_share(lab, tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    # B lists two GPUs the way the GPU profiles do (the lab has none; Ray counts what it is told)
    write_site(sites, "share-a", tmp_path / "runs", "700M")
    write_site(sites, "share-b", tmp_path / "runs", "900M", "  CUDA_VISIBLE_DEVICES: \"1,3\"\n")
    runs = {"a": tmp_path / "runs" / "a", "b": tmp_path / "runs" / "b"}
    jobs = {k: submit(lab, sites, f"share-{k}", runs[k]) for k in runs}
    for job in jobs.values():
        lab.wait_state(job, {"RUNNING", "COMPLETED"}, timeout=30)
    records = {k: lab.wait_done(job, timeout=180) for k, job in jobs.items()}
    for k, rec in records.items():
        assert rec["JobState"] == "COMPLETED", f"{rec}\n{logs(runs[k])}"
    seen = {k: json.loads((runs[k] / "resources.json").read_text()) for k in runs}

    for k, mem_mib, gpus in (("a", 700, 0), ("b", 900, 2)):
        store = int(mem_mib * MIB * 0.3)
        heap = mem_mib * MIB - store
        cluster, nodes = seen[k]["cluster"], seen[k]["nodes"]
        assert sorted(nodes) == list(NODES), nodes
        for host, res in nodes.items():  # every node: 1 of its 2 CPUs, the job's --mem
            assert res["CPU"] == 1.0, (k, host, res)
            assert res["memory"] == heap and res["object_store_memory"] == store, (k, host, res)
            assert res.get("GPU", 0.0) == gpus, (k, host, res)
        assert cluster["CPU"] == 3.0 and cluster.get("GPU", 0.0) == 3 * gpus, (k, cluster)
        # what the agent recorded: the head's state line and every node's heartbeat file
        state = [json.loads(line) for line in (runs[k] / "state.jsonl").read_text().splitlines()]
        (head,) = [r["allocation"] for r in state if r["event"] == "ray_resources"]
        assert (head["cpus"], head["memory_bytes"], head["gpus"]) == (1, mem_mib * MIB, gpus)
        assert head["sources"]["memory"] == "SLURM_MEM_PER_NODE", head
        for rank in range(3):
            node = json.loads((runs[k] / "0" / "nodes" / f"{rank}.json").read_text())
            assert node["allocation"]["cpus"] == 1, node
    assert seen["a"]["driver_env"]["CUDA_VISIBLE_DEVICES"] is None
    assert seen["b"]["driver_env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
    (a0, a1), (b0, b1) = seen["a"]["span"], seen["b"]["span"]
    assert max(a0, b0) < min(a1, b1), ("the two jobs' Ray clusters did not overlap", seen)
    # both jobs ran on all three 2-CPU nodes at once: Slurm granted each node's CPUs to both
    for rec in records.values():
        assert rec["NodeList"] == "node[1-3]", rec


# ------------------------------------------------------------------ a real cgroup on every node

WRAPPER = """#!/bin/sh
# Stands in for Slurm's task/cgroup, which the lab does not run (TaskPlugin=task/none): each
# node's agent enters a memory and a cpuset cgroup (v1, as on this machine) of its own, then
# becomes Python; Ray and the payload, its children, stay in them.
name=hpcrl-alloc-$SLURM_JOB_ID-$SLURM_NODEID
mem=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{{print $3}}' /proc/self/cgroup)/$name
cpu=/sys/fs/cgroup/cpuset$(awk -F: '$2=="cpuset"{{print $3}}' /proc/self/cgroup)/$name
mkdir "$mem" "$cpu" && echo "$mem" >> {record} && echo "$cpu" >> {record} || exit 97
echo {limit} > "$mem/memory.limit_in_bytes" || exit 98
cat "$cpu/../cpuset.mems" > "$cpu/cpuset.mems" && echo {cpus} > "$cpu/cpuset.cpus" || exit 99
echo $$ > "$mem/cgroup.procs" && echo $$ > "$cpu/cgroup.procs" || exit 100
exec {python} "$@"
"""


@pytest.fixture
def cgroup_python(tmp_path: Path):
    """A profile `python` that puts each node's agent into a 2500 MiB memory cgroup and onto
    CPU 1 only; the cgroups are removed after the test. Needs the v1 memory and cpuset
    controllers (this machine's hybrid layout); a v2-only host skips."""
    if not all(Path(f"/sys/fs/cgroup/{c}/cgroup.procs").exists() for c in ("memory", "cpuset")):
        pytest.skip("no cgroup v1 memory and cpuset controllers here to stand in for Slurm's")
    record = tmp_path / "cgroups.txt"
    record.touch()
    wrapper = tmp_path / "cgpython"
    wrapper.write_text(WRAPPER.format(record=record, limit=2500 * MIB, cpus="1",
                                      python=sys.executable))
    wrapper.chmod(0o755)
    yield wrapper
    left = []
    for line in record.read_text().split():
        try:
            Path(line).rmdir()
        except OSError as exc:
            left.append(f"{line}: {exc}")
    assert not left, f"cgroups not removed (processes left in them?): {left}"


def test_a_cgroup_memory_limit_and_cpuset_are_what_ray_gets(lab, tmp_path: Path, cgroup_python: Path) -> None:
    """The job may use both CPUs of each node and 3000M; its cgroup allows 2500 MiB and CPU 1:
    Ray gets the cgroup's smaller numbers, read from the kernel's own files."""
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "cg.yaml").write_text(
        f"extends: slurmlab\nrun_root: {tmp_path / 'runs'}\npython: {cgroup_python}\n"
        "container:\n  runtime: none\nslurm:\n  cpus_per_task: 2\n  mem: 3000M\n")
    run_dir = tmp_path / "runs" / "cg"
    job = submit(lab, sites, "cg", run_dir)
    rec = lab.wait_done(job, timeout=180)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{logs(run_dir)}"
    seen = json.loads((run_dir / "resources.json").read_text())
    store = int(2500 * MIB * 0.3)
    for host, res in seen["nodes"].items():
        assert res["CPU"] == 1.0, (host, res)
        assert res["memory"] == 2500 * MIB - store and res["object_store_memory"] == store, (host, res)
    state = [json.loads(line) for line in (run_dir / "state.jsonl").read_text().splitlines()]
    (head,) = [r["allocation"] for r in state if r["event"] == "ray_resources"]
    assert head["sources"]["memory"].endswith(f"hpcrl-alloc-{job}-0/memory.limit_in_bytes"), head
    assert head["sources"]["cpus"].endswith(f"hpcrl-alloc-{job}-0/cpuset.effective_cpus"), head
