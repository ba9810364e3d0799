"""`hpcrl status JOB`."""

from __future__ import annotations

import argparse

from hpcrl.commands._common import user_errors

HELP = "show a job's state, restarts and last checkpointed step (job id or run directory)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")


def slurm_lines(job_id: str) -> list[str]:
    """What Slurm says about the job (queue line and `scontrol show job`), possibly nothing."""
    from hpcrl.slurm import (
        SQUEUE_FORMAT,
        describe_job,
        parse_scontrol_show_job,
        parse_squeue,
        run_slurm,
    )

    queued = parse_squeue(run_slurm(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT],
                                    check=False))
    lines = [f"{e.job_id} {e.state} elapsed {e.elapsed} of {e.time_limit}, {e.nodes} node(s), "
             f"{e.reason}" for e in queued]
    info = parse_scontrol_show_job(run_slurm(["scontrol", "show", "job", job_id], check=False))
    return lines + describe_job(info)


@user_errors
def run(args: argparse.Namespace) -> int:
    from hpcrl.jobs import resolve
    from hpcrl.runinfo import describe_run, run_info
    from hpcrl.slurm import SlurmError

    ref = resolve(args.job)
    slurm_job = ref.job_id is not None and ref.job_id.split("_")[0].isdigit()
    if not slurm_job and ref.run_dir is None:
        raise SlurmError(f"`{args.job}` did not run under Slurm (job id {ref.job_id})")
    lines = slurm_lines(str(ref.job_id)) if slurm_job else []
    if slurm_job and not lines:
        lines.append(f"job {ref.job_id}: no longer known to Slurm (finished)")
    for line in lines:
        print(line)
    if ref.run_dir is not None and ref.run_dir.is_dir():
        for line in describe_run(run_info(ref.run_dir)):
            print(line)
    return 0
