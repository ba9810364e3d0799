"""What a run directory says about its job: every run (restart) and how it ended, node states,
metrics and checkpoints.

Reads only files (light: no Slurm, no torch). Layout, as the submission, the node agent and
the trainer write it::

    RUN/job.json               the job (payload = trainer argv with its overrides)
    RUN/submission.json        job id and log patterns
    RUN/<R>/                   one directory per run of the job (restart R = 0, 1, ...):
        rendezvous.json nodes/<rank>.json stop.json summary.txt logs/agent-*.log logs/payload.log
    <trainer.run_dir>/metrics.jsonl              one JSON object per step
    <trainer.default_local_dir>/global_step_N/   checkpoints (complete: the trainer's rule,
                                                 a manifest naming the step and every file
                                                 with its size, all present)

Launched by hpcrl (`HPCRL_RUN_DIR` set), the trainer writes its metrics to RUN and its
checkpoints to `RUN/checkpoints`; explicit `trainer.run_dir=`/`trainer.default_local_dir=`
overrides in the payload are followed (relative ones from RUN, its working directory).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import is_complete, step_of
from trainer.exit_codes import ABORTED_EXIT_CODE, REQUEUE_EXIT_CODE

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
JOINED_RE = re.compile(r"(\d+)/(\d+) nodes joined")
PAYLOAD_STARTED = "starting the payload"


@dataclass(frozen=True)
class RestartInfo:
    """One run of the job (`RUN/<index>/`)."""

    index: int = field(metadata={"help": "restart number (0 = first run)"})
    nodes_total: int | None = field(metadata={"help": "nodes in the allocation (head's view)"})
    nodes_joined: int = field(metadata={"help": "nodes in the Ray cluster, from the agent log"})
    payload_started: bool = field(metadata={"help": "the head started the payload"})
    node_states: dict[int, str] = field(metadata={"help": "rank -> agent state"})
    ended: str | None = field(metadata={"help": "first line of summary.txt once the run ended"})
    exit_code: int | None = field(metadata={"help": "the payload's exit status, when known"})
    head_pid: int | None = field(metadata={"help": "process id of the head's agent"})
    started: float | None = field(metadata={"help": "time the head published the rendezvous"})


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def restart_indices(run_dir: Path) -> list[int]:
    """The restarts present in `run_dir`, oldest first."""
    try:
        return sorted(int(p.name) for p in run_dir.iterdir() if p.name.isdigit() and p.is_dir())
    except FileNotFoundError:
        return []


def joined_from_log(text: str) -> tuple[int, int] | None:
    """The last `N/M nodes joined` an agent log reports, as (N, M)."""
    found = JOINED_RE.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def _agent_log(root: Path) -> str:
    parts = []
    for log in sorted((root / "logs").glob("agent-0-*.log")):
        try:
            parts.append(log.read_text(errors="replace"))
        except OSError:
            pass
    return "".join(parts)


def read_restart(run_dir: Path, index: int) -> RestartInfo:
    """Everything `RUN/<index>/` says about that run."""
    root = run_dir / str(index)
    rdv = _read_json(root / "rendezvous.json") or {}
    nodes: dict[int, dict[str, Any]] = {}
    for f in (root / "nodes").glob("*.json"):
        data = _read_json(f)
        if f.stem.isdigit() and data is not None:
            nodes[int(f.stem)] = data
    log = _agent_log(root)
    joined = joined_from_log(log)
    total = len(rdv["nodes"]) if isinstance(rdv.get("nodes"), list) else (joined[1] if joined else None)
    stop = _read_json(root / "stop.json") or {}
    ended = None
    try:
        ended = (root / "summary.txt").read_text().splitlines()[0]
    except (OSError, IndexError):
        pass
    code = stop.get("exit_code")
    head = nodes.get(0, {})
    return RestartInfo(
        index=index,
        nodes_total=total,
        nodes_joined=joined[0] if joined else 0,
        payload_started=PAYLOAD_STARTED in log,
        node_states={r: str(d.get("state", "?")) for r, d in sorted(nodes.items())},
        ended=ended,
        exit_code=int(code) if isinstance(code, int) else None,
        head_pid=int(head["pid"]) if isinstance(head.get("pid"), int) else None,
        started=_mtime(root / "rendezvous.json"),
    )


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_restart(run_dir: Path) -> RestartInfo | None:
    """The latest run of the job while its head agent (a process on this machine) still runs."""
    found = restart_indices(run_dir)
    info = read_restart(run_dir, found[-1]) if found else None
    if info and info.ended is None and info.head_pid is not None and pid_alive(info.head_pid):
        return info
    return None


def restart_state(info: RestartInfo, alive: bool | None = None) -> str:
    """A one-word state: starting, running, finished, stopped (checkpointed, resumable),
    aborted (interrupted twice), failed, or lost (the agent is gone without a summary)."""
    if info.ended is None:
        if alive is False:
            return "lost"
        return "running" if info.payload_started else "starting"
    if info.exit_code == 0:
        return "finished"
    if info.exit_code == REQUEUE_EXIT_CODE:
        return "stopped"
    if info.exit_code == ABORTED_EXIT_CODE:
        return "aborted"
    return "failed"


# ----------------------------------------------------------------------------- trainer's files


def payload_overrides(run_dir: Path) -> dict[str, str]:
    """`key=value` arguments of the payload in `RUN/job.json` (empty if unreadable)."""
    job = _read_json(run_dir / "job.json") or {}
    out: dict[str, str] = {}
    for arg in job.get("payload", []):
        if isinstance(arg, str) and "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            out[key] = value
    return out


def _in_run(run_dir: Path, value: str) -> Path:
    path = Path(os.path.expandvars(value)).expanduser()
    return path if path.is_absolute() else run_dir / path


def trainer_dirs(run_dir: Path, overrides: dict[str, str] | None = None) -> tuple[Path, Path]:
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
    """One record per complete JSON line; a line cut short by a kill is skipped."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


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


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    _, root = trainer_dirs(run_dir)
    found = checkpoints(root)
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


@dataclass(frozen=True)
class RunReport:
    """What `hpcrl status RUN` and the end of a local run print."""

    run_dir: Path
    state: str
    restarts: list[RestartInfo]
    records: list[dict[str, Any]]
    checkpoint: tuple[int, Path] | None
    metrics: Path | None

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
            out.append(f"  run {r.index}: {r.ended or restart_state(r)}")
        if self.last is not None:
            total = self.last.get("training/total_steps")
            out.append(f"  steps: {self.last['step']}" + (f" of {total}" if isinstance(total, int) else ""))
            change = self.reward_change()
            if change:
                out.append(f"  reward: {change[0]:.3f} (step {self.records[0]['step']}) -> "
                           f"{change[1]:.3f} (step {self.last['step']})")
            from hpcrl.progress import format_step

            out.append(f"  latest: {format_step(self.last)}")
        else:
            out.append("  steps: none logged yet")
        out.append(f"  last checkpointed step: {self.checkpoint[0]} ({self.checkpoint[1]})"
                   if self.checkpoint else "  last checkpointed step: none yet")
        if self.metrics:
            out.append(f"  metrics: {self.metrics}")
        return out


def run_report(run_dir: Path, alive: bool | None = None) -> RunReport:
    """Read `run_dir` into a :class:`RunReport`; `alive`: whether the job is known to be
    running (None: judge by the head agent's process on this machine)."""
    restarts = [read_restart(run_dir, r) for r in restart_indices(run_dir)]
    if not restarts:
        state = "not started"
    else:
        last = restarts[-1]
        if alive is None and last.ended is None and last.head_pid is not None:
            alive = pid_alive(last.head_pid) if _same_host(run_dir, last.index) else None
        state = restart_state(last, alive)
    metrics = find_metrics(run_dir)
    return RunReport(run_dir=run_dir, state=state, restarts=restarts, records=read_metrics(metrics),
                     checkpoint=latest_checkpoint(run_dir), metrics=metrics)


def _same_host(run_dir: Path, index: int) -> bool:
    import socket

    head = (_read_json(run_dir / str(index) / "nodes" / "0.json") or {}).get("host")
    return head == socket.gethostname()
