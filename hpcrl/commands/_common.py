"""Shared pieces of the job commands: argument groups, profile loading, error reporting."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from hpcrl.containers import ContainerError
from hpcrl.jobs import resolve
from hpcrl.jobspec import (
    LOOP_MODULES,
    UPDATE_SPEC,
    JobSpec,
    JobSpecError,
    RunDirError,
    check_resumable,
    default_payload,
)
from hpcrl.payloads import verl
from hpcrl.plotting import PlotError
from hpcrl.preflight import PreflightError
from hpcrl.profile_load import load_profile, replace_slurm
from hpcrl.profiles import ProfileError
from hpcrl.rundir import RunDir, RunFileError, read_job
from hpcrl.slurm import SlurmError
from hpcrl.submission import RequestError, build_request, default_python, default_run_dir, make_spec


def user_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print hpcrl's own errors as one line (`hpcrl: error: ...`) and return status 2."""

    @wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ProfileError, RequestError, RunDirError, JobSpecError, ContainerError,
                SlurmError, PlotError, PreflightError, RunFileError) as exc:
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


NNODES_FROM_ALLOCATION = "trainer.nnodes=${oc.env:HPCRL_NUM_NODES}"
"""The trainer's node count when Slurm may grant fewer nodes than asked (`--nodes MIN-MAX`)."""


def node_count(text: str) -> tuple[int, int | None]:
    """`--nodes`: `N` (exactly N: nodes, no minimum) or `MIN-MAX`."""
    low, dash, high = text.partition("-")
    try:
        nodes, least = (int(high), int(low)) if dash else (int(text), None)
    except ValueError:
        raise RequestError(f"`--nodes {text}` is not a node count; use `N` or `MIN-MAX`, "
                           "e.g. `4` or `3-4`") from None
    if nodes < 1 or (least is not None and not 1 <= least <= nodes):
        raise RequestError(f"`--nodes {text}`: a job needs at least 1 node (and MIN at most MAX)")
    return nodes, least


def elastic_world(profile: Any, overrides: list[str]) -> list[str]:
    """With a node range, the trainer's `trainer.nnodes` follows the nodes granted: added
    unless given as exactly that; a fixed number would not match a smaller allocation."""
    if not profile.slurm.node_range:
        return overrides
    given = [o for o in overrides if o.lstrip("+").split("=", 1)[0] == "trainer.nnodes"]
    if any(o.lstrip("+") != NNODES_FROM_ALLOCATION for o in given):
        raise RequestError(
            f"`{given[-1]}` fixes the trainer's nodes, but the job may resume on "
            f"{profile.slurm.node_range} nodes (`slurm.min_nodes`, `--nodes MIN-MAX`). Fix: leave "
            f"`trainer.nnodes` out (hpcrl passes `{NNODES_FROM_ALLOCATION}`), or ask for exactly "
            "that many nodes")
    return overrides if given else [*overrides, NNODES_FROM_ALLOCATION]


def resumed_job(run_dir: Any) -> JobSpec | None:
    """The job in `run_dir`'s `job.json`; None when unreadable (`prepare_run_dir` then names
    the fault)."""
    try:
        return JobSpec.from_dict(read_job(run_dir))
    except (RunFileError, JobSpecError):
        return None


#: The Slurm settings a command-line flag sets (`--nodes` sets two), which `--resume` keeps from
#: the job when the flag is not given, as it keeps the job's overrides.
RESUMED_FLAGS = {"nodes": ("nodes", "min_nodes"), "time": ("time",), "partition": ("partition",),
                 "exclude_slow": ("exclude_slow",)}


def resumed_slurm(args: argparse.Namespace, site: str, job: JobSpec | None) -> dict[str, Any]:
    """`--resume`: the job's own value of each Slurm setting whose flag this command line leaves
    out, where the job ran on this site (another site's job is refused, naming the difference)."""
    if job is None or job.site != site:
        return {}
    slurm = job.profile.get("slurm", {})
    return {key: slurm[key] for flag, keys in RESUMED_FLAGS.items() if getattr(args, flag, None) is None
            for key in keys if key in slurm}


def verl_payload(profile: Any, python: str, overrides: list[str], run_dir: Any) -> tuple[str, ...]:
    """`--verl`: the user's verl line with what hpcrl fills or refuses (`hpcrl.payloads.verl`)."""
    import os
    from pathlib import Path

    command = [o for o in overrides if "=" not in o and o.lstrip("~") == o]
    if command:
        raise RequestError(f"`--verl` takes verl's overrides after `--`, not the command (found "
                           f"`{command[0]}`); hpcrl runs `python3 -m {verl.MODULE}`. Fix: drop "
                           "everything before the first `key=value`")
    gpus = profile.ray.num_gpus if profile.ray.num_gpus is not None else profile.slurm.gpus_per_node
    try:
        checked = verl.verl_overrides(overrides, Path(os.path.abspath(run_dir)),
                                      profile.slurm.nodes, gpus, profile.slurm.node_range)
    except verl.VerlError as exc:
        raise RequestError(f"`--verl`: {exc}") from None
    return verl.payload(python, checked)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--site/--nodes/--time/--partition/--run-dir/--resume/--command and the payload."""
    add_site(parser)
    parser.add_argument("--nodes", help="number of nodes, or `MIN-MAX`: MAX "
                        "nodes, and after a node died resume on as few as MIN when no spare is "
                        "free (`slurm.nodes`, `slurm.min_nodes`; profile default otherwise)")
    parser.add_argument("--exclude-slow", action="store_true", default=None,
                        help="when the trainer names a node slow and the job can go on without "
                        "it (a spare node is idle, or `--nodes MIN-MAX` allows fewer), checkpoint "
                        "and requeue the job without that node (`slurm.exclude_slow`)")
    parser.add_argument("--time", help="time limit, e.g. `04:00:00` or `1-00:00:00`")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--run-dir", help="run directory (default: a new one under the "
                        "profile's `run_root`)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the job of an existing `--run-dir` (a new Slurm job, "
                        "refused while the run's job is queued or running); without overrides "
                        "after `--` it keeps the job's")
    parser.add_argument(UPDATE_SPEC, dest="update_spec", action="store_true",
                        help="with `--resume`: run the rest of the job with this site, these "
                        "flags and overrides where they differ from its `job.json`")
    parser.add_argument("--command", dest="whole_command", action="store_true",
                        help="the arguments after `--` are the whole command to run in the "
                        "container, not trainer overrides")
    parser.add_argument("--verl", action="store_true",
                        help="run verl itself: the arguments after `--` are overrides of "
                        "`python3 -m verl.trainer.main_ppo` (the verl of the image or venv); "
                        "hpcrl fills the checkpoint directory, nodes and GPUs and saves at stops")
    parser.add_argument("--loop", choices=sorted(LOOP_MODULES), default="sync",
                        help="the trainer's loop: `sync` (colocated, `python -m trainer`), "
                        "`one-step-off` or `fully-async` (verl's recipes on a rollout pool of its own, "
                        "`python -m trainer.one_step_off`, `python -m trainer.fully_async`: "
                        "`actor_rollout_ref.hybrid_engine=false rollout.nnodes=N "
                        "rollout.n_gpus_per_node=G`, the job's nodes are `trainer.nnodes` + `rollout.nnodes`)")
    parser.add_argument("payload", nargs=argparse.REMAINDER,
                        help="after `--`: trainer overrides (e.g. `trainer.nnodes=2`)")


def prepare(args: argparse.Namespace) -> Any:
    """Load the profile, apply overrides, build the request (no side effects)."""
    import os
    from pathlib import Path

    profile = load_profile(site_name(args)).profile
    if args.nodes is not None:  # `N` is exactly N (whatever the profile's minimum), or MIN-MAX
        nodes, least = node_count(args.nodes)
        profile = replace_slurm(profile, nodes=nodes, min_nodes=least or nodes)
    profile = replace_slurm(profile, time=args.time, partition=args.partition,
                            exclude_slow=getattr(args, "exclude_slow", None))
    resumed = resumed_job(Path(args.run_dir).expanduser()) if args.resume and args.run_dir else None
    if kept_slurm := resumed_slurm(args, profile.name, resumed):
        differing = {k: v for k, v in kept_slurm.items() if getattr(profile.slurm, k) != v}
        profile = dataclasses.replace(profile, slurm=dataclasses.replace(profile.slurm, **kept_slurm))
        if differing:
            shown = ", ".join(f"`slurm.{k}` {v}" for k, v in differing.items())
            print(f"hpcrl: note: `--resume` keeps the job's {shown}, not the profile's (a flag given here "
                  f"changes one, with `--update-spec`)", file=sys.stderr)
    python = default_python(profile)
    payload = list(args.payload)
    if payload[:1] == ["--"]:
        payload = payload[1:]
    if args.run_dir is not None and not args.run_dir.strip():
        raise RequestError("`--run-dir` is empty; name a directory, or leave the flag out for a "
                           "new one under the profile's `run_root`")
    if args.resume and not args.run_dir:
        raise RequestError("`--resume` needs `--run-dir RUN`: the run directory of the job to resume "
                           f"(runs are under the profile's `run_root`, {profile.run_root})")
    run_dir = Path(args.run_dir).expanduser() if args.run_dir else default_run_dir(profile)
    if args.resume:
        check_resumable(run_dir)  # the dry run and render say so too, not only the submission
    if resumed is not None and not payload:  # `--resume` without overrides: the job's own payload
        argv, start = resumed.payload, resumed.payload_start
    elif getattr(args, "verl", False):
        if args.whole_command:
            raise RequestError("`--verl` and `--command` name two payloads; pass one of them")
        argv, start = verl_payload(profile, profile.container.python or python, payload,
                                   run_dir), "all-joined"
    elif args.whole_command:
        if not payload:
            raise RequestError("`--command` needs the command after `--`, e.g. "
                               "`hpcrl submit --command -- env`")
        argv, start = tuple(payload), "all-joined"
    else:  # the trainer waits for its nodes (its placement group): start it with the head
        loop = getattr(args, "loop", "sync")
        if loop != "sync" and profile.slurm.node_range:
            raise RequestError(f"`--loop {loop}` places a rollout pool on `rollout.nnodes` of the job's nodes and "
                               f"the trainer on the rest, which a node range ({profile.slurm.node_range}) would "
                               "change at each requeue. Fix: ask for exactly `trainer.nnodes` + `rollout.nnodes` "
                               "nodes (`--nodes N`)")
        argv = default_payload(profile.container.python or python, elastic_world(profile, payload), loop)
        start = "head-alive"
    spec = make_spec(profile, argv, payload_start=start)
    via = getattr(args, "via", "sbatch")
    return profile, build_request(profile, spec, os.path.abspath(run_dir), python, via=via)
