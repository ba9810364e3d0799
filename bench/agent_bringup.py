"""Bring-up time of the node agent against plain `ray start --head`, measured in the same run.

Single node (this machine, no Slurm): time from launching `python -m hpcrl.agent RUN_DIR` to
its "1/1 nodes joined" line, against the time one `ray start --head` with the same isolation
flags takes to return. Prints the medians and the ratio. Multi-node figures (N = 2, 3, 4, against
the seed script's sleeps) need the Slurm lab and are measured there.

    python bench/agent_bringup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl.agent.ports import PortRange, find_free_block  # noqa: E402
from hpcrl.netaddr import NetworkPolicy, choose_address, local_addresses  # noqa: E402

SEED_SLEEP_S = 10.0  # the seed script sleeps 10 s after the head, then 5 s per worker


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "HPCRL_"))}


def time_agent(root: Path, name: str) -> float:
    run = root / name
    run.mkdir()
    job = {
        "version": 1,
        "nodes": 1,
        "payload": ["true"],
        "profile": {"container": {"runtime": "none"}},
    }
    (run / "job.json").write_text(json.dumps(job))
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.agent", str(run)],
        cwd=REPO,
        env={**clean_env(), "HPCRL_JOB_ID": name},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    joined = None
    assert proc.stderr is not None
    for line in proc.stderr:
        if joined is None and re.search(r"\b1/1 nodes joined", line):
            joined = time.monotonic() - start
    proc.wait()
    if joined is None or proc.returncode != 0:
        raise SystemExit(f"agent run {name} failed (exit {proc.returncode}); see {run}/0/logs")
    return joined


def time_plain_head(root: Path, name: str) -> float:
    """One `ray start --head` (returns once the head is up), same ports/temp-dir isolation."""
    addr = choose_address(local_addresses(), NetworkPolicy())
    ports = find_free_block(PortRange(), 7)
    tmp = Path(f"/tmp/hb-{name}")
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        f"--node-ip-address={addr.address}",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
        "--include-dashboard=false",
        *ports.ray_start_args(head=True, dashboard=False),
    ]
    token = root / f"{name}.token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    env = {
        **clean_env(),
        **ports.env(),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    code = proc.wait()
    took = time.monotonic() - start
    os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes stay in this session's group
    time.sleep(0.5)
    subprocess.run(["rm", "-rf", str(tmp)], check=False)
    if code != 0:
        raise SystemExit(f"plain `ray start --head` failed with exit {code}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    agent, plain = [], []
    with tempfile.TemporaryDirectory(prefix="hr-bench-") as d:
        root = Path(d)
        for i in range(args.repeat):  # interleaved, so load changes hit both alike
            plain.append(time_plain_head(root, f"p{os.getpid()}{i}"))
            agent.append(time_agent(root, f"b{os.getpid()}{i}"))
    a, p = statistics.median(agent), statistics.median(plain)
    print(f"single node, {args.repeat} runs each (median):")
    times_p = ", ".join(f"{x:.2f}" for x in plain)
    times_a = ", ".join(f"{x:.2f}" for x in agent)
    print(f"  plain `ray start --head`           {p:6.2f} s   [{times_p}]")
    print(f"  hpcrl agent start -> 1/1 joined    {a:6.2f} s   [{times_a}]")
    print(f"  ratio agent / plain head           {a / p:6.2f}   (agent overhead {a - p:+.2f} s)")
    print(
        f"  seed script, one node: sleeps {SEED_SLEEP_S:.0f} s beside the head start; ratio "
        f"agent / seed {a / max(SEED_SLEEP_S, p):.2f} (it goes on after 10 s even if the head is not up)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
