"""Shared pieces of the job commands: argument groups, profile loading, error reporting."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from hpcrl.containers import ContainerError
from hpcrl.jobs import resolve
from hpcrl.jobspec import JobSpecError, RunDirError, default_payload
from hpcrl.plotting import PlotError
from hpcrl.preflight import PreflightError
from hpcrl.profiles import ProfileError, load_profile, replace_slurm
from hpcrl.rundir import RunDir
from hpcrl.slurm import SlurmError
from hpcrl.submission import RequestError, build_request, default_python, default_run_dir, make_spec


def user_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print hpcrl's own errors as one line (`hpcrl: error: ...`) and return status 2."""

    @wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ProfileError, RequestError, RunDirError, JobSpecError, ContainerError,
                SlurmError, PlotError, PreflightError) as exc:
            print(f"hpcrl: error: {exc}", file=sys.stderr)
            return 2

    return run


def run_dir_of(arg: str) -> Any:
    """The run directory named by `arg`: a directory holding `job.json`, or a job id that
    `scontrol` still knows."""
    from pathlib import Path

    path = Path(arg).expanduser()
    if path.is_dir():
        if not RunDir(path).looks_like_one():
            raise SlurmError(f"`{path}` is not a run directory (no `job.json`, no "
                             "`metrics.jsonl`); name the directory `hpcrl submit` printed")
        return path.absolute()
    if "/" in arg:
        raise SlurmError(f"run directory `{arg}` does not exist")
    ref = resolve(arg)
    if ref.run_dir is None:
        raise SlurmError(f"cannot find the run directory of job {arg}; name the run directory")
    return ref.run_dir


def add_site(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", default=None,
                        help="site profile (`hpcrl sites`); default: $HPCRL_SITE or `local`")


def site_name(args: argparse.Namespace) -> str:
    import os

    return str(args.site or os.environ.get("HPCRL_SITE") or "local")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--site/--nodes/--time/--partition/--run-dir/--resume/--command and the payload."""
    add_site(parser)
    parser.add_argument("--nodes", type=int, help="number of nodes (profile default otherwise)")
    parser.add_argument("--time", help="time limit, e.g. `04:00:00` or `1-00:00:00`")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--run-dir", help="run directory (default: a new one under the "
                        "profile's `run_root`)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse an existing `--run-dir` (continue that job)")
    parser.add_argument("--command", dest="whole_command", action="store_true",
                        help="the arguments after `--` are the whole command to run in the "
                        "container, not trainer overrides")
    parser.add_argument("payload", nargs=argparse.REMAINDER,
                        help="after `--`: trainer overrides (e.g. `trainer.nnodes=2`)")


def prepare(args: argparse.Namespace) -> Any:
    """Load the profile, apply overrides, build the request (no side effects)."""
    import os
    from pathlib import Path

    profile = load_profile(site_name(args)).profile
    if args.nodes is not None and args.nodes < 1:
        raise RequestError(f"`--nodes {args.nodes}`: a job needs at least 1 node")
    profile = replace_slurm(profile, nodes=args.nodes, time=args.time, partition=args.partition)
    python = default_python(profile)
    payload = list(args.payload)
    if payload[:1] == ["--"]:
        payload = payload[1:]
    if args.whole_command:
        if not payload:
            raise RequestError("`--command` needs the command after `--`, e.g. "
                               "`hpcrl submit --command -- env`")
        argv, start = tuple(payload), "all-joined"
    else:  # the trainer waits for its nodes (its placement group): start it with the head
        argv, start = default_payload(profile.container.python or python, payload), "head-alive"
    if args.run_dir is not None and not args.run_dir.strip():
        raise RequestError("`--run-dir` is empty; name a directory, or leave the flag out for a "
                           "new one under the profile's `run_root`")
    run_dir = Path(args.run_dir).expanduser() if args.run_dir else default_run_dir(profile)
    spec = make_spec(profile, argv, payload_start=start)
    via = getattr(args, "via", "sbatch")
    return profile, build_request(profile, spec, os.path.abspath(run_dir), python, via=via)
