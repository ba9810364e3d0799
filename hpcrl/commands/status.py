"""`hpcrl status JOB`."""

from __future__ import annotations

import argparse

from hpcrl.commands._common import user_errors

HELP = "show a job's state (job id or run directory)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")


@user_errors
def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs import resolve
    from hpcrl.slurm import (
        SQUEUE_FORMAT,
        SlurmError,
        describe_job,
        parse_scontrol_show_job,
        parse_squeue,
        run_slurm,
    )

    ref = resolve(args.job)
    if ref.job_id is None or not ref.job_id.isdigit():
        raise SlurmError(f"`{args.job}` did not run under Slurm (job id {ref.job_id})")
    queued = parse_squeue(run_slurm(["squeue", "-h", "-j", ref.job_id, "-o", SQUEUE_FORMAT],
                                    check=False))
    for e in queued:
        print(f"{e.job_id} {e.state} elapsed {e.elapsed} of {e.time_limit}, {e.nodes} node(s), "
              f"{e.reason}")
    info = parse_scontrol_show_job(run_slurm(["scontrol", "show", "job", ref.job_id],
                                             check=False))
    for line in describe_job(info):
        print(line)
    if not queued and not info:
        print(f"job {ref.job_id}: no longer known to Slurm (finished); run directory: "
              f"{ref.run_dir}")
    return 0
