"""`hpcrl submit`: submit a job through submitit (default) or as the rendered script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hpcrl.commands._checks import PASSED, preflight
from hpcrl.commands._common import add_job_arguments, prepare, user_errors
from hpcrl.doctor_record import suggestion
from hpcrl.jobspec import prepare_run_dir
from hpcrl.progress import NO_ANSWER, Progress, follow
from hpcrl.rundir import restart_indices
from hpcrl.runreport import run_report
from hpcrl.slurm import SlurmError, SlurmUnavailable, queue_entries
from hpcrl.submission import (
    LOCAL_VIA,
    dry_run_text,
    refuse_if_queued,
    refuse_if_running,
    submit,
)

HELP = "submit a job (`--dry-run` prints exactly what would be submitted)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be submitted; submit and create nothing")
    parser.add_argument("--via", choices=["submitit", "sbatch"], default="submitit",
                        help="submit through submitit (default) or the rendered sbatch script")
    parser.add_argument("--follow", action="store_true",
                        help="Slurm sites: stay and print progress (queued, nodes joined, one "
                        "line per step) until the job ends; Ctrl-C stops following, not the job")
    parser.add_argument("--force", action="store_true",
                        help="submit even when the memory plan says a phase cannot fit a GPU "
                        "(`slurm.gpu_memory_gib`); the plan's refusal is printed as a warning")
    add_job_arguments(parser)


@user_errors
def run(args: argparse.Namespace) -> int:
    profile, req = prepare(args)
    if args.resume and not args.dry_run:  # one job per run directory: its job must be over
        (refuse_if_running if req.via == LOCAL_VIA else refuse_if_queued)(Path(req.run_dir))
    preflight(args, profile, req, submitting=True)  # the dry run's verdict is the submission's
    if args.dry_run:
        text = dry_run_text(req)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        print(PASSED, file=sys.stderr)
        return 0
    prepared = prepare_run_dir(Path(req.run_dir), req.spec, resume=args.resume,
                               update_spec=args.update_spec)
    earlier = restart_indices(Path(req.run_dir))  # runs of earlier jobs: not this job's
    try:
        done = submit(req)
    except SlurmError:  # not submitted: leave no job.json that a later `--resume` would run
        if req.via != LOCAL_VIA:
            prepared.undo()
        raise
    if done.via != "local":  # a local run printed its own summary
        for line in done.lines():
            print(line, flush=True)
        if not getattr(args, "doctor", False) and (note := suggestion(profile.name)):
            print(note, file=sys.stderr)
        if args.follow:
            follow_job(done.job_id, Path(done.run_dir), earlier)
    return done.exit_status or 0


def queue_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) from `squeue`, None once the job has left the queue; `NO_ANSWER` with
    Slurm's message while Slurm does not answer (following goes on)."""
    try:
        entries = queue_entries(job_id)
    except SlurmUnavailable as exc:
        return NO_ANSWER, str(exc)
    return (entries[0].state, entries[0].reason) if entries else None


def follow_job(job_id: str, run_dir: Any, earlier: list[int]) -> None:
    progress = Progress(sys.stdout)
    try:
        follow(run_dir, lambda: queue_state(job_id), progress, earlier=earlier)
    except KeyboardInterrupt:
        progress.close()
        print(f"stopped following; the job goes on (`hpcrl status {run_dir}`)")
        return
    progress.close()
    for line in run_report(run_dir, alive=False, job_id=job_id).lines():
        print(line)


