"""What a run's trainer leaves in its run directory, read for people: the trainer's directories
and the variables it is given (`reading_env`, `trainer_dirs`), its metrics and checkpoints, the
metric names a report picks, and the run in words (:class:`RunReport`: what `hpcrl status` and
the end of a local run print). The run directory's layout, its job files and its state file are
:mod:`hpcrl.rundir`'s. Reading stays light (no Slurm, no torch)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.diagnosis import json_lines, read_diagnoses
from hpcrl.rundir import CHECKPOINTS, RunFileError, read_job, restart_indices
from hpcrl.runstate import RestartInfo, pid_alive, read_restart, restart_state
from trainer.checkpoint.layout import is_complete, latest_run_checkpoint, read_run_identity, step_of
from trainer.config import GPUS_ENV, ConfigError, override_values
from trainer.metrics import METRICS_FILE  # the trainer writes it; named once, there

# ----------------------------------------------------------------------------- trainer's files


def reading_env(nodes: int, run_dir: Path, profile: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The variables the node agent gives the trainer that its overrides may name
    (`${oc.env:HPCRL_NUM_NODES}`) or its defaults follow (`trainer.n_gpus_per_node`), as the
    launcher assumes them when it reads the overrides before or after the job (the nodes asked
    for; the agent passes the nodes granted). `profile`: the job's profile as plain data."""
    return {"HPCRL_NUM_NODES": str(nodes), "HPCRL_RUN_DIR": str(run_dir), **gpus_env(profile or {})}


def gpus_env(profile: Mapping[str, Any]) -> dict[str, str]:
    """`HPCRL_GPUS_PER_NODE`: the GPUs per node the job asks Slurm for (the profile's
    `slurm.gpus_per_node`, 0 = none), which `trainer.n_gpus_per_node` follows by default."""
    slurm = profile.get("slurm") or {}
    return {GPUS_ENV: str(int(slurm.get("gpus_per_node") or 0))}


def payload_overrides(run_dir: Path) -> dict[str, Any]:
    """The trainer overrides of the payload in `RUN/job.json`, read by the trainer's rules
    (empty if the file is unreadable or the trainer refuses them)."""
    try:
        job = read_job(run_dir)
        nodes = job.get("nodes") if isinstance(job.get("nodes"), int) else 1
        profile = job.get("profile") if isinstance(job.get("profile"), dict) else {}
        return override_values([a for a in job.get("payload", []) if isinstance(a, str)],
                               reading_env(nodes, run_dir, profile))
    except (RunFileError, ConfigError):
        return {}


def _in_run(run_dir: Path, value: str) -> Path:
    path = Path(os.path.expandvars(value)).expanduser()
    return path if path.is_absolute() else run_dir / path


def trainer_dirs(run_dir: Path, overrides: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
    """(metrics directory, checkpoint root) the trainer uses for this run."""
    o = payload_overrides(run_dir) if overrides is None else overrides
    ckpt = o.get("trainer.default_local_dir")
    ckpt_root = run_dir / CHECKPOINTS if ckpt in (None, "", "null") else _in_run(run_dir, ckpt)
    metrics = o.get("trainer.run_dir")
    return (run_dir if metrics in (None, "", "null") else _in_run(run_dir, metrics)), ckpt_root


def find_metrics(run_dir: Path) -> Path | None:
    """The run's `metrics.jsonl`: where the overrides put it, else the first one found within
    three levels of `run_dir`."""
    named, _ = trainer_dirs(run_dir)
    for candidate in (named / METRICS_FILE, run_dir / METRICS_FILE):
        if candidate.is_file():
            return candidate
    for depth in ("*", "*/*", "*/*/*"):
        found = sorted(run_dir.glob(f"{depth}/{METRICS_FILE}"))
        if found:
            return found[0]
    return None


def metrics_path(run_dir: Path) -> Path:
    """Where the metrics are, or will be once the trainer writes its first step."""
    return find_metrics(run_dir) or trainer_dirs(run_dir)[0] / METRICS_FILE


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """One record per complete JSON line with a step; a line cut short by a kill is skipped."""
    return [r for r in json_lines(text) if isinstance(r.get("step"), int)]


def read_metrics(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    try:
        return parse_metrics(path.read_text())
    except FileNotFoundError:
        return []


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` (the trainer's rule), oldest first."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    return sorted((step_of(p), p) for p in entries if is_complete(p))


TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""verl's record of its newest complete checkpoint in its checkpoint root (written after the save,
`verl/trainer/ppo/ray_trainer.py` `_save_checkpoint`), naming `global_step_<N>/`."""


def tracked_checkpoint(root: Path) -> tuple[int, Path] | None:
    """(N, `root/global_step_N`) as verl's tracker file names it, None without one (or when
    that directory is gone, as verl's `find_latest_ckpt_path` rules)."""
    try:
        step = int((root / TRACKER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    path = root / f"global_step_{step}"
    return (step, path) if path.is_dir() else None


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The run's newest checkpoint: by the trainer's rule (its own, newest commit) once the run
    has an identity, else the highest complete step found."""
    named, root = trainer_dirs(run_dir)
    run = read_run_identity(named)
    own = latest_run_checkpoint(root, run) if run is not None else None
    if own is not None:
        return step_of(own), own
    found = checkpoints(root)
    tracked = None if found else tracked_checkpoint(root)
    if tracked is not None:
        return tracked
    if not found:  # trainer dirs not where the overrides say: look near the metrics file
        metrics = find_metrics(run_dir)
        for base in ([metrics.parent, metrics.parent / "checkpoints"] if metrics else []):
            found = found or checkpoints(base)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- metric names


REWARD = ("critic/score/mean", "critic/rewards/mean")
KL = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")
ENTROPY = ("actor/entropy",)
RESPONSE_LENGTH = ("response_length/mean",)
STEP_TIME = ("timing_s/step", "perf/time_per_step")
LAG = ("fully_async/lag/max", "one_step_off/lag")
"""Versions the step's samples lagged the trainer's weights (the asynchronous loops)."""
TRAINER_IDLE = ("fully_async/trainer/idle_ratio",)
ROLLOUTER_IDLE = ("fully_async/rollouter/idle_ratio",)
SYNC_TIME = ("timing_s/param_sync", "timing_s/sync_rollout_weights")
"""The weight sync to a rollout pool (fully async, one-step-off)."""
VALIDATION = ("val-core/*/acc/mean@*", "val-core/*/reward/mean@*")
"""Validation accuracy where the reward reports `acc`, else the validation reward (patterns:
the data source and the sample count vary); `val-aux/.../sem@N` is its standard error."""


def sem_name(name: str) -> str | None:
    """The standard error's metric name beside a validation mean's; None for other metrics."""
    if not name.startswith("val-core/") or "/mean@" not in name:
        return None
    return name.replace("val-core/", "val-aux/", 1).replace("/mean@", "/sem@")


def pick(record: dict[str, Any], names: Sequence[str]) -> tuple[str, float] | None:
    """The first of `names` present in `record` with a number, as (name, value)."""
    for name in names:
        value = record.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return name, float(value)
    return None


def restart_starts(records: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(restart, first step of that restart) for every restart after the first one seen."""
    out = []
    previous = None
    for r in records:
        restart = r.get("training/restart")
        if isinstance(restart, int) and previous is not None and restart != previous:
            out.append((restart, int(r["step"])))
        if isinstance(restart, int):
            previous = restart
    return out


# ----------------------------------------------------------------------------- a run in words


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_step(record: dict[str, Any], eta_s: float | None = None) -> str:
    """`step 3/15  reward 0.068  kl 0.0923  entropy 3.87  len 7.5  9.6s/step  ETA 1m55s`; an
    asynchronous loop's step adds `lag 1  sync 0.4s  trainer idle 0.12  rollouter idle 0.30`."""
    total = record.get("training/total_steps")
    parts = [f"step {record['step']}" + (f"/{total}" if isinstance(total, int) else "")]
    for label, names, fmt in (("reward", REWARD, "{:.3f}"), ("kl", KL, "{:.3g}"),
                              ("entropy", ENTROPY, "{:.3g}"),
                              ("len", RESPONSE_LENGTH, "{:.1f}")):
        found = pick(record, names)
        if found:
            parts.append(f"{label} {fmt.format(found[1])}")
    step_time = pick(record, STEP_TIME)
    if step_time:
        parts.append(f"{step_time[1]:.1f}s/step")
    for label, names, fmt in (("lag", LAG, "{:.0f}"), ("sync", SYNC_TIME, "{:.1f}s"),
                              ("trainer idle", TRAINER_IDLE, "{:.2f}"), ("rollouter idle", ROLLOUTER_IDLE, "{:.2f}")):
        found = pick(record, names)  # asynchronous loops only
        if found:
            parts.append(f"{label} {fmt.format(found[1])}")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return "  ".join(parts)


@dataclass(frozen=True)
class RunReport:
    """What `hpcrl status RUN` and the end of a local run print."""

    run_dir: Path
    state: str
    restarts: list[RestartInfo]
    records: list[dict[str, Any]]
    checkpoint: tuple[int, Path] | None
    metrics: Path | None
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    """What the trainer found out about a failure (:mod:`hpcrl.diagnosis`), oldest first."""

    @property
    def last(self) -> dict[str, Any] | None:
        return self.records[-1] if self.records else None

    def reward_change(self) -> tuple[float, float] | None:
        """(reward of the first step, reward of the last step)."""
        first = pick(self.records[0], REWARD) if self.records else None
        last = pick(self.records[-1], REWARD) if self.records else None
        return (first[1], last[1]) if first and last else None

    def lines(self) -> list[str]:
        n = len(self.restarts)
        out = [f"run {self.run_dir}: {self.state}"
               + (f" ({n} runs: {n - 1} restart{'s' if n != 2 else ''})" if n > 1 else "")]
        out.append(f"  restarts: {max(n - 1, 0)}")
        for r in self.restarts:
            # a run whose head died has no headline; the worker that requeued it says why
            out.append(f"  run {r.index}: {r.ended or restart_state(r) + (f': {r.requeue_why or r.requeue}' if r.requeue else '')}")
        if self.last is not None:
            total = self.last.get("training/total_steps")
            out.append(f"  steps: {self.last['step']}" + (f" of {total}" if isinstance(total, int) else ""))
            change = self.reward_change()
            if change:
                out.append(f"  reward: {change[0]:.3f} (step {self.records[0]['step']}) -> "
                           f"{change[1]:.3f} (step {self.last['step']})")
            out.append(f"  latest: {format_step(self.last)}")
        else:
            out.append("  steps: none logged yet")
        out.append(f"  last checkpointed step: {self.checkpoint[0]} ({self.checkpoint[1]})"
                   if self.checkpoint else "  last checkpointed step: none yet")
        if self.metrics:
            out.append(f"  metrics: {self.metrics}")
        for d in self.diagnoses[-3:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("time", 0)))
            out.append(f"  diagnosis ({d.get('kind', '?')}, {when}): {d['summary']}")
        return out


def run_report(run_dir: Path, alive: bool | None = None, job_id: str | None = None
               ) -> RunReport:
    """Read `run_dir` into a :class:`RunReport`; `alive`: whether the job is known to be
    running (None: judge by the head agent's process when it runs on this machine); `job_id`:
    the job submitted last, whose state it is once it has a run (an earlier job's end is not
    its state)."""
    restarts = [read_restart(run_dir, r) for r in restart_indices(run_dir)]
    if not restarts:
        state = "not started"
    elif job_id is not None and restarts[-1].job_id not in (None, job_id):
        state = (f"job {job_id} not started yet" + (" (queued)" if alive else "")
                 + f"; run {restarts[-1].index} was job {restarts[-1].job_id}'s")
    else:
        last = restarts[-1]
        if alive is None and last.ended is None and last.head_pid is not None:
            alive = pid_alive(last.head_pid) if last.head_host == socket.gethostname() else None
        state = restart_state(last, alive)
    metrics = find_metrics(run_dir)
    where = metrics.parent if metrics else trainer_dirs(run_dir)[0]
    return RunReport(run_dir=run_dir, state=state, restarts=restarts, records=read_metrics(metrics),
                     checkpoint=latest_checkpoint(run_dir), metrics=metrics, diagnoses=read_diagnoses(where))
