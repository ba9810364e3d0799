"""`hpcrl logs JOB|RUN [-f] [--node N] [--restart R] [--payload]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcrl.commands._common import run_dir_of, user_errors
from hpcrl.jobs import log_files, resolve
from hpcrl.rundir import RunPaths, restart_indices
from hpcrl.runstate import AGENT_STARTED, read_state
from hpcrl.slurm import SlurmError

HELP = ("print (or follow with -f) a job's logs: batch script and every node, one node, or one "
        "run's agent and trainer logs")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    parser.add_argument("--node", type=int, help="only this node (0 = the head)")
    parser.add_argument("--restart", help="the node agents' logs of run R of the job (0 = first "
                        "run, `last` = the latest) instead of the whole job's node output")
    parser.add_argument("--payload", action="store_true",
                        help="only the trainer's output (of `--restart`, default the latest run)")


def restart_logs(run_dir: Path, restart: str | None, node: int | None, payload: bool
                 ) -> list[Path]:
    """The agent logs (one per node, or `node`) and the trainer's log of one run of the job."""
    found = restart_indices(run_dir)
    if not found:
        raise SlurmError(f"`{run_dir}` has no run yet (no `<N>/` directory); the job has not "
                         "started, see `hpcrl status`")
    if restart in (None, "last"):
        index = found[-1]
    elif restart.isdigit() and int(restart) in found:
        index = int(restart)
    else:
        raise SlurmError(f"`--restart {restart}`: this run directory has runs "
                         f"{', '.join(map(str, found))}; pass one of them or `last`")
    paths = RunPaths(run_dir, index)
    if payload:
        return [paths.payload_log]
    started = sorted({r["rank"] for r in read_state(run_dir, index) if r["event"] == AGENT_STARTED})
    if node is not None and started and node not in started:
        raise SlurmError(f"`--node {node}`: the agents of run {index} were nodes "
                         f"{', '.join(map(str, started))} (the state file); pass one of them")
    return paths.agent_logs(node) + ([paths.payload_log] if node in (None, 0) else [])


def job_logs(arg: str, node: int | None) -> list[Path]:
    ref = resolve(arg)
    if ref.run_dir is None or ref.job_id is None:
        raise SlurmError(f"cannot find the run directory of job {arg}; name the run "
                         "directory instead")
    return log_files(ref.run_dir, ref.job_id, node)


@user_errors
def run(args: argparse.Namespace) -> int:
    import os

    if args.restart is not None or args.payload:
        files = restart_logs(run_dir_of(args.job), args.restart, args.node, args.payload)
    else:
        files = job_logs(args.job, args.node)
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
