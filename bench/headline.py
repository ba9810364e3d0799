"""Re-measures the README's headline figures at this commit and records them, with the commit,
the date and the machine's load, in `bench/README.md` ("Headline figures") and the same table in
the README:

    sudo HPCRL_LAB_INSTANCE=4 .venv/bin/python -m bench.headline [--only demo,first-step,stop,memory-plan,learning] [--write]
    make figures       # all five, written into bench/README.md (about 100 minutes)

Each figure is measured by the benchmark that owns it, in this process, on this machine:

- `demo`: `python -m hpcrl.demo` in a new demo directory (the tiny model and the toy data built,
  15 GRPO steps through `hpcrl submit --site local`, the plot): wall seconds and the reward
  before -> after, as the demo prints them;
- `first-step`: `bench.first_step_lab` at 2 and 3 lab nodes, one round: seconds from the batch
  script's first command to the first finished step, under hpcrl, the `srun ray start` + sleeps
  recipe and `ray symmetric-run` (root, the lab);
- `stop`: `bench.requeue` on a 2-node job: `scontrol requeue` and the time limit, seconds from
  the event to the first resumed step, and the steps lost (root, the lab);
- `memory-plan`: `bench.memory` at 1 and 2 ranks: what the steady-state update adds to the
  largest rank, measured, against the memory plan's estimate;
- `learning`: `bench.learning run` with 3 seeds (`trainer.seed=S data.seed=S`, S = 1, 2, 3):
  SmolLM2-135M-Instruct, 10 GRPO steps of 8 prompts x 4 on 2 lab nodes, vLLM rollout; the
  greedy validation accuracy (256 held-out questions) before and at step 10, per seed, mean and
  spread; then TRL's `GRPOTrainer` (HF `generate`) on the same task and settings for the same
  wall time as seed 1's job (its wall from `sbatch` to its end, less its validations), its last
  checkpoint scored by the same validation. About 75 minutes; needs `.venv-vllm` (`make
  vllm-venv`) and TRL in `.venv` (`pip install -e '.[bench]'`).

Not here: the figures of a lent GPU (`bench.gpu_check`).

With `--write` a figure is recorded only when the tree has no uncommitted change (`git status
--porcelain` empty), so that the commit named is the code measured; the section is replaced as a
whole, one row per figure, the ones not measured this time kept with their own commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "bench" / "README.md"
README = REPO / "README.md"
"""Both hold the section; the README's is the same table, which its prose refers to."""
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
FIGURES = ("demo", "first-step", "stop", "memory-plan", "learning")
ROW_RE = re.compile(r"^\| `(?P<figure>[a-z-]+)` \| (?P<value>.*) \| (?P<commit>[0-9a-f]{7,}) \| "
                    r"(?P<day>\d{4}-\d\d-\d\d) \| (?P<load>[^|]*) \|$")


@dataclass
class Row:
    figure: str
    value: str
    """The figure as the README quotes it."""
    commit: str
    day: str
    load: str

    def line(self) -> str:
        return f"| `{self.figure}` | {self.value} | {self.commit} | {self.day} | {self.load} |"


def read_rows(text: str) -> dict[str, Row]:
    """The recorded rows of the headline section, by figure; none when the section is absent."""
    if BEGIN not in text:
        return {}
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in block.splitlines():
        m = ROW_RE.match(line.strip())
        if m:
            rows[m["figure"]] = Row(m["figure"], m["value"], m["commit"], m["day"], m["load"])
    return rows


def section(rows: dict[str, Row]) -> str:
    lines = [BEGIN, "| figure | measured | commit | date | load average (1 min), cores |", "|---|---|---|---|---|"]
    lines += [rows[f].line() for f in FIGURES if f in rows]
    return "\n".join([*lines, END])


def write_rows(text: str, new: dict[str, Row], path: Path = RECORD) -> str:
    """`text` (of `path`) with its headline section holding `new` over the rows it had."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"bench.headline: {path} has no `{BEGIN}` ... `{END}` section to write into; "
                         "restore it from git")
    rows = {**read_rows(text), **new}
    head, rest = text.split(BEGIN, 1)
    return head + section(rows) + rest.split(END, 1)[1]


def commit() -> tuple[str, bool]:
    """(short commit of HEAD, whether the tree has uncommitted changes)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head, bool(dirty)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}, {os.cpu_count()}"


def demo() -> str:
    """Wall seconds of a fresh `python -m hpcrl.demo` and the reward it reports."""
    with tempfile.TemporaryDirectory(prefix="hpcrl-headline-demo-") as d:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "hpcrl.demo", "--dir", d], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
        seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench.headline: the demo failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
    reward = re.search(r"reward rose: ([\d.]+) \(step \d+\) -> ([\d.]+) \(step (\d+)\)", proc.stdout)
    if reward is None:
        raise SystemExit(f"bench.headline: the demo's reward did not rise:\n{proc.stdout[-3000:]}")
    return f"{seconds:.0f} s, {reward[3]} steps, reward {reward[1]} -> {reward[2]}"


def first_step() -> str:
    from bench import first_step_lab

    med = first_step_lab.medians(first_step_lab.measure(1, (2, 3)))
    return "; ".join(f"N={n}: hpcrl {m['hpcrl']:.1f} s, symmetric-run {m['symmetric']:.1f} s "
                     f"({m['hpcrl'] / m['symmetric']:.2f}), srun + ray start {m['seed']:.1f} s "
                     f"({m['hpcrl'] / m['seed']:.2f})" for n, m in med.items())


def stop() -> str:
    from bench import requeue

    res = requeue.measure(["requeue", "time-limit"], nodes=2)
    return "; ".join(f"2 nodes, {name}: {r['total']:.1f} s to the first resumed step "
                     f"(Slurm's requeue wait {r['requeue wait']:.1f} s), {r['steps lost']:.0f} steps lost"
                     for name, r in res.items())


def memory_plan() -> str:
    import shutil

    from bench import memory

    work = Path(tempfile.mkdtemp(prefix="hpcrl-headline-mem-"))
    try:
        model = memory.write_model(work / "model", "float32")
        parts = []
        for world in (1, 2):
            ranks = memory.measure(REPO, world, model, work / "runs")
            added = memory.added_by(ranks, "step again")
            estimate = memory.step_estimate(world)
            parts.append(f"W={world}: plan +{memory.mib(estimate)} MiB / measured +{memory.mib(added)} MiB = "
                         f"{estimate / added:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return "fp32 update on the CPU, " + "; ".join(parts)


SEEDS = (1, 2, 3)
TASK_ARGS = ["--prompts", "8", "--n", "4", "--lr", "2e-5"]
"""The batch, group size and learning rate both trainers get."""
LEARNING_ARGS = ["--steps", "10", "--test-freq", "10", *TASK_ARGS, "--requeue-at", "99"]
"""The 10-step run of `docs/learning-benchmarks.md` ("Three seeds each"), no requeue."""


def learning_result(root: Path) -> dict[str, Any]:
    """What the seeds' runs under `root` (`fp32-s<seed>/run`) and TRL's scored checkpoint
    (`fp32-s1/trl-eval.json`) logged: base accuracy, per seed (accuracy, standard error), the
    mean and sample standard deviation, and TRL's (accuracy, standard error, steps, minutes)."""
    import statistics

    from bench import learning as L

    finals, base = {}, None
    for seed in SEEDS:
        rows = [r for r in L._rows(root / f"fp32-s{seed}" / "run") if L.ACC in r]
        base = next((r[L.ACC] for r in rows if r["step"] == 0), base)
        done = [r for r in rows if r["step"] > 0]
        if not done:
            raise SystemExit(f"bench.headline: seed {seed}'s run logged no validation after training "
                             f"({root / f'fp32-s{seed}' / 'run'})")
        finals[seed] = (done[-1][L.ACC], done[-1][L.ACC_SEM])
    accs = [a for a, _ in finals.values()]
    out: dict[str, Any] = {"base": base, "finals": finals, "mean": statistics.fmean(accs),
                              "sd": statistics.stdev(accs)}
    scored = root / "fp32-s1" / "trl-eval.json"
    if scored.is_file():
        last = json.loads(scored.read_text())[-1]
        out["trl"] = (last["acc"], last["sem"], last["step"], last["wall_s"] / 60)
    return out


def budget_s(run_root: Path) -> float:
    """The wall time a job of `bench.learning run` took (`run-wall.json`: from `sbatch` to the
    job's end, start-up, loads and saves included) less its validations (`timing_s/testing`):
    what TRL is given, which validates nothing while it trains."""
    from bench import learning as L

    wall = json.loads((run_root / "run-wall.json").read_text())["wall_s"]
    return wall - sum(r.get("timing_s/testing", 0.0) for r in L._rows(run_root / "run"))


def learning() -> str:
    import shutil

    from tests.lab import Lab, LabConfig

    vllm_py = REPO / ".venv-vllm" / "bin" / "python"
    if not vllm_py.is_file():
        raise SystemExit("bench.headline: `learning` runs vLLM from .venv-vllm, which is not built: `make vllm-venv`")
    given = os.environ.get("HPCRL_LEARNING_DIR")
    root = Path(given) if given else Path(tempfile.mkdtemp(prefix="hpcrl-headline-learning-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(root / "home")}  # the models' caches go there
    (root / "home").mkdir(parents=True, exist_ok=True)
    print(f"bench.headline: learning runs in {root} (HPCRL_LEARNING_DIR={root} again keeps what finished)", flush=True)
    todo = [seed for seed in SEEDS if not _finished(root / f"fp32-s{seed}")]
    if todo:
        lab = Lab.up(LabConfig(nodes=3))
        try:
            for seed in todo:
                run = root / f"fp32-s{seed}"
                shutil.rmtree(run, ignore_errors=True)  # a run that did not finish starts again
                extra = [f"trainer.seed={seed}", f"data.seed={seed}"]
                extra += [] if seed == SEEDS[0] else ["trainer.val_before_train=false"]  # greedy: the same base
                subprocess.run([str(vllm_py), "-m", "bench.learning", "run", "--dir", str(run), *LEARNING_ARGS,
                                *extra], check=True, cwd=REPO, env=env)
        finally:
            lab.down()
    first = root / f"fp32-s{SEEDS[0]}"
    minutes = budget_s(first) / 60
    if not (first / "trl-eval.json").is_file():
        shutil.rmtree(first / "trl", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "bench.learning", "trl", "--dir", str(first), "--minutes",
                        f"{minutes:.2f}", "--steps", "99", "--test-freq", "99", *TASK_ARGS], check=True, cwd=REPO,
                       env=env)
        subprocess.run([str(vllm_py), "-m", "bench.learning", "trl-eval", "--dir", str(first)], check=True,
                       cwd=REPO, env=env)
    got = learning_result(root)
    if not given:
        shutil.rmtree(root, ignore_errors=True)
    return learning_value(got, minutes)


def _finished(seed_dir: Path) -> bool:
    """A seed's `bench.learning run` that ended with its job COMPLETED."""
    wall = seed_dir / "run-wall.json"
    return wall.is_file() and json.loads(wall.read_text()).get("state") == "COMPLETED"


def learning_value(got: dict[str, Any], minutes: float) -> str:
    """The figure as the README quotes it."""
    each = ", ".join(f"{a:.3f} ± {e:.3f}" for a, e in got["finals"].values())
    trl_acc, trl_sem, trl_step, trl_min = got["trl"]
    return (f"SmolLM2-135M, 3 seeds x 10 GRPO steps, vLLM: validation {got['base']:.3f} -> mean {got['mean']:.3f} "
            f"(seeds {each}), sd over seeds {got['sd']:.3f}; TRL GRPOTrainer, HF generate, in seed 1's "
            f"{minutes:.1f} min: {trl_step} steps, {trl_acc:.3f} ± {trl_sem:.3f} (checkpoint at {trl_min:.1f} min)")


MEASURE = {"demo": demo, "first-step": first_step, "stop": stop, "memory-plan": memory_plan, "learning": learning}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated, of: {', '.join(FIGURES)}")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RECORD.relative_to(REPO)}")
    args = parser.parse_args(argv)
    wanted = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in MEASURE]
    if unknown:
        parser.error(f"unknown figure {', '.join(map(repr, unknown))}; the figures: {', '.join(FIGURES)}")
    if any(f in ("first-step", "stop", "learning") for f in wanted) and os.geteuid() != 0:
        parser.error("`first-step`, `stop` and `learning` run on the Slurm lab, which needs root: run as root, "
                     "or `--only demo,memory-plan`")
    head, dirty = commit()
    if args.write and dirty:
        parser.error("the tree has uncommitted changes, so no commit names the code measured: commit first "
                     "(or measure without --write)")
    rows: dict[str, Row] = {}
    for figure in wanted:
        started = load()
        value = MEASURE[figure]()
        rows[figure] = Row(figure, value, head + ("+changes" if dirty else ""), date.today().isoformat(), started)
        print(rows[figure].line(), flush=True)
    if args.write:
        for path in (RECORD, README):
            path.write_text(write_rows(path.read_text(), rows, path))
        print(f"bench.headline: recorded {len(rows)} figures at {head} in {RECORD.relative_to(REPO)} and "
              f"{README.relative_to(REPO)}")
        if "first-step" in rows:  # the README's picture of it, drawn from what was just recorded
            from bench import figures

            out = REPO / "docs" / "img" / "first_step.png"
            figures.draw_first_step(*figures.headline_first_step(RECORD.read_text()), out)
            print(f"bench.headline: redrew {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
