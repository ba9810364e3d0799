"""`hpcrl logs JOB [-f] [--node N]`."""

from __future__ import annotations

import argparse
import sys

from hpcrl.commands._common import user_errors

HELP = "print (or follow with -f) a job's logs: batch script and every node, or one node"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    parser.add_argument("--node", type=int, help="only this node (0 = the head)")


@user_errors
def run(args: argparse.Namespace) -> int:
    import os

    from hpcrl.jobs import log_files, resolve
    from hpcrl.slurm import SlurmError

    ref = resolve(args.job)
    if ref.run_dir is None or ref.job_id is None:
        raise SlurmError(f"cannot find the run directory of job {args.job}; name the run "
                         "directory instead")
    files = log_files(ref.run_dir, ref.job_id, args.node)
    if args.follow:
        sys.stdout.flush()
        os.execvp("tail", ["tail", "-n", "+1", "-F", *map(str, files)])
    for f in files:
        if len(files) > 1:
            print(f"==> {f} <==")
        if f.exists():
            sys.stdout.write(f.read_text(errors="replace"))
        else:
            print(f"(not written yet: {f})")
    return 0
