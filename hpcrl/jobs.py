"""Following a submitted job: find its run directory and log files from a job id or a path."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcrl.rundir import (
    LOGS,
    SUBMISSION_FILE,
    RunDir,
    RunFileError,
    read_submission,
    submission_logs,
)
from hpcrl.slurm import SlurmError, check_job_id, show_job


@dataclass(frozen=True)
class JobRef:
    """A job as the user named it, resolved."""

    job_id: str | None
    run_dir: Path | None


def run_dir_from_stdout(stdout: str) -> Path | None:
    """`<run>/logs/slurm-12.out` or `<run>/submitit/12_0_log.out` -> `<run>`."""
    p = Path(stdout)
    if p.parent.name in (LOGS, "submitit") and p.is_absolute():
        return p.parent.parent
    return None


def resolve(arg: str) -> JobRef:
    """A job id (asks `scontrol`) or a run directory (reads its `submission.json`)."""
    if os.sep in arg or Path(arg).is_dir():
        run_dir = Path(arg).expanduser().absolute()
        sub = RunDir(run_dir).submission
        if not sub.is_file():
            raise SlurmError(f"`{run_dir}` has no {SUBMISSION_FILE}: it is not the run directory "
                             "of a submitted job")
        try:
            return JobRef(str(read_submission(run_dir)["job_id"]), run_dir)
        except (RunFileError, KeyError) as exc:
            raise SlurmError(f"`{sub}` is damaged ({type(exc).__name__}: {exc}); give the job "
                             "id instead of the run directory") from None
    job = check_job_id(arg)
    info = show_job(job)
    if not info:
        raise SlurmError(f"Slurm does not know job {job} (finished jobs are forgotten after "
                         "MinJobAge); give its run directory instead of the job id")
    return JobRef(job, run_dir_from_stdout(info.get("StdOut", "")))


def log_files(run_dir: Path, job_id: str, node: int | None = None) -> list[Path]:
    """The job's log files that exist: batch log first, then per-node logs (or just `node`)."""
    patterns = submission_logs(run_dir)
    out: list[Path] = []
    if node is None and "batch" in patterns:
        out.append(Path(patterns["batch"].replace("%j", job_id)))
    for key in ("node", "node_err"):
        if key not in patterns:
            continue
        pattern = patterns[key].replace("%j", job_id)
        if node is not None:
            out.append(Path(pattern.replace("%n", str(node)).replace("%t", str(node))))
            continue
        stem = Path(pattern.replace("%n", "*").replace("%t", "*"))
        out.extend(sorted(stem.parent.glob(stem.name), key=_node_index))
    existing = [p for p in out if p.exists()]
    return existing or out


def _node_index(p: Path) -> tuple[int, str]:
    import re

    nums = re.findall(r"\d+", p.name)
    return (int(nums[-1]) if nums else 0, p.name)
