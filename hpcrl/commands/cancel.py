"""`hpcrl cancel [--now] JOB|RUN`."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import socket
import time
from pathlib import Path

from hpcrl import rundir, runstate
from hpcrl.commands._common import user_errors
from hpcrl.jobs import resolve
from hpcrl.slurm import SlurmError, check_job_id, run_slurm, show_job

HELP = ("cancel a job (job id or run directory): a running job checkpoints first, then ends "
        "(`--now`: at once, like `scancel`)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Slurm job id or run directory")
    parser.add_argument("--now", action="store_true",
                        help="end the job at once, without a checkpoint (the steps since the "
                             "last checkpoint are lost)")


def stop_local(run_dir: object, now: bool = False) -> str:
    """A stop request to the head agent of the run's latest restart, once it is sure the pid is
    that agent (this host, the same process start): SIGTERM, which the agent forwards to the
    trainer (it checkpoints and exits); `now`: SIGINT twice (the trainer aborts at once)."""
    run = Path(str(run_dir))
    info = runstate.running_restart(run)
    if info is None or info.head_pid is None:
        raise SlurmError(f"the local run `{run}` is not running (`hpcrl status {run}`)")
    other = runstate.same_process(info.head_pid, info.head_host, info.head_start)
    if other is not None:
        raise SlurmError(f"the local run `{run}` recorded its agent as pid {info.head_pid}, but "
                         f"{other}: not signalling it. Stop the run where it runs, or remove "
                         "the stale run")
    for sig in (signal.SIGINT, signal.SIGINT) if now else (signal.SIGTERM,):
        os.kill(info.head_pid, sig)
    if now:
        return f"stopped the local run {run} (run {info.index}, agent pid {info.head_pid}) at once"
    return (f"asked the local run {run} (run {info.index}, agent pid {info.head_pid}) to stop; "
            "the trainer finishes its step and checkpoints")


def request_checkpoint(run_dir: Path, job: str) -> None:
    """`RUN/cancel.json` naming `job`: its head agent asks the trainer to checkpoint and stop,
    then cancels the job (`hpcrl.agent.stop.cancel_request`)."""
    path = rundir.RunPaths(run_dir, 0).cancel
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"job_id": job, "by": f"{getpass.getuser()}@{socket.gethostname()}",
                               "time": time.time()}))
    tmp.replace(path)


@user_errors
def run(args: argparse.Namespace) -> int:
    ref = resolve(args.job)
    if str(ref.job_id).startswith("local-") and ref.run_dir is not None:
        print(stop_local(ref.run_dir, args.now))
        return 0
    job = check_job_id(str(ref.job_id))
    state = show_job(job).get("JobState", "") if not args.now else ""
    if state == "RUNNING" and ref.run_dir is not None:
        request_checkpoint(Path(ref.run_dir), job)
        print(f"asked job {job} to checkpoint and stop: the trainer finishes its step and saves, "
              f"then the job is cancelled (`hpcrl cancel --now {job}` ends it at once, losing the "
              "steps since the last checkpoint)")
        return 0
    run_slurm(["scancel", job])
    print(f"cancelled job {job}" + (f" ({state.lower()}: nothing to checkpoint)" if state else ""))
    return 0
