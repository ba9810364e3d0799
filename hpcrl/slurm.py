"""Slurm's command-line tools: pure parsers of their output, and the one seam that runs them.

Every call of `sbatch`, `squeue`, `scontrol` and `scancel` made by hpcrl goes through
:func:`run_slurm` (submitit runs `sbatch` itself; its seam is the same executable).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SQUEUE_FORMAT = "%i|%T|%M|%l|%D|%R|%j"
JOB_ID_RE = re.compile(r"^\d+(?:_\d+)?(?:\.\w+)?$")


class SlurmError(RuntimeError):
    """A Slurm command failed or printed something unexpected."""


def run_slurm(argv: Sequence[str], *, check: bool = True) -> str:
    """Run a Slurm client command and return its stdout (the seam tests replace by executables)."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` was not found on PATH; run on a Slurm login node, or load "
                         "Slurm's client tools (e.g. `module load slurm`)")
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed with status {proc.returncode}: "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def check_job_id(job: str) -> str:
    """`job` if it looks like a Slurm job id (`123`, `123_4`), else a clear error."""
    if not JOB_ID_RE.match(job):
        raise SlurmError(f"`{job}` is not a Slurm job id (digits, e.g. `4242`)")
    return job


def parse_sbatch_output(text: str) -> str:
    """Job id from `sbatch` output: `Submitted batch job 42` or `--parsable`'s `42[;cluster]`."""
    m = re.search(r"Submitted batch job (\d+)", text)
    if m:
        return m.group(1)
    first = text.strip().splitlines()[0] if text.strip() else ""
    m = re.fullmatch(r"(\d+)(?:;\S+)?", first.strip())
    if m:
        return m.group(1)
    raise SlurmError(f"could not find a job id in sbatch's output {text!r}")


_KEY_RE = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_show_job(text: str) -> dict[str, str]:
    """`scontrol show job ID` -> {key: value}; values may contain spaces (e.g. `Command`)."""
    text = text.strip()
    if not text:
        return {}
    matches = list(_KEY_RE.finditer(text))
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out


_SLURM_TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}$")


def parse_slurm_time(text: str) -> float | None:
    """`2026-11-21T16:00:34` (Slurm prints the cluster's local time) -> Unix seconds; None for
    `Unknown`, `None`, `N/A` or an empty value."""
    text = text.strip()
    if not _SLURM_TIME_RE.match(text):
        return None
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


@dataclass(frozen=True)
class QueueEntry:
    """One line of `squeue --format=SQUEUE_FORMAT`."""

    job_id: str
    state: str
    elapsed: str
    time_limit: str
    nodes: int
    reason: str
    name: str


def parse_squeue(text: str) -> list[QueueEntry]:
    """Lines of `squeue -h -o '%i|%T|%M|%l|%D|%R|%j'` -> entries (blank lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 6)
        if len(parts) != 7:
            raise SlurmError(f"unexpected squeue line {line!r}; expected format {SQUEUE_FORMAT}")
        jid, state, elapsed, limit, nodes, reason, name = (p.strip() for p in parts)
        out.append(QueueEntry(jid, state, elapsed, limit, int(nodes) if nodes.isdigit() else 0,
                              reason, name))
    return out


def show_job(job: str) -> dict[str, str]:
    """`scontrol show job JOB`, parsed ({} when Slurm no longer knows the job)."""
    return parse_scontrol_show_job(run_slurm(["scontrol", "show", "job", job], check=False))


def queue_entries(job: str) -> list[QueueEntry]:
    """`squeue` lines of job `job` (empty once it left the queue: finished, or forgotten)."""
    return parse_squeue(run_slurm(["squeue", "-h", "-j", job, "-o", SQUEUE_FORMAT], check=False))


def describe_job(info: Mapping[str, str]) -> list[str]:
    """The lines `hpcrl status` prints for a parsed `scontrol show job`."""
    keys = ("JobId", "JobName", "JobState", "Reason", "RunTime", "TimeLimit", "NumNodes",
            "NodeList", "Restarts", "Requeue", "StdOut", "WorkDir")
    return [f"{k}: {info[k]}" for k in keys if k in info]
