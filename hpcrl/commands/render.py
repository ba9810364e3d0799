"""`hpcrl render`: print the standalone batch script of a job."""

from __future__ import annotations

import argparse
import sys

from hpcrl.commands._checks import PASSED, preflight
from hpcrl.commands._common import add_job_arguments, prepare, user_errors
from hpcrl.jobspec import prepare_run_dir

HELP = ("print the sbatch script of a job after the checks `hpcrl submit` runs (prepares its run "
        "directory); `| sbatch` submits it")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-prepare", action="store_true",
                        help="only print; do not create the run directory and its job.json")
    add_job_arguments(parser)


@user_errors
def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    profile, req = prepare(args)
    preflight(args, profile, req, submitting=False)  # the checks `hpcrl submit` runs, but Slurm's client
    if not args.no_prepare:
        prepare_run_dir(Path(req.run_dir), req.spec, resume=args.resume,
                        update_spec=args.update_spec)
        print(f"hpcrl: run directory {req.run_dir} (job.json written)", file=sys.stderr)
    print(PASSED, file=sys.stderr)
    sys.stdout.write(req.script)
    return 0
