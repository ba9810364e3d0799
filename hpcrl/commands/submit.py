"""`hpcrl submit`: submit a job through submitit (default) or as the rendered script."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hpcrl.commands._common import add_job_arguments, prepare, user_errors

HELP = "submit a job (`--dry-run` prints exactly what would be submitted)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be submitted; submit and create nothing")
    parser.add_argument("--via", choices=["submitit", "sbatch"], default="submitit",
                        help="submit through submitit (default) or the rendered sbatch script")
    add_job_arguments(parser)


@user_errors
def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.jobspec import prepare_run_dir
    from hpcrl.submission import dry_run_text, submit

    profile, req = prepare(args)
    if args.dry_run:
        text = dry_run_text(req)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    preflight(args, profile, req)
    prepare_run_dir(Path(req.run_dir), req.spec, resume=args.resume)
    done = submit(req)
    if done.via != "local":  # a local run printed its own summary
        for line in done.lines():
            print(line)
    return done.exit_status or 0


def preflight(args: argparse.Namespace, profile: Any, req: Any) -> None:
    """Stop before anything is created when the job cannot work (see `hpcrl.preflight`)."""
    from pathlib import Path

    from hpcrl import preflight as pf

    pf.report(pf.check_scheduler(profile.name, profile.scheduler), fatal=True)
    if args.whole_command or args.resume:
        return
    problems = pf.check_trainer_job(list(req.spec.payload[3:]), Path(req.run_dir))
    pf.report(problems, fatal=profile.scheduler == "local")
