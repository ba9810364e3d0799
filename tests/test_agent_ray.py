"""The node agent with real Ray on this machine: local jobs and a two-agent job on one host."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "ray", reason="the agent tests start real Ray clusters (`pip install hpcrl[train]`)"
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = REPO / "tests" / "payloads" / "ray_task.py"


def make_run(
    root: Path, name: str, env: dict[str, str], nodes: int = 1, agent: dict | None = None
) -> Path:
    run = root / name
    run.mkdir()
    job = {
        "version": 1,
        "site": "local",
        "nodes": nodes,
        "max_requeues": 0,
        "profile": {
            "network": {"interface": None, "family": "auto"},
            "ray": {"dashboard": False},
            "container": {"runtime": "none"},
            "env": env,
        },
        "payload": [sys.executable, str(PAYLOAD)],
        "agent": agent or {},
    }
    (run / "job.json").write_text(json.dumps(job))
    return run


def start_agent(run: Path, env: dict[str, str]) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "HPCRL_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.agent", str(run)],
        cwd=REPO,
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"`{text}` did not appear in {path} within {timeout} s")


def sessions_alive(sids: set[int]) -> list[str]:
    """Processes still in one of the sessions `sids` (a Ray node's whole process tree)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) in sids:
                out.append(f"{entry.name}: {cmd.decode(errors='replace')}")
    return out


def leftovers(run: Path, ranks: tuple[int, ...] = (0,)) -> list[str]:
    """Processes of the run's Ray nodes still alive, and temp dirs of `ranks` not removed."""
    nodes = [json.loads(p.read_text()) for p in (run / "0" / "nodes").glob("*.json")]
    sids = {n["ray_pid"] for n in nodes if n.get("ray_pid")}
    assert sids, "node files name the Ray process"
    dirs = [f"temp dir {p}" for r in ranks for p in Path("/tmp").glob(f"hr-{run.name}-*-{r}")]
    return sessions_alive(sids) + dirs


@pytest.fixture(scope="module")
def two_local_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two local jobs at once: A checks token refusal and exits 3, B waits for SIGUSR1."""
    root = tmp_path_factory.mktemp("agents")
    run_a = make_run(root, f"ja{os.getpid()}", {"PAYLOAD_EXIT": "3", "PAYLOAD_CHECK_REFUSAL": "1"})
    run_b = make_run(root, f"jb{os.getpid()}", {"PAYLOAD_WAIT_USR1": "1"})
    a = start_agent(run_a, {"HPCRL_JOB_ID": run_a.name})
    b = start_agent(run_b, {"HPCRL_JOB_ID": run_b.name})
    wait_for_text(run_b / "0" / "logs" / "payload.log", "waiting for SIGUSR1", 120)
    b.send_signal(signal.SIGUSR1)
    out_b, _ = b.communicate(timeout=60)
    out_a, _ = a.communicate(timeout=120)
    return {"a": (run_a, a.returncode, out_a), "b": (run_b, b.returncode, out_b)}


def test_exit_status_is_the_payloads(two_local_jobs: dict) -> None:
    run_a, code_a, out_a = two_local_jobs["a"]
    run_b, code_b, out_b = two_local_jobs["b"]
    assert code_a == 3, out_a
    assert code_b == 42, out_b  # SIGUSR1 reached the payload through the agent
    assert "forwarding SIGUSR1 to the payload" in out_b


def test_payload_connected_with_explicit_address_and_ran_a_task(two_local_jobs: dict) -> None:
    for run, _, out in two_local_jobs.values():
        log = (run / "0" / "logs" / "payload.log").read_text()
        assert "payload: 1 alive nodes" in log and "one task ran on each of 1 nodes" in log
        info = json.loads((run / "0" / "rendezvous.json").read_text())
        env_line = [ln for ln in log.splitlines() if "MASTER_ADDR=" in ln][0]
        assert f"MASTER_ADDR={info['address']}" in env_line
        assert "1/1 nodes joined" in out


def test_driver_without_token_is_refused(two_local_jobs: dict) -> None:
    run, _, _ = two_local_jobs["a"]
    log = (run / "0" / "logs" / "payload.log").read_text()
    assert "driver without token: refused: ConnectionError" in log


def test_jobs_use_disjoint_ports(two_local_jobs: dict) -> None:
    blocks = []
    for run, _, _ in two_local_jobs.values():
        info = json.loads((run / "0" / "rendezvous.json").read_text())
        ports = info["ports"]
        blocks.append(
            set(ports.values()) | set(range(ports["min_worker_port"], ports["max_worker_port"] + 1))
        )
    assert not blocks[0] & blocks[1]


def test_token_is_private_and_never_logged(two_local_jobs: dict) -> None:
    for run, _, out in two_local_jobs.values():
        token_path = run / "0" / "token"
        token = token_path.read_text()
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert token not in out
        for f in run.rglob("*"):
            if f.is_file() and f != token_path:
                assert token not in f.read_text(errors="replace"), f


def test_nothing_left_behind_and_summary_written(two_local_jobs: dict) -> None:
    for run, code, _ in two_local_jobs.values():
        assert leftovers(run) == []
        summary = (run / "0" / "summary.txt").read_text().splitlines()
        assert summary[0].startswith(f"job {run.name} restart 0: payload exited with status {code}")
        assert summary[1].startswith("node ") and "(rank 0)" in summary[1]
        assert (run / "0" / "logs" / f"ray-0-{os.uname().nodename}" / "raylet.out").exists()


def test_two_agent_job_survives_join_and_ends_fast_when_a_worker_dies(tmp_path: Path) -> None:
    """Two agents on this host as ranks 0 and 1 of one Slurm-like job; kill rank 1's agent."""
    run = make_run(tmp_path, f"9{os.getpid()}", {"PAYLOAD_SLEEP": "300"}, nodes=2)
    host = os.uname().nodename
    slurm = {
        "SLURM_JOB_ID": run.name,
        "SLURM_JOB_NODELIST": f"{host},{host}",
        "SLURM_JOB_NUM_NODES": "2",
    }
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
    assert "payload: 2 alive nodes" in (run / "0" / "logs" / "payload.log").read_text()
    time.sleep(1)  # the worker's Ray drains on its parent-death signal
    # the killed agent could not remove its temp dir; its next run on that node does
    assert leftovers(run, ranks=(0,)) == []
    assert len(list((run / "0" / "nodes").glob("*.json"))) == 2
    for stale in Path("/tmp").glob(f"hr-{run.name}-*-1"):
        shutil.rmtree(stale)
