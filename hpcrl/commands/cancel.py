"""`hpcrl cancel JOB`."""

from __future__ import annotations

import argparse

from hpcrl.commands._common import user_errors

HELP = "cancel a job (job id or run directory)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")


@user_errors
def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs import resolve
    from hpcrl.slurm import check_job_id, run_slurm

    ref = resolve(args.job)
    job = check_job_id(str(ref.job_id))
    run_slurm(["scancel", job])
    print(f"cancelled job {job}")
    return 0
