"""`hpcrl status JOB|RUN`: state, restarts, last checkpoint and latest metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcrl.commands._common import run_dir_of, user_errors
from hpcrl.rundir import submitted_job_id
from hpcrl.runreport import run_report
from hpcrl.slurm import SlurmUnavailable, describe_job, queue_entries, show_job

HELP = "show a job's state, restarts, last checkpoint and latest metrics (job id or run directory)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")


def slurm_lines(job_id: str) -> tuple[list[str], bool]:
    """What Slurm says of `job_id`, and whether it still runs or waits."""
    try:
        queued = queue_entries(job_id)
        info = show_job(job_id)
    except SlurmUnavailable as exc:
        return [f"slurm: {exc}; the state above is the run directory's"], False
    lines = [f"slurm: {e.job_id} {e.state} elapsed {e.elapsed} of {e.time_limit}, {e.nodes} "
             f"node(s), {e.reason}" for e in queued]
    lines += ["slurm: " + ln for ln in describe_job(info)]
    if not queued and not info:
        lines.append(f"slurm: job {job_id} is no longer known (finished)")
    return lines, bool(queued)


@user_errors
def run(args: argparse.Namespace) -> int:
    import shutil

    run_dir = run_dir_of(args.job)
    job_id = args.job if not Path(args.job).expanduser().is_dir() else submitted_job_id(run_dir)
    alive = None
    lines: list[str] = []
    if job_id and job_id.split("_")[0].isdigit() and shutil.which("squeue"):
        lines, alive = slurm_lines(job_id)
        alive = alive or None  # not in the queue: judge by the run directory
    report = run_report(run_dir, alive=alive, job_id=job_id)
    if job_id:
        print(f"job {job_id}")
    for line in [*report.lines(), *lines]:
        print(line)
    return 0
