"""Scaling of the distributed PPO trainer on the Slurm test lab (CPU): the same GRPO workload
on 1, 2 and 3 nodes (one rank per node, no container), submitted through the node agent with
`hpcrl submit --via sbatch`. Prints the median step time, tokens/s and the time per phase
(rollout, log-probs, actor update, weight sync), each against the 1-node run of the same
invocation. Needs root (the lab); uses lab instance `HPCRL_LAB_INSTANCE`.

    HPCRL_LAB_INSTANCE=N .venv/bin/python -m bench.distributed [--steps 6] [--nodes 1 2 3]

The lab's nodes share the machine's cores, so more nodes add communication without adding
compute: on this machine the curve measures the framework's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.lab import Lab, LabConfig

REPO = Path(__file__).resolve().parent.parent
PHASES = ("gen", "update_weights", "old_log_prob", "update_actor", "step")


def write_site(sites: Path, run_root: Path) -> None:
    sites.mkdir(parents=True, exist_ok=True)
    (sites / "bench-bare.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\nslurm:\n  time: '00:20:00'\ncontainer:\n  runtime: none\n")


def overrides(shared: Path, nodes: int, steps: int, response: int) -> list[str]:
    return [
        f"data.train_files={shared / 'data' / 'train.parquet'}", f"data.val_files={shared / 'data' / 'test.parquet'}",
        "data.max_prompt_length=16", f"data.max_response_length={response}",
        f"actor_rollout_ref.model.path={shared / 'model'}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=24", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=12", "trainer.val_before_train=false",
        "trainer.logger=jsonl", f"trainer.default_local_dir={shared / f'ppo-{nodes}'}",
        f"trainer.nnodes={nodes}", "trainer.n_gpus_per_node=1", "trainer.distributed=true",
        f"trainer.total_training_steps={steps}",
    ]


def submit(lab: Lab, sites: Path, run_dir: Path, nodes: int, args: list[str]) -> int:
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "hpcrl", "submit", "--site", "bench-bare", "--via", "sbatch",
                           "--run-dir", str(run_dir), "--nodes", str(nodes), "--", *args],
                          env=env, cwd=REPO, text=True, capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"submit failed: {proc.stdout}{proc.stderr}")
    return int(proc.stdout.split("job id: ")[1].split()[0])


def measure(lab: Lab, sites: Path, shared: Path, nodes: int, steps: int, response: int) -> dict[str, float]:
    run_dir = shared / "runs" / f"n{nodes}"
    job = submit(lab, sites, run_dir, nodes, overrides(shared, nodes, steps, response))
    rec = lab.wait_done(job, timeout=1200)
    if rec.get("JobState") != "COMPLETED":
        raise SystemExit(f"{nodes}-node job ended {rec.get('JobState')}; see {run_dir}/logs")
    rows = [json.loads(line) for line in (shared / f"ppo-{nodes}" / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # step 1 warms up (first forward passes, allocator)
    out = {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in timed) for p in PHASES}
    out["tokens_per_s"] = statistics.median(r["perf/total_num_tokens"] / r["timing_s/step"] for r in timed)
    log = "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("payload.log"))
    ready = re.search(r"ready in ([0-9.]+)s", log)
    out["ready_s"] = float(ready.group(1)) if ready else float("nan")
    workers = json.loads((shared / f"ppo-{nodes}" / "workers.json").read_text())["actor_rollout_ref"]
    out["hosts"] = float(len({w["hostname"] for w in workers}))
    return out


def main() -> None:
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="PPO steps per run (the first is not timed)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--response-length", type=int, default=16)
    args = p.parse_args()
    lab = Lab.up(LabConfig(nodes=max(args.nodes)))
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        shared = Path(tmp)
        save_tiny(shared / "model", seed=0)
        write_toy_digits(shared / "data", train_size=512, val_size=16, seed=0)
        write_site(shared / "sites", shared / "runs")
        for nodes in args.nodes:
            results[nodes] = measure(lab, shared / "sites", shared, nodes, args.steps, args.response_length)
            print(f"{nodes} node(s): {json.dumps({k: round(v, 3) for k, v in results[nodes].items()})}", flush=True)
    base = results[args.nodes[0]]
    print(f"\nGRPO, 24 prompts x 8 samples, response <= {args.response_length} tokens, tiny model; "
          f"median over steps 2..{args.steps} (lab instance {os.environ.get('HPCRL_LAB_INSTANCE', '0')})")
    head = f"{'nodes':>5s} {'step s':>7s} {'x base':>7s} {'tok/s':>7s} {'x base':>7s} " + " ".join(
        f"{p + ' s':>15s}" for p in PHASES[:-1]) + f" {'ready s':>8s}"
    print(head)
    for nodes, r in results.items():
        print(f"{nodes:5d} {r['step']:7.2f} {r['step'] / base['step']:7.2f} {r['tokens_per_s']:7.0f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:7.2f} "
              + " ".join(f"{r[p]:15.3f}" for p in PHASES[:-1]) + f" {r['ready_s']:8.1f}")


if __name__ == "__main__":
    main()
