"""Helpers for the tests that run the node agent with real Ray on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PAYLOAD = REPO / "tests" / "payloads" / "ray_task.py"


def make_run(
    root: Path,
    name: str,
    env: dict[str, str],
    nodes: int = 1,
    agent: dict | None = None,
    dashboard: bool = False,
    family: str = "auto",
    payload_start: str = "all-joined",
) -> Path:
    run = root / name
    run.mkdir()
    job = {
        "version": 1,
        "site": "local",
        "nodes": nodes,
        "max_requeues": 0,
        "profile": {
            "network": {"interface": None, "family": family},
            "ray": {"dashboard": dashboard},
            "container": {"runtime": "none"},
            "env": env,
            "agent": agent or {},
        },
        "payload": [sys.executable, str(PAYLOAD)],
        "payload_start": payload_start,
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
    dirs = [f"temp dir {p}" for r in ranks for p in Path("/tmp").glob(f"hr-{run.name}-*-{r}-*")]
    return sessions_alive(sids) + dirs
