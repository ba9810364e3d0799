"""What a run directory tells about its job: every run (restart) with how it ended, and the last
complete checkpoint. Plain file reads (no torch), for `hpcrl status` on a login node.

Layout: `<run>/<restart>/summary.txt` (first line: `job J restart R: <cause> (exit N)`, written
by the head's agent), checkpoints in `<run>/checkpoints/global_step_N/` (or the payload's
`trainer.default_local_dir=` override) and `<run>/metrics.jsonl`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
OVERRIDE = "trainer.default_local_dir="


@dataclass(frozen=True)
class RestartRecord:
    """One run of the job (Slurm runs a requeued job again under the same id)."""

    restart: int
    """`SLURM_RESTART_COUNT` of that run (0: the first)."""
    summary: str | None
    """First line of its `summary.txt`; None while it runs or when its head was killed."""


@dataclass(frozen=True)
class RunInfo:
    """The run directory's view of the job."""

    run_dir: Path
    """The run directory."""
    restarts: tuple[RestartRecord, ...]
    """Every run that left a directory, oldest first."""
    checkpoint_root: Path
    """Where the trainer writes `global_step_N/`."""
    last_checkpoint: int | None
    """Step of the newest complete checkpoint, None when there is none."""
    last_logged_step: int | None
    """Last step in `metrics.jsonl`, None when nothing was logged."""


def checkpoint_root(run_dir: Path, payload: Sequence[str]) -> Path:
    """`trainer.default_local_dir=` from the payload's overrides, else `<run>/checkpoints`."""
    for arg in reversed(payload):
        if arg.startswith(OVERRIDE) and arg[len(OVERRIDE):] not in ("", "null"):
            path = Path(arg[len(OVERRIDE):]).expanduser()
            return path if path.is_absolute() else run_dir / path
    return run_dir / CHECKPOINTS


def checkpoint_is_complete(path: Path) -> bool:
    """The trainer's rule (`trainer.checkpoint.is_complete`): a manifest naming the step and
    every file with its size, all present."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        step = int(path.name.removeprefix("global_step_"))
    except (OSError, ValueError):
        return False
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("step") != step or not isinstance(files, dict):
        return False
    for rel, size in files.items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def last_complete_step(root: Path) -> int | None:
    """Highest step among the complete `global_step_N` directories under `root`."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    steps = [int(p.name[12:]) for p in entries
             if p.name.startswith("global_step_") and p.name[12:].isdigit()
             and checkpoint_is_complete(p)]
    return max(steps, default=None)


def last_logged_step(path: Path) -> int | None:
    """`step` of the last readable line of a metrics file."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def restarts(run_dir: Path) -> tuple[RestartRecord, ...]:
    """The runs under `run_dir` (directories named by number), each with its summary line."""
    out = []
    for d in sorted((p for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                    key=lambda p: int(p.name)):
        try:
            first = (d / "summary.txt").read_text().splitlines()[0]
        except (OSError, IndexError):
            first = None
        out.append(RestartRecord(int(d.name), first))
    return tuple(out)


def run_info(run_dir: Path) -> RunInfo:
    try:
        payload = json.loads((run_dir / "job.json").read_text()).get("payload") or []
    except (OSError, ValueError, AttributeError):
        payload = []
    root = checkpoint_root(run_dir, [str(a) for a in payload])
    return RunInfo(run_dir=run_dir, restarts=restarts(run_dir), checkpoint_root=root,
                   last_checkpoint=last_complete_step(root),
                   last_logged_step=last_logged_step(run_dir / METRICS))


def describe_run(info: RunInfo) -> list[str]:
    """The lines `hpcrl status` prints about the run directory."""
    runs = len(info.restarts)
    lines = [f"run directory: {info.run_dir}",
             f"restarts: {max(runs - 1, 0)} ({runs} run{'s' if runs != 1 else ''} so far)"]
    for r in info.restarts:
        lines.append(f"  run {r.restart}: {r.summary or 'running, or ended without a summary'}")
    if info.last_checkpoint is None:
        lines.append(f"last checkpointed step: none yet (in {info.checkpoint_root})")
    else:
        lines.append(f"last checkpointed step: {info.last_checkpoint} "
                     f"({info.checkpoint_root / f'global_step_{info.last_checkpoint}'})")
    if info.last_logged_step is not None:
        lines.append(f"last logged step: {info.last_logged_step}")
    return lines
