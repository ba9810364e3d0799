"""Time from the stop signal to the first resumed step, and steps lost, on the Slurm test lab.

For each scenario a 1-node job (`--nodes N`: N nodes, one rank each) trains the tiny model (steps slowed in the first run only, see
`tests/payloads/slow_reward.py`), the event is caused, and the run directory is watched every
50 ms; agent log lines carry their own timestamps. The interval is split into:

- finish + save: event -> the trainer's stop checkpoint written (finishing the step in progress,
  then the save; the save alone is printed by the trainer);
- teardown: -> the head agent's last line of the run (Ray down, summary, requeue call);
- requeue wait (Slurm): -> the rerun's agent starts;
- bring-up: -> every node joined, payload started;
- load: -> the trainer resumed (Python, torch and model start-up plus the checkpoint load);
- first step: -> the first resumed step logged.

Scenarios: `time-limit` (`--time=2`, Slurm's warning), `requeue` (`scontrol requeue` from
outside), `preempt-0` / `preempt-20` (a `high` partition job, GraceTime 0 / 20 s), `kill-9`
(payload killed, then `scontrol requeue`). Needs root (the lab).

    HPCRL_LAB_INSTANCE=N .venv/bin/python -m bench.requeue [--scenarios time-limit,requeue,...] [--nodes 2]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tests.lab import Lab, LabConfig
from tests.lab.test_requeue import (
    RESUMED_RE,
    STEP_RE,
    overrides,
    resumed_from,
    steps_run,
    submit,
    trainer_pid,
    write_site,
)

SCENARIOS = ("time-limit", "requeue", "preempt-0", "preempt-20", "kill-9")
SAVE_FREQ = 3
AGENT_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) hpcrl-agent")


@dataclass
class Watch:
    """First time (Unix) each line or file appeared, seen by polling."""

    run_dir: Path
    seen: dict[str, float] = field(default_factory=dict)

    def poll(self) -> None:
        now = time.time()
        for restart in (0, 1):
            log = self.run_dir / str(restart) / "logs" / "payload.log"
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            for ln in lines:
                if ln.startswith("trainer: saved") and restart == 0:
                    self.seen.setdefault(f"saved {ln}", now)
                if restart == 1 and RESUMED_RE.match(ln):
                    self.seen.setdefault("resumed", now)
                if restart == 1 and STEP_RE.match(ln):
                    self.seen.setdefault("first step", now)
        if (self.run_dir / "0" / "warning").exists():
            self.seen.setdefault("warning", now)


def agent_times(run_dir: Path, restart: int) -> list[tuple[float, str]]:
    """(Unix time, text) of the head agent's log lines of run `restart`."""
    out = []
    for path in (run_dir / str(restart) / "logs").glob("agent-0-*.log"):
        for ln in path.read_text(errors="replace").splitlines():
            m = AGENT_TIME_RE.match(ln)
            if m:
                stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((stamp, ln))
    return sorted(out)


def last_save(watch: Watch) -> float | None:
    saves = [t for k, t in watch.seen.items() if k.startswith("saved")]
    return max(saves) if saves else None


def cause(lab: Lab, scenario: str, job: int, run_dir: Path, watch: Watch) -> float:
    """Make the scenario's event happen; return its time."""
    if scenario == "time-limit":
        while "warning" not in watch.seen:
            watch.poll()
            time.sleep(0.05)
        return os.stat(run_dir / "0" / "warning").st_mtime
    if scenario == "requeue":
        t = time.time()
        lab.run("scontrol", "requeue", str(job))
        return t
    if scenario.startswith("preempt"):
        nodelist = lab.job(job)["NodeList"]  # one node of the job's: its preemption stops them all
        node = lab.run("scontrol", "show", "hostnames", nodelist).stdout.split()[0]
        t = time.time()
        lab.sbatch("#!/bin/bash\nsleep 5\n", "-p", "high", "-N", "1", "-c", "2", "-w", node,
                   "-o", "/dev/null")
        return t
    pid = trainer_pid(run_dir)
    assert pid, "trainer not found"
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    lab.wait_done(job, timeout=120)
    lab.run("scontrol", "requeue", str(job))
    return t


def run_scenario(lab: Lab, scenario: str, assets: Path, root: Path, nodes: int = 1) -> dict[str, float]:
    sites = root / "sites"
    root.mkdir(parents=True, exist_ok=True)
    limit = "2" if scenario == "time-limit" else "10"
    write_site(sites, scenario, root / "runs", time_limit=limit, nodes=nodes, slow_s=0.5)
    run_dir = root / "runs" / scenario
    args = overrides(assets, steps=40, save_freq=SAVE_FREQ) + ([f"trainer.nnodes={nodes}"] if nodes > 1 else [])
    job = submit(lab, sites, scenario, run_dir, args)
    watch = Watch(run_dir)
    while max(steps_run(run_dir, 0), default=0) < SAVE_FREQ + 1 and scenario != "time-limit":
        watch.poll()
        time.sleep(0.05)
    event = cause(lab, scenario, job, run_dir, watch)
    deadline = time.time() + 600
    while "first step" not in watch.seen:
        assert time.time() < deadline, f"{scenario}: no resumed step"
        watch.poll()
        time.sleep(0.05)
    lab.run("scancel", str(job))
    run0, run1 = agent_times(run_dir, 0), agent_times(run_dir, 1)
    joined = next(t for t, ln in run1 if "starting the payload" in ln)
    saved = last_save(watch) if scenario != "kill-9" else None
    rows = {
        "finish + save": (saved - event) if saved and saved > event else 0.0,
        "teardown": run0[-1][0] - (saved if saved and saved > event else event),
        "requeue wait": run1[0][0] - run0[-1][0],
        "bring-up": joined - run1[0][0],
        "load": watch.seen["resumed"] - joined,
        "first step": watch.seen["first step"] - watch.seen["resumed"],
    }
    rows["total"] = watch.seen["first step"] - event
    rows["steps lost"] = float(max(steps_run(run_dir, 0)) - (resumed_from(run_dir, 1) or 0))
    return rows


def measure(scenarios: list[str], nodes: int = 1) -> dict[str, dict[str, float]]:
    """{scenario: {phase: seconds, ..., "total", "steps lost"}}, each on a lab of its own."""
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_tiny(root / "assets" / "model", seed=0)
        write_toy_digits(root / "assets" / "data", train_size=128, val_size=8, seed=0)
        for scenario in scenarios:
            if scenario not in SCENARIOS:
                raise SystemExit(f"bench.requeue: unknown scenario `{scenario}`; the scenarios: {', '.join(SCENARIOS)}")
            grace = 20 if scenario == "preempt-20" else 0
            lab = Lab.up(LabConfig(grace_time=grace, nodes=max(3, nodes + 1)))
            try:
                results[scenario] = run_scenario(lab, scenario, root / "assets", root / scenario, nodes)
            finally:
                lab.down()
            print(scenario, {k: round(v, 1) for k, v in results[scenario].items()}, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--nodes", type=int, default=1, help="nodes per job, one trainer rank on each")
    args = p.parse_args()
    results = measure(args.scenarios.split(","), args.nodes)
    keys = list(next(iter(results.values())))
    print(f"\n{'seconds':14s}" + "".join(f"{s:>12s}" for s in results))
    for key in keys:
        print(f"{key:14s}" + "".join(f"{results[s][key]:12.1f}" for s in results))


if __name__ == "__main__":
    main()
