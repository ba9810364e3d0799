"""Slurm's command-line tools: pure parsers of their output, and the one seam that runs them.

Every call of `sbatch`, `squeue`, `scontrol` and `scancel` made by hpcrl goes through
:func:`run_slurm` (submitit runs `sbatch` itself; its seam is the same executable).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SQUEUE_FORMAT = "%i|%T|%M|%l|%D|%R|%j"
JOB_ID_RE = re.compile(r"^\d+(?:_\d+)?(?:\.\w+)?$")


# What `squeue -j` and `scontrol show job` print for a job id Slurm does not (or no longer) know.
UNKNOWN_JOB_RE = re.compile(r"Invalid job id specified", re.IGNORECASE)
# How long a query waits for a controller that does not answer (down, restarting, overloaded)
# before saying so: tries after 1, 2, 4 ... s. `HPCRL_SLURM_PATIENCE_S` sets it.
DEFAULT_PATIENCE_S = 7.0


class SlurmError(RuntimeError):
    """A Slurm command failed or printed something unexpected."""


class SlurmUnavailable(SlurmError):
    """Slurm's controller did not answer a query: the job's fate is unknown, not "gone"."""


def _ignore_termination() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(argv: Sequence[str], shielded: bool = False) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command (the seam tests replace by executables). `shielded`: the
    command ignores SIGTERM, for one a job sends about itself right after requeueing itself
    (Slurm then sends SIGTERM to every process of the job; SIGKILL only `KillWait` later)."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` was not found on PATH; run on a Slurm login node, or load "
                         "Slurm's client tools (e.g. `module load slurm`)")
    return subprocess.run(list(argv), capture_output=True, text=True,
                          preexec_fn=_ignore_termination if shielded else None)


def run_slurm(argv: Sequence[str], *, check: bool = True, shielded: bool = False) -> str:
    """Run a Slurm client command and return its stdout (`shielded`: see `_run`)."""
    proc = _run(argv, shielded)
    if check and proc.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed with status {proc.returncode}: "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def query_slurm(argv: Sequence[str], patience_s: float | None = None) -> str:
    """stdout of a read-only query about one job (`squeue -j`, `scontrol show job`); "" when
    Slurm answers that it does not know the job. A query Slurm does not answer is tried again
    after 1, 2, 4 ... s while `patience_s` lasts, then raises `SlurmUnavailable`: a silent
    controller must never read as a finished job. (A client's own try already lasts about 20 s
    against a dead or hung controller: "Unable to contact slurm controller", "Socket timed out".)"""
    if patience_s is None:
        patience_s = float(os.environ.get("HPCRL_SLURM_PATIENCE_S", DEFAULT_PATIENCE_S))
    start = time.monotonic()
    wait, tries = 1.0, 0
    while True:
        proc = _run(argv)
        tries += 1
        if proc.returncode == 0:
            return proc.stdout
        said = (proc.stderr.strip() or proc.stdout.strip()) or f"exit status {proc.returncode}"
        if UNKNOWN_JOB_RE.search(said):
            return ""
        if time.monotonic() + wait - start > patience_s:
            raise SlurmUnavailable(
                f"Slurm did not answer `{' '.join(argv)}` ({tries} tries in "
                f"{time.monotonic() - start:.0f} s): {said}. The job is not known to be gone: "
                "ask again later")
        time.sleep(wait)
        wait *= 2


KILL_WAIT_RE = re.compile(r"^KillWait\s*=\s*(\d+)", re.M)


def parse_kill_wait(text: str) -> int | None:
    """`KillWait` in seconds from `scontrol show config` (None when it is not there)."""
    found = KILL_WAIT_RE.search(text)
    return int(found.group(1)) if found else None


def kill_wait_s() -> int | None:
    """Seconds between Slurm's SIGTERM to every process of an ending job and its SIGKILL
    (`KillWait`); None when Slurm cannot be asked."""
    try:
        return parse_kill_wait(run_slurm(["scontrol", "show", "config"], shielded=True))
    except (SlurmError, OSError):
        return None


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
    """`scontrol show job JOB`, parsed ({} when Slurm no longer knows the job; `SlurmUnavailable`
    when Slurm does not answer)."""
    return parse_scontrol_show_job(query_slurm(["scontrol", "show", "job", job]))


def queue_entries(job: str) -> list[QueueEntry]:
    """`squeue` lines of job `job` (empty once it left the queue: finished, or forgotten;
    `SlurmUnavailable` when Slurm does not answer)."""
    return parse_squeue(query_slurm(["squeue", "-h", "-j", job, "-o", SQUEUE_FORMAT]))


def describe_job(info: Mapping[str, str]) -> list[str]:
    """The lines `hpcrl status` prints for a parsed `scontrol show job`."""
    keys = ("JobId", "JobName", "JobState", "Reason", "RunTime", "TimeLimit", "NumNodes",
            "NodeList", "Restarts", "Requeue", "StdOut", "WorkDir")
    return [f"{k}: {info[k]}" for k in keys if k in info]
