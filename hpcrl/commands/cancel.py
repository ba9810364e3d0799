"""`hpcrl cancel JOB|RUN`."""

from __future__ import annotations

import argparse

from hpcrl import rundir
from hpcrl.commands._common import user_errors
from hpcrl.jobs import resolve
from hpcrl.slurm import SlurmError, check_job_id, run_slurm

HELP = ("cancel a job (job id or run directory); a local run is asked to stop with a "
        "checkpoint, like Ctrl-C")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")


def stop_local(run_dir: object) -> str:
    """SIGTERM to the head agent of the run's latest restart, which forwards it to the trainer
    (it checkpoints and exits); returns what was done."""
    import os
    import signal
    from pathlib import Path

    run = Path(str(run_dir))
    info = rundir.running_restart(run)
    if info is None or info.head_pid is None:
        raise SlurmError(f"the local run `{run}` is not running (`hpcrl status {run}`)")
    os.kill(info.head_pid, signal.SIGTERM)
    return (f"asked the local run {run} (run {info.index}, agent pid {info.head_pid}) to stop; "
            "the trainer finishes its step and checkpoints")


@user_errors
def run(args: argparse.Namespace) -> int:
    ref = resolve(args.job)
    if str(ref.job_id).startswith("local-") and ref.run_dir is not None:
        print(stop_local(ref.run_dir))
        return 0
    job = check_job_id(str(ref.job_id))
    run_slurm(["scancel", job])
    print(f"cancelled job {job}")
    return 0
