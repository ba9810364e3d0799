"""Ray cluster bring-up on the Slurm lab: hpcrl's node agent against the seed scripts' sleeps.

For N = 2, 3, 4 nodes, time from job start (the batch script's first command, after the
`#SBATCH` lines) to "all N nodes joined":

- hpcrl: a job rendered by `hpcrl render` (profile extending `slurmlab`, `container.runtime:
  none`, payload `true`) and submitted with plain `sbatch`; "joined" is the head agent's log line
  "all N nodes joined".
- seed: the seeds' Slurm recipe as a batch script: `srun hostname --ip-address` on the head,
  `srun ray start --head --port=P --block &`, `sleep 10`, then per worker `srun ray start
  --address=HEAD:P --block &` and `sleep 5`; "joined" is the moment it would start the payload,
  after its last sleep. A check run right then asks the GCS which nodes are alive and when each
  registered, so a seed run whose nodes were not all up by then is reported, not hidden.
  Changes the lab forces: the head address is the node's IPv4 address (the seeds' length test
  keeps `hostname --ip-address`'s first word, an IPv6 address here, which Ray rejects as
  `v6:port`); every Ray node gets its own `--temp-dir` (lab nodes share one /tmp), the fixed
  ports are moved off Ray's defaults so that nothing meets another cluster, and
  `RAY_AUTH_MODE=disabled` keeps the seeds' no-auth set-up even where `~/.ray/auth_token` exists.
- floor: one `ray start --head` on its own in a 1-node job, with the agent's head flags (no
  dashboard, pinned ports, token auth): from the script's first command to its return.

The three kinds run interleaved in every round, so load changes hit all alike. Prints medians,
ratios, the load average, and where hpcrl's time goes (from the agents' log timestamps). Needs
root (the lab).

    HPCRL_LAB_INSTANCE=3 .venv/bin/python -m bench.agent_bringup_lab [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hpcrl.agent.ports import PortRange, block_at
from hpcrl.agent.procs import kill_all, processes_mentioning
from tests.lab import Lab, LabConfig

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
NODE_COUNTS = (2, 3, 4)
JOB_ID_BASE = 700_000
SEED_PORTS = {  # the seeds' 6379 and 8266 and Ray's fixed defaults, moved aside (below Ray's
    "port": 6479,  # default worker port range, 10002-19999)
    "dashboard-port": 8366,
    "ray-client-server-port": 9001,
    "dashboard-agent-listen-port": 9002,
}
STAMP = 'printf "%s\\n" "$EPOCHREALTIME" > '

VERIFY = r"""
import json, sys, time
import ray
from ray._raylet import GcsClient
address, want, joined_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
asked_at = time.time()
registered, alive, error = [], 0, ""
try:
    infos = GcsClient(address=address).get_all_node_info(timeout=10).values()
    registered = sorted(i.start_time_ms / 1000 for i in infos if i.state == 0)
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    ray.shutdown()
except Exception as e:
    error = type(e).__name__ + ": " + str(e)[:200]
print(json.dumps({"want": want, "alive_ray_nodes": alive, "registered": registered,
                  "alive_at_joined": sum(1 for t in registered if t <= joined_at),
                  "asked_after_s": asked_at - joined_at, "error": error}))
"""


@dataclass
class Run:
    """One timed job."""

    kind: str
    nodes: int
    seconds: float
    load: float
    phases: dict[str, float] = field(default_factory=dict)
    note: str = ""


def insert_after_sbatch_lines(script: str, line: str) -> str:
    """`line` as the script's first command: after the shebang and `#SBATCH` block (sbatch stops
    reading directives at the first command)."""
    lines = script.splitlines()
    at = 1 + max(i for i, text in enumerate(lines) if text.startswith(("#!", "#SBATCH ")))
    return "\n".join([*lines[:at], line, *lines[at:]]) + "\n"


def read_stamp(path: Path) -> float:
    return float(path.read_text().strip())


def log_time(line: str) -> float:
    """Epoch seconds of a `logging` asctime at the start of an agent log line."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def sweep(marker: str) -> int:
    """Kill processes of a finished run still alive (found by its unique temp-dir name)."""
    pids = processes_mentioning(marker)
    if pids:
        kill_all(pids)
    return len(pids)


def wait_finished(lab: Lab, job: int, what: str, out: Path) -> None:
    rec = lab.wait_done(job, timeout=240)
    if rec.get("JobState") != "COMPLETED":
        logs = "\n".join(f"==> {p} <==\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(out.rglob("*.out")) + sorted(out.rglob("agent-*.log")))  # fmt: skip
        raise SystemExit(f"{what} job {job} ended {rec.get('JobState')}\n{logs}")


# --- hpcrl --------------------------------------------------------------------------------------


def hpcrl_phases(run_dir: Path, start: float, n: int) -> tuple[float, dict[str, float]]:
    """Seconds from `start` to the head's "all N nodes joined", and the steps on the way."""
    logs = run_dir / "0" / "logs"
    phases: dict[str, float] = {}
    joined = None
    for path in sorted(logs.glob("agent-*.log")):
        rank = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            at = log_time(line) - start
            if rank == 0 and "head address" in line:
                phases["published"] = at
            elif "head node alive in the GCS" in line:
                phases["head alive (go)"] = at
            elif "starting Ray head" in line:
                phases["head ray start"] = at
            elif "starting Ray worker" in line:
                phases[f"worker {rank} ray start"] = at
            elif m := re.search(r"\] (\d+)/\d+ nodes joined", line):
                phases.setdefault(f"{m.group(1)}/{n} joined", at)
            elif f"all {n} nodes joined" in line:
                joined = at
    if joined is None:
        raise SystemExit(f"no `all {n} nodes joined` line in {logs}")
    return joined, phases


def run_hpcrl(
    lab: Lab, root: Path, sites: Path, n: int, tag: str, tree: Path = REPO, kind: str = "hpcrl"
) -> Run:
    """hpcrl's job, with hpcrl from source tree `tree` (the profile binds and imports it)."""
    run_dir = root / f"{kind}-{tag}"
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites), "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [PYTHON, "-m", "hpcrl", "render", "--site", "bench-bare", "--nodes", str(n),
         "--run-dir", str(run_dir), "--command", "--", "true"],
        env=env, cwd=tree, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"`hpcrl render` failed: {proc.stderr}")
    script = insert_after_sbatch_lines(proc.stdout, STAMP + str(run_dir / "bench-start"))
    load = os.getloadavg()[0]
    job = lab.sbatch(script)
    wait_finished(lab, job, "hpcrl", run_dir)
    start = read_stamp(run_dir / "bench-start")
    joined, phases = hpcrl_phases(run_dir, start, n)
    return Run(kind, n, joined, load, phases)


# --- the seed's recipe --------------------------------------------------------------------------


def temp_name(out: Path) -> str:
    """A Ray temp dir name unique to this benchmark run and job (also the sweep's marker)."""
    return f"/tmp/{out.parent.name}-{out.name}"


def seed_script(n: int, out: Path, payload: str | None = None) -> str:
    """The seed recipe for `n` nodes; after its sleeps it checks which nodes joined, or runs
    `payload` (a shell command line, given `RAY_ADDRESS`) in its place."""
    venv_bin = Path(PYTHON).parent
    check = (f"RAY_ADDRESS=$ip_head {payload}" if payload else
             f"python -c '{VERIFY}' \"$ip_head\" \"$SLURM_JOB_NUM_NODES\" "
             f"\"$(cat {out}/bench-joined)\" > {out}/verify.json")
    tmp = temp_name(out)
    ports = " ".join(f"--{k}={v}" for k, v in SEED_PORTS.items() if k != "port")
    return f"""#!/bin/bash
#SBATCH --job-name=seed-bench
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --partition=debug
#SBATCH --time=00:10:00
#SBATCH --output={out}/slurm-%j.out
{STAMP}{out}/bench-start
export PATH={venv_bin}:$PATH
export RAY_USAGE_STATS_ENABLED=0
# the seeds run without auth; a token file in ~/.ray would turn it on for the head alone
export RAY_AUTH_MODE=disabled

nodes_array=($(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' '))
head_node=${{nodes_array[0]}}
head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)
# the seeds keep the first word when it is short; that is IPv6 here, which Ray cannot take as
# `v6:port`: keep the IPv4 address, as the seeds intend
for word in $head_node_ip; do
    [[ $word == *.* ]] && head_node_ip=$word
done
port={SEED_PORTS["port"]}
ip_head=$head_node_ip:$port
echo "IP Head: $ip_head"

srun --nodes=1 --ntasks=1 -w "$head_node" \\
    ray start --head --node-ip-address="$head_node_ip" --port=$port {ports} \\
    --temp-dir={tmp}-0 --num-cpus "$SLURM_CPUS_PER_TASK" --num-gpus 0 --block &
steps=($!)
sleep 10

worker_num=$((SLURM_JOB_NUM_NODES - 1))
for ((i = 1; i <= worker_num; i++)); do
    node_i=${{nodes_array[$i]}}
    srun --nodes=1 --ntasks=1 -w "$node_i" \\
        ray start --address "$ip_head" --temp-dir={tmp}-$i \\
        --num-cpus "$SLURM_CPUS_PER_TASK" --num-gpus 0 --block &
    steps+=($!)
    sleep 5
done
{STAMP}{out}/bench-joined

{check}
kill -TERM "${{steps[@]}}"
wait
"""


def run_seed(lab: Lab, root: Path, n: int, tag: str) -> Run:
    out = root / f"seed-{tag}"
    out.mkdir()
    load = os.getloadavg()[0]
    job = lab.sbatch(seed_script(n, out))
    try:
        wait_finished(lab, job, "seed", out)
    finally:
        time.sleep(0.5)
        left = sweep(temp_name(out))
        for tmp in Path("/tmp").glob(Path(temp_name(out)).name + "-*"):  # one per node
            shutil.rmtree(tmp, ignore_errors=True)
    start, joined = read_stamp(out / "bench-start"), read_stamp(out / "bench-joined")
    check = json.loads((out / "verify.json").read_text())
    note = ""
    if check["alive_at_joined"] < n or check["alive_ray_nodes"] < n:
        note = (f"only {check['alive_at_joined']}/{n} nodes registered when the payload would start "
                f"({check['alive_ray_nodes']} alive {check['asked_after_s']:.1f} s later)"
                f"{'; ' + check['error'] if check['error'] else ''}")  # fmt: skip
    if left:
        note += f" {left} Ray processes outlived the job"
    last = max(check["registered"]) - start if check["registered"] else float("nan")
    return Run("seed", n, joined - start, load, {"last node registered": last}, note.strip())


# --- floor: one `ray start --head` ---------------------------------------------------------------


def run_floor(lab: Lab, root: Path, tag: str) -> Run:
    out = root / f"floor-{tag}"
    out.mkdir()
    token = out / "token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    ports = block_at(PortRange(), 3)
    tmp = temp_name(out)
    args = " ".join(ports.ray_start_args(head=True, dashboard=False))
    env = " ".join(f"{k}={v}" for k, v in ports.env().items())
    head_ip = lab.cfg.compute[0].ipv4
    script = f"""#!/bin/bash
#SBATCH --job-name=floor-bench
#SBATCH --nodes=1
#SBATCH --cpus-per-task=2
#SBATCH --partition=debug
#SBATCH --output={out}/slurm-%j.out
{STAMP}{out}/bench-start
env RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token} RAY_USAGE_STATS_ENABLED=0 {env} \\
    {PYTHON} -m ray.scripts.scripts start --head --node-ip-address={head_ip} --temp-dir={tmp} \\
    --disable-usage-stats --include-dashboard=false {args}
code=$?
{STAMP}{out}/bench-joined
exit $code
"""
    load = os.getloadavg()[0]
    job = lab.sbatch(script)
    try:
        wait_finished(lab, job, "floor", out)
    finally:
        time.sleep(0.5)
        sweep(tmp)  # `ray start` without --block leaves its daemons running: end them by pid
        subprocess.run(["rm", "-rf", tmp], check=False)
    return Run("floor", 1, read_stamp(out / "bench-joined") - read_stamp(out / "bench-start"), load)


# --- report -------------------------------------------------------------------------------------


def med(runs: list[Run], kind: str, n: int | None = None) -> float:
    return statistics.median(
        r.seconds for r in runs if r.kind == kind and (n is None or r.nodes == n)
    )


def report(runs: list[Run], repeat: int) -> None:
    floor = med(runs, "floor")
    loads = [r.load for r in runs]
    base = any(r.kind == "base" for r in runs)
    print(f"\nmedian of {repeat}; job start = batch script's first command; load average (1 min) "
          f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}) on "
          f"{os.cpu_count()} cores")  # fmt: skip
    extra = " hpcrl baseline tree s |" if base else ""
    print(
        f"| N | hpcrl s | seed s | ratio hpcrl/seed | `ray start --head` floor s | hpcrl - floor s |{extra}"
    )
    print("| --- " * (7 if base else 6) + "|")
    for n in NODE_COUNTS:
        h, s = med(runs, "hpcrl", n), med(runs, "seed", n)
        b = f" {med(runs, 'base', n):.2f} |" if base else ""
        print(f"| {n} | {h:.2f} | {s:.2f} | {h / s:.2f} | {floor:.2f} | {h - floor:+.2f} |{b}")
    print("\nall runs (phases: seconds from job start, from the agents' logs):")
    for r in runs:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items())
        print(f"  {r.kind:5s} N={r.nodes} {r.seconds:6.2f} s  load {r.load:.2f}  {phases}"
              f"{'  NOTE: ' + r.note if r.note else ''}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another source tree of hpcrl (e.g. `git archive` of an older "
                             "commit) whose agent runs in the same rounds, as `base`")  # fmt: skip
    args = parser.parse_args()
    # job ids of their own: agents name temp dirs after the job id, and other labs on this
    # machine (which number their jobs from 1) share /tmp
    cfg = LabConfig(nodes=4, extra={"FirstJobId": str(JOB_ID_BASE + os.getpid() % 1000 * 100)})
    lab = Lab.up(cfg)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hrb-") as d:
        root = Path(d)
        sites = root / "sites"
        sites.mkdir()
        (sites / "bench-bare.yaml").write_text(
            f"extends: slurmlab\nrun_root: {root}\ncontainer:\n  runtime: none\n"
        )
        jobs: dict[str, Callable[[int, str], Run]] = {
            "hpcrl": lambda n, tag: run_hpcrl(lab, root, sites, n, tag),
            "seed": lambda n, tag: run_seed(lab, root, n, tag),
        }
        if args.baseline_tree:
            tree = args.baseline_tree.resolve()
            jobs["base"] = lambda n, tag: run_hpcrl(lab, root, sites, n, tag, tree, "base")
        for i in range(args.repeat):
            runs.append(run_floor(lab, root, f"{i}"))
            for n in NODE_COUNTS:
                order = list(jobs) if i % 2 == 0 else list(reversed(jobs))
                for kind in order:  # interleaved, the order flipped every round
                    runs.append(jobs[kind](n, f"{i}-{n}"))
                    print(f"round {i + 1}: {kind:5s} N={n} {runs[-1].seconds:6.2f} s", flush=True)
    report(runs, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
