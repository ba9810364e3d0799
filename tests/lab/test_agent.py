"""The node agent on the real lab: `hpcrl submit`/`hpcrl render | sbatch` bring up a Ray cluster
across the 3 Slurm nodes (bare, in Podman, in Apptainer; IPv4 and IPv6-only), the payload runs one
Ray task on every node, every profile variable arrives on every node, two jobs share the nodes,
a killed worker ends the job, and a driver without the token is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.agent.ports import PortRange, first_index, site_port_range
from tests.conftest import REPO, run_hpcrl

pytestmark = [pytest.mark.lab, pytest.mark.slow]
PROBE = REPO / "tests" / "payloads" / "cluster_probe.py"
PROFILE_VARS = {"HPCRL_LAB_MARKER", "HPCRL_LAB_QUOTING", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED"}


def write_site(sites: Path, name: str, base: str, run_root: Path, extra: str = "") -> None:
    """A test profile extending the lab's: PROBE_ENV names every variable of the profile."""
    from hpcrl.profile_load import load_profile

    env = load_profile(base, dict(os.environ)).profile.env
    names = ",".join(sorted([*env, "PROBE_SECRET", "PROBE_ENV"]))
    sites.mkdir(exist_ok=True)
    (sites / f"{name}.yaml").write_text(
        f"extends: {base}\nrun_root: {run_root}\nsecrets: [PROBE_SECRET]\n"
        f"env:\n  PROBE_ENV: {json.dumps(names)}\n{extra}"
    )


@pytest.fixture
def sites(tmp_path: Path) -> Path:
    d = tmp_path / "sites"
    write_site(d, "lab-podman", "slurmlab", tmp_path / "runs")
    write_site(d, "lab-apptainer", "slurmlab-apptainer", tmp_path / "runs")
    write_site(d, "lab-bare", "slurmlab", tmp_path / "runs", "container:\n  runtime: none\n")
    write_site(d, "lab-small", "slurmlab", tmp_path / "runs",
               "container:\n  runtime: none\nslurm:\n  cpus_per_task: 1\n")
    return d


def submit(lab, sites: Path, site: str, run_dir: Path, *, via: str = "sbatch",
           env: dict[str, str] | None = None, payload: list[str] | None = None) -> int:
    full = {**lab.env, "HPCRL_SITE_PATH": str(sites), "PROBE_SECRET": "s3cr3t $(x)", **(env or {})}
    argv = payload or [sys.executable, str(PROBE)]
    proc = run_hpcrl(["submit", "--site", site, "--via", via, "--run-dir", str(run_dir),
                      "--command", "--", *argv], full)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split("job id: ")[1].split()[0])


def run_logs(run_dir: Path) -> str:
    parts = []
    for f in sorted(run_dir.rglob("*")):
        if f.is_file() and f.suffix in (".out", ".log") and f.stat().st_size:
            parts.append(f"==> {f} <==\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def finished(lab, job: int, run_dir: Path, timeout: float = 180) -> dict[str, str]:
    try:
        return lab.wait_done(job, timeout=timeout)
    except Exception as e:
        raise AssertionError(f"{e}\n\nrun directory logs:\n{run_logs(run_dir)}") from None


def check_probe(lab, run_dir: Path, container: str, ipv6: bool = False) -> dict:
    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["alive"] == 3, probe
    assert sorted(t["hostname"] for t in probe["tasks"]) == ["node1", "node2", "node3"], probe
    assert {t["container"] for t in probe["tasks"]} == {container}, probe
    profile_env = json.loads((run_dir / "job.json").read_text())["profile"]["env"]
    assert PROFILE_VARS <= set(profile_env), profile_env
    for task in [*probe["tasks"], probe["driver"]]:
        for name, value in profile_env.items():
            assert task["env"].get(name) == value, (task.get("hostname"), name)
        assert task["env"]["PROBE_SECRET"] == "s3cr3t $(x)"
    head = lab.cfg.compute[0]
    if ipv6:
        assert probe["address"].startswith(f"[{head.ipv6}]:"), probe["address"]
        assert probe["driver"]["MASTER_ADDR"] == head.ipv6
    else:
        assert probe["address"].startswith(f"{head.ipv4}:"), probe["address"]
    secret_free = [f for f in run_dir.rglob("*") if f.is_file() and b"s3cr3t" in f.read_bytes()]
    assert [f for f in secret_free if f.name != "probe.json"] == [], "the secret was written to a file"
    return probe


def lab_ray_processes(lab) -> list[str]:
    """Ray processes still alive in any lab node's namespaces."""
    from tests.lab.cluster import lab_pids

    found = []
    for pid in lab_pids(lab.paths):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(k in cmd for k in ("raylet", "gcs_server", "ray.scripts", "default_worker", "cluster_probe")):
            found.append(f"{pid}: {cmd[:150]}")
    return found


def lab_containers() -> list[str]:
    from tests.lab.cluster import lab_containers

    return lab_containers()


# ------------------------------------------------------------------ issue 3 + 4: 3 nodes


@pytest.mark.containers
@pytest.mark.parametrize(("site", "via", "container"), [
    ("lab-bare", "sbatch", "none"),
    ("lab-podman", "sbatch", "podman"),
    ("lab-podman", "submitit", "podman"),
    ("lab-apptainer", "sbatch", "apptainer"),
    ("lab-apptainer", "submitit", "apptainer"),
])
def test_ray_on_every_node_with_every_profile_variable(lab, lab_images, sites, tmp_path, site, via, container):
    run_dir = tmp_path / "runs" / f"{site}-{via}"
    job = submit(lab, sites, site, run_dir, via=via)
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
    check_probe(lab, run_dir, container)
    summary = (run_dir / "0" / "summary.txt").read_text()
    assert summary.count("node") >= 3, summary
    # every agent started in the run directory (`--chdir`), with `python -P`, in a private temp dir
    for rank, host in enumerate(("node1", "node2", "node3")):
        log = (run_dir / "0" / "logs" / f"agent-{rank}-{host}.log").read_text()
        assert re.search(rf"working directory {re.escape(str(run_dir))}, safe_path True \(python "
                         rf"-P\), private temp dir /\S+/hr-{job}-0-{rank}-[A-Za-z0-9_]{{8}}\n", log), log
    assert lab_ray_processes(lab) == []
    assert lab_containers() == []


def test_ipv6_only_lab(lab_manager, sites, tmp_path):
    lab = lab_manager.get(ipv6_only=True)
    run_dir = tmp_path / "runs" / "v6"
    job = submit(lab, sites, "lab-bare", run_dir)
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
    check_probe(lab, run_dir, "none", ipv6=True)
    assert lab_ray_processes(lab) == []


HOLD_PORTS = """
import socket, sys, time
socks = []
for port in map(int, sys.argv[1:]):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past an earlier job's TIME_WAIT
    s.bind(("0.0.0.0", port))
    s.listen()
    socks.append(s)
print("ready", flush=True)
time.sleep(600)
"""


def test_two_jobs_share_the_nodes(lab, sites, tmp_path):
    """Two jobs starting at once on the same nodes, the first one's port block taken on the head
    node: it moves onto the second one's block, and the second must not take it too (the race
    that made a Ray head fail to bind)."""
    from tests.lab.cluster import NETNS_PREFIX

    held = subprocess.run(["sbatch", "--parsable", "--hold", "--wrap", "true"], env=lab.env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    probe_id = int(held.stdout.strip().split(";")[0])
    subprocess.run(["scancel", str(probe_id)], env=lab.env, check=True)
    expected = probe_id + 1  # the first job of the pair, if nothing else submits meanwhile
    gcs_port = PortRange().base + first_index(str(expected), 0, PortRange()) * PortRange().block_size
    holder = subprocess.Popen(["nsenter", f"--net=/run/netns/{NETNS_PREFIX}node1", sys.executable, "-c",
                               HOLD_PORTS, str(gcs_port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    runs = [tmp_path / "runs" / f"pair{i}" for i in (1, 2)]
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        jobs = [submit(lab, sites, "lab-small", r, payload=["/usr/bin/env", "PROBE_SLEEP=5", sys.executable, str(PROBE)])
                for r in runs]
        assert jobs[0] == expected, (jobs, expected)
        for job in jobs:
            lab.wait_state(job, {"RUNNING", "COMPLETED"}, timeout=30)
        assert all(lab.state(j) in ("RUNNING", "COMPLETED") for j in jobs), "both jobs must run at once"
        for job, run_dir in zip(jobs, runs, strict=True):
            rec = finished(lab, job, run_dir)
            assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
            check_probe(lab, run_dir, "none")
    finally:
        holder.kill()
        holder.wait()
    ports = [json.loads((r / "0" / "rendezvous.json").read_text())["ports"]["gcs"] for r in runs]
    assert ports[0] != gcs_port and ports[0] != ports[1], (ports, gcs_port)
    head_log = (runs[0] / "0" / "logs" / "agent-0-node1.log").read_text()
    assert f"port {gcs_port} is held by pid {holder.pid} (" in head_log, head_log
    assert lab_ray_processes(lab) == []


def test_killed_worker_ends_the_job_fast_and_cleanly(lab, sites, tmp_path):
    run_dir = tmp_path / "runs" / "kill"
    # the payload sleeps after writing probe.json, so that only the killed worker can end the job
    # (a submit-time variable would not reach it: the job gets the profile's env and secrets)
    job = submit(lab, sites, "lab-bare", run_dir,
                 payload=["/usr/bin/env", "PROBE_SLEEP=300", sys.executable, str(PROBE)])
    deadline = time.monotonic() + 120
    while not (run_dir / "probe.json").exists():
        assert time.monotonic() < deadline, run_logs(run_dir)
        time.sleep(0.2)
    node = json.loads((run_dir / "0" / "nodes" / "2.json").read_text())
    victim = node["ray_pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    rec = finished(lab, job, run_dir, timeout=60)
    elapsed = time.monotonic() - t0
    assert rec["JobState"] in ("FAILED", "CANCELLED"), rec
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end after the worker died"
    head_log = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*-node0.out"))
    assert "node3" in head_log and "rank 2" in head_log, head_log[-2000:]
    time.sleep(1)
    assert lab_ray_processes(lab) == []


def test_driver_without_token_is_refused(lab, sites, tmp_path):
    probe = (
        "import os, subprocess, sys\n"
        "env = {k: v for k, v in os.environ.items() if not k.startswith('RAY_AUTH')}\n"
        "env['RAY_AUTH_MODE'] = 'disabled'\n"
        "code = 'import ray, sys\\ntry:\\n    ray.init(address=%r, log_to_driver=False)\\n"
        "except Exception as e:\\n    print(\"REFUSED\", type(e).__name__); sys.exit(0)\\n"
        "print(\"ACCEPTED\"); sys.exit(1)' % os.environ['RAY_ADDRESS']\n"
        "r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=150)\n"
        "open(os.path.join(os.environ['HPCRL_RUN_DIR'], 'refusal.txt'), 'w').write(r.stdout + r.stderr[-2000:])\n"
        "sys.exit(r.returncode)\n"
    )
    script = tmp_path / "refusal.py"
    script.write_text(probe)
    run_dir = tmp_path / "runs" / "token"
    job = submit(lab, sites, "lab-bare", run_dir, payload=[sys.executable, str(script)])
    rec = finished(lab, job, run_dir, timeout=240)
    out = (run_dir / "refusal.txt").read_text()
    assert rec["JobState"] == "COMPLETED" and "REFUSED" in out, f"{rec}\n{out}\n{run_logs(run_dir)}"


def test_render_then_plain_sbatch(lab, sites, tmp_path):
    """`hpcrl render ... > job.sbatch && sbatch job.sbatch`: the same job through plain Slurm."""
    run_dir = tmp_path / "runs" / "rendered"
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites), "PROBE_SECRET": "s3cr3t $(x)"}
    proc = run_hpcrl(["render", "--site", "lab-bare", "--run-dir", str(run_dir), "--command", "--",
                      sys.executable, str(PROBE)], env)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(proc.stdout)
    res = subprocess.run(["sbatch", "--parsable", "--export=PROBE_SECRET", str(script)],
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    job = int(res.stdout.strip().split(";")[0])
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
    check_probe(lab, run_dir, "none")


def test_missing_image_fails_fast_naming_node_and_image(lab, lab_images, sites, tmp_path):
    """A container image the nodes cannot open ends the job within seconds with the node and
    the image named, instead of a wait for Ray nodes that never join."""
    missing = tmp_path / "not-here.sif"
    write_site(sites, "lab-noimage", "slurmlab-apptainer", tmp_path / "runs",
               f"container:\n  image: {missing}\n")
    run_dir = tmp_path / "runs" / "noimage"
    t0 = time.monotonic()
    job = submit(lab, sites, "lab-noimage", run_dir)
    rec = finished(lab, job, run_dir, timeout=90)
    elapsed = time.monotonic() - t0
    assert rec["JobState"] == "FAILED", rec
    assert elapsed < 30, f"the job took {elapsed:.1f} s to fail"
    logs = run_logs(run_dir)
    assert f"the container image `{missing}` does not exist on this node" in logs, logs
    assert any(f"node {n}: " in logs for n in ("node1", "node2", "node3")), logs
    assert not (run_dir / "probe.json").exists()




@pytest.mark.parametrize("free_blocks", [0, 1])
def test_taken_port_blocks_move_the_job_or_fail_it_naming_the_holder(lab, sites, tmp_path, free_blocks):
    """Another process holding the job's Ray ports on the head node: the agent moves to a free
    block (logging which port and which process), or, with none free, fails within seconds
    naming the port and the process."""
    from tests.lab.cluster import NETNS_PREFIX

    # above Linux's ephemeral ports (to 60999) and the default range (20000..32768) that every
    # other lab job uses: a port an earlier test's job still holds cannot fall in these blocks
    base = 61000
    rng = site_port_range(base)
    blocks, size = rng.blocks, rng.block_size
    write_site(sites, "lab-ports", "slurmlab", tmp_path / "runs",
               f"container:\n  runtime: none\nray:\n  port_base: {base}\n")
    held = [base + i * size for i in range(free_blocks, blocks)]  # each block's GCS port
    holder = subprocess.Popen(["nsenter", f"--net=/run/netns/{NETNS_PREFIX}node1", sys.executable, "-c",
                               HOLD_PORTS, *map(str, held)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stderr is not None
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        run_dir = tmp_path / "runs" / "ports"
        t0 = time.monotonic()
        job = submit(lab, sites, "lab-ports", run_dir)
        rec = finished(lab, job, run_dir, timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    logs = "\n".join(f.read_text() for f in sorted(run_dir.rglob("*.log")))  # whole files
    if free_blocks == 0:
        assert rec["JobState"] == "FAILED", rec
        assert elapsed < 30, f"the job took {elapsed:.1f} s to fail"
        assert f"every one of the {blocks} port blocks" in logs, logs
        assert f"is held by pid {holder.pid} (" in logs, logs
        return
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{logs}"
    assert json.loads((run_dir / "0" / "rendezvous.json").read_text())["ports"]["gcs"] == base
    if first_index(str(job), 0, rng) != 0:  # moved
        assert "is taken here (port" in logs and f"is held by pid {holder.pid} (" in logs, logs


# ------------------------------------------------------------------ issue 35: `hpcrl sites new`


@pytest.mark.containers
def test_sites_new_profile_runs_a_job_unchanged(lab, lab_images, tmp_path):
    """A new site's first day on the lab: `hpcrl sites new` against the lab's Slurm (no terminal:
    defaults and notes); `hpcrl submit` with the profile as written (Ray on all 3 nodes in
    Podman), which suggests the doctor. The doctor's own pass, and its record, on such a profile
    from a login node's light install: `tests/lab/test_quickstart.py`."""
    env = {**lab.env, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_STATE_HOME": str(tmp_path / "state")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpcrl", "sites", "new", "labnew", "--extends", "slurmlab"],
                          env={**env, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = (tmp_path / "cfg" / "hpcrl" / "sites" / "labnew.yaml").read_text()
    for line in ['  partition: "debug"  # scontrol show partition: PartitionName=debug Default=YES',
                 "  cpus_per_task: 2  # scontrol show node: CPUTot=2", '  mem: "4000M"',
                 "  gpus_per_node: 0  # scontrol show node: Gres=(null)", '  runtime: "podman"  # on PATH: ']:
        assert line in written, written
    assert "hpcrl doctor --site labnew" in proc.stdout
    run_dir = tmp_path / "runs" / "new"
    sub = run_hpcrl(["submit", "--site", "labnew", "--via", "sbatch", "--run-dir", str(run_dir),
                     "--command", "--", sys.executable, str(PROBE)], env)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    rec = finished(lab, int(sub.stdout.split("job id: ")[1].split()[0]), run_dir)
    assert rec["JobState"] == "COMPLETED", f"{rec}\n{run_logs(run_dir)}"
    probe = json.loads((run_dir / "probe.json").read_text())
    assert sorted(t["hostname"] for t in probe["tasks"]) == ["node1", "node2", "node3"], probe
    assert {t["container"] for t in probe["tasks"]} == {"podman"}, probe
    assert "`hpcrl doctor --site labnew` has never passed here" in sub.stderr
    print(f"sites new + submit + job on the lab: {time.monotonic() - t0:.1f} s")

