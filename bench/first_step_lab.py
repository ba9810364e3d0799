"""Time to the first finished training step on the Slurm lab: hpcrl against the seed recipe and
Ray's own `ray symmetric-run`, the same trainer under each.

What users wait for is the first finished step, not "Ray is up". For N = 1, 2, 3 lab nodes, every
kind runs the same `python -m trainer` job (the tiny model, the toy task, `trainer.nnodes=N`, one
rank per node, one step, no validation) and the trainer writes when each of its start-up phases
ended (`trainer/startup.py`: `RUN/startup.json`). Phases, in seconds from the job start (the batch
script's first command):

- nodes joined: hpcrl: the head agent's "all N nodes joined" line; seed: the end of its sleeps;
  symmetric-run: when it starts the entrypoint (the trainer's first mark, `python`, less the
  interpreter's own start);
- python, imports: the trainer process runs, and has imported torch, transformers and Ray;
- ray connected, workers spawned (one Ray actor per rank, its imports done), models built (the
  process group formed, the model loaded on every rank), driver ready;
- first rollout, first step (update done and logged).

Kinds:

- hpcrl: `hpcrl render` (profile extending `slurmlab`, `container.runtime: none`) with the
  trainer's overrides, submitted with plain `sbatch`;
- seed: the seeds' recipe (`bench/agent_bringup_lab.py`: `srun ray start`, `sleep 10`, `sleep 5`
  per worker), then the trainer with `RAY_ADDRESS` at the head;
- symmetric-run: `srun ray symmetric-run --address HEAD:PORT --min-nodes N -- python -m trainer
  ...` on every node, as `../shared/lab-notes` §6 shows it must run on the lab: each node in its
  own PID and mount namespace (`unshare -pfm --mount-proc`) with a private `/tmp/ray`, no
  dashboard, `RAY_AUTH_MODE=disabled`.

The kinds run interleaved in every round, the order flipped each round. Needs root (the lab).

    HPCRL_LAB_INSTANCE=3 .venv/bin/python -m bench.first_step_lab [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.agent_bringup_lab import (
    JOB_ID_BASE,
    PYTHON,
    REPO,
    STAMP,
    Run,
    hpcrl_phases,
    insert_after_sbatch_lines,
    read_stamp,
    seed_script,
    sweep,
    temp_name,
    wait_finished,
)
from tests.lab import Lab, LabConfig
from trainer import startup

NODE_COUNTS = (1, 2, 3)
SYMMETRIC_PORT = 6581
TRAINER_PHASES = ("python", "imports", "ray_connected", "workers_spawned", "models_built",
                  "driver_ready", "first_rollout", "first_step")


def make_assets(root: Path) -> Path:
    from trainer.tiny import save_tiny

    assets = root / "assets"
    save_tiny(assets / "model", seed=0)
    subprocess.run([PYTHON, "-m", "trainer.preprocess", "toy_digits", "--output", str(assets / "data"),
                    "--train-size", "16", "--val-size", "4"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return assets


def trainer_overrides(assets: Path, n: int, run_dir: Path) -> list[str]:
    return [f"data.train_files={assets / 'data' / 'train.parquet'}",
            f"data.val_files={assets / 'data' / 'test.parquet'}", "data.max_prompt_length=16",
            "data.max_response_length=4", f"actor_rollout_ref.model.path={assets / 'model'}",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=6",  # rows split over 1-3 ranks
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "trainer.val_before_train=false", "trainer.device=cpu", "trainer.logger=['console']",
            "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
            f"trainer.nnodes={n}", "trainer.n_gpus_per_node=1", f"trainer.run_dir={run_dir}",
            f"trainer.default_local_dir={run_dir / 'checkpoints'}"]


def trainer_phases(run_dir: Path, start: float) -> dict[str, float]:
    data = startup.read(run_dir)
    if not data:
        raise SystemExit(f"no {startup.FILE} in {run_dir}: the trainer did not finish a step")
    marks = data["marks"]
    return {name.replace("_", " "): marks[name] - start for name in TRAINER_PHASES if name in marks}


def run_hpcrl(lab: Lab, root: Path, sites: Path, assets: Path, n: int, tag: str) -> Run:
    run_dir = root / f"hpcrl-{tag}"
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [PYTHON, "-m", "hpcrl", "render", "--site", "bench-bare", "--nodes", str(n),
         "--run-dir", str(run_dir), "--", *trainer_overrides(assets, n, run_dir)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"`hpcrl render` failed: {proc.stderr}")
    script = insert_after_sbatch_lines(proc.stdout, STAMP + str(root / f"hpcrl-{tag}.start"))
    load = os.getloadavg()[0]
    wait_finished(lab, lab.sbatch(script), "hpcrl", run_dir)
    start = read_stamp(root / f"hpcrl-{tag}.start")
    joined, _ = hpcrl_phases(run_dir, start, n)
    phases = {"nodes joined": joined, **trainer_phases(run_dir, start)}
    return Run("hpcrl", n, phases["first step"], load, phases)


def run_seed(lab: Lab, root: Path, assets: Path, n: int, tag: str) -> Run:
    out = root / f"seed-{tag}"
    out.mkdir()
    payload = f"{PYTHON} -m trainer {shlex.join(trainer_overrides(assets, n, out))} > {out}/trainer.log 2>&1"
    load = os.getloadavg()[0]
    job = lab.sbatch(seed_script(n, out, payload))
    try:
        wait_finished(lab, job, "seed", out)
    finally:
        time.sleep(0.5)
        sweep(temp_name(out))
        for tmp in Path("/tmp").glob(Path(temp_name(out)).name + "-*"):
            shutil.rmtree(tmp, ignore_errors=True)
    start = read_stamp(out / "bench-start")
    phases = {"nodes joined": read_stamp(out / "bench-joined") - start, **trainer_phases(out, start)}
    return Run("seed", n, phases["first step"], load, phases)


def symmetric_script(n: int, out: Path, assets: Path) -> str:
    venv_bin = Path(PYTHON).parent
    trainer = shlex.join([PYTHON, "-m", "trainer", *trainer_overrides(assets, n, out)])
    node = (f'mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray && exec ray symmetric-run '
            f'--address "$ip_head" --min-nodes {n} --num-cpus 2 --num-gpus 0 -- '
            f'env RAY_ADDRESS="$ip_head" {trainer} > {out}/trainer.log 2>&1')
    return f"""#!/bin/bash
#SBATCH --job-name=symmetric-bench
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --partition=debug
#SBATCH --time=00:10:00
#SBATCH --output={out}/slurm-%j.out
{STAMP}{out}/bench-start
export PATH={venv_bin}:$PATH RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
for word in $(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address); do
    [[ $word == *.* ]] && head_ip=$word
done
export ip_head=$head_ip:{SYMMETRIC_PORT}
srun --nodes={n} --ntasks-per-node=1 unshare -pfm --mount-proc bash -c {shlex.quote(node)}
"""


def run_symmetric(lab: Lab, root: Path, assets: Path, n: int, tag: str) -> Run:
    out = root / f"symmetric-{tag}"
    out.mkdir()
    load = os.getloadavg()[0]
    wait_finished(lab, lab.sbatch(symmetric_script(n, out, assets)), "symmetric-run", out)
    start = read_stamp(out / "bench-start")
    phases = trainer_phases(out, start)
    phases = {"nodes joined": phases["python"], **phases}  # it starts the entrypoint then
    return Run("symmetric", n, phases["first step"], load, phases)


def report(runs: list[Run], repeat: int, counts: tuple[int, ...]) -> None:
    kinds = list(dict.fromkeys(r.kind for r in runs))
    loads = [r.load for r in runs]
    print(f"\nmedian of {repeat}, seconds from job start; load average (1 min) {min(loads):.2f}-"
          f"{max(loads):.2f} on {os.cpu_count()} cores")
    names = ["nodes joined", *(p.replace("_", " ") for p in TRAINER_PHASES)]
    for n in counts:
        print(f"\nN = {n}\n| phase | " + " | ".join(kinds) + " |\n" + "|---" * (len(kinds) + 1) + "|")
        for name in names:
            cells = []
            for kind in kinds:
                values = [r.phases[name] for r in runs if r.kind == kind and r.nodes == n
                          and name in r.phases]
                cells.append(f"{statistics.median(values):.1f}" if values else "-")
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| N | " + " | ".join(f"{k} first step s" for k in kinds) + " | hpcrl / seed | "
          "hpcrl / symmetric |\n" + "|---" * (len(kinds) + 3) + "|")
    for n in counts:
        med = {k: statistics.median(r.seconds for r in runs if r.kind == k and r.nodes == n)
               for k in kinds}
        print(f"| {n} | " + " | ".join(f"{med[k]:.1f}" for k in kinds)
              + f" | {med['hpcrl'] / med['seed']:.2f} | {med['hpcrl'] / med['symmetric']:.2f} |")


def measure(repeat: int, counts: tuple[int, ...]) -> list[Run]:
    """Every kind at every node count, `repeat` rounds, interleaved (the order flipped each round)."""
    cfg = LabConfig(nodes=max(counts), extra={"FirstJobId": str(JOB_ID_BASE + os.getpid() % 1000 * 100)})
    lab = Lab.up(cfg)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hfs-") as d:
        root = Path(d)
        assets = make_assets(root)
        sites = root / "sites"
        sites.mkdir()
        (sites / "bench-bare.yaml").write_text(
            f"extends: slurmlab\nrun_root: {root}\ncontainer:\n  runtime: none\n")
        jobs: dict[str, Callable[[int, str], Run]] = {
            "hpcrl": lambda n, tag: run_hpcrl(lab, root, sites, assets, n, tag),
            "seed": lambda n, tag: run_seed(lab, root, assets, n, tag),
            "symmetric": lambda n, tag: run_symmetric(lab, root, assets, n, tag),
        }
        for i in range(repeat):
            for n in counts:
                for kind in (list(jobs) if i % 2 == 0 else list(reversed(jobs))):
                    runs.append(jobs[kind](n, f"{i}-{n}"))
                    print(f"round {i + 1}: {kind:9s} N={n} first step {runs[-1].seconds:6.2f} s "
                          + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1].phases.items()), flush=True)
    lab.down()
    return runs


def medians(runs: list[Run]) -> dict[int, dict[str, float]]:
    """{N: {kind: median seconds to the first finished step}}."""
    out: dict[int, dict[str, float]] = {}
    for n in dict.fromkeys(r.nodes for r in runs):
        kinds = dict.fromkeys(r.kind for r in runs if r.nodes == n)
        out[n] = {k: statistics.median(r.seconds for r in runs if r.kind == k and r.nodes == n) for k in kinds}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--nodes", type=int, nargs="*", default=list(NODE_COUNTS))
    args = parser.parse_args()
    counts = tuple(args.nodes)
    report(measure(args.repeat, counts), args.repeat, counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
