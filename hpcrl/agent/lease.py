"""One job per run directory: the head's lease on `RUN/lease.json`.

Two jobs in one run directory would overwrite each other's token, end each other with their stop
requests and delete each other's checkpoint temporaries. The head of every run takes the lease
before it starts anything: it creates the file exclusively (a hard link, atomic also on NFS),
naming its job, run, host and pid. A lease naming the same job (a requeued run: the job id stays)
is taken over. A lease of another job is taken over only once that job is over (Slurm no longer
lists it, or a local run's process is gone); while it may still run, the head refuses, naming it.
The head gives the lease back when its run ends.

Slurm is asked through :func:`hpcrl.slurm.queue_entries` (the one `squeue` seam).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcrl.agent.rendezvous import atomic_write_json
from hpcrl.rundir import RunDir, read_lease
from hpcrl.runstate import pid_alive
from hpcrl.slurm import SlurmError, queue_entries
from hpcrl.slurm_env import JobContext


class LeaseError(RuntimeError):
    """Another job holds the run directory, or may still."""


def holder_runs(holder: Mapping[str, Any], host: str) -> str | None:
    """Why the lease's holder may still run (Slurm's state of it, its live process), None once
    it is known to be over. `host`: where this agent runs (a local run's pid means something
    only there)."""
    job, where, pid = str(holder.get("job_id")), holder.get("host"), holder.get("pid")
    if not job.split("_")[0].isdigit():  # a local run (`local-...`): its agent's process
        if where != host:
            return (f"it ran on host `{where}`, where this node cannot tell whether it still "
                    "runs")
        return f"its agent (pid {pid}) still runs" if isinstance(pid, int) and pid_alive(pid) else None
    try:
        entries = queue_entries(job)
    except SlurmError as exc:
        return f"Slurm could not say whether it still runs ({exc})"
    return f"Slurm lists it as {entries[0].state}" if entries else None


def take_lease(run_dir: Path, ctx: JobContext,
               runs: Callable[[Mapping[str, Any], str], str | None] = holder_runs) -> str | None:
    """Take the run directory's lease for this run of the job; returns a note when it was taken
    over from an earlier job (None otherwise). Raises :class:`LeaseError` while another job may
    still run there."""
    lease = RunDir(run_dir).lease
    mine = {"job_id": ctx.job_id, "run": ctx.run, "host": ctx.hostname, "pid": os.getpid(),
            "time": time.time()}
    tmp = lease.with_name(f".{lease.name}.{os.getpid()}.{secrets.token_hex(3)}")
    atomic_write_json(tmp, mine)
    try:
        if _link(tmp, lease):
            return None
        held = read_lease(run_dir) or {}
        if held.get("job_id") == ctx.job_id:  # this job's earlier run: a requeue keeps the id
            os.replace(tmp, lease)
            return None
        why = runs(held, ctx.hostname) if held.get("job_id") is not None else None
        if why:
            raise LeaseError(_held_message(run_dir, held, why))
        _move_aside(lease, held)
        if not _link(tmp, lease):  # another job's head took it over first
            raise LeaseError(_held_message(run_dir, read_lease(run_dir) or {},
                                           "it took the lease over a moment ago"))
        return (f"took over the run directory's lease from job {held.get('job_id')}, "
                "which no longer runs")
    finally:
        tmp.unlink(missing_ok=True)


def _link(tmp: Path, lease: Path) -> bool:
    """Create `lease` as `tmp`, exclusively (a hard link: atomic also on NFS)."""
    try:
        os.link(tmp, lease)
        return True
    except FileExistsError:
        return False


def _move_aside(lease: Path, held: Mapping[str, Any]) -> None:
    """Remove the stale lease `held` by renaming it (one head wins); a lease that is no longer
    `held` (taken meanwhile) is put back."""
    aside = lease.with_name(f".{lease.name}.stale.{os.getpid()}.{secrets.token_hex(3)}")
    try:
        os.rename(lease, aside)
    except FileNotFoundError:
        return  # another head moved it first; the exclusive link decides
    try:
        moved = json.loads(aside.read_text())
    except (OSError, ValueError):
        moved = {"job_id": None}
    if isinstance(moved, dict) and moved.get("job_id") is not None and moved != dict(held):
        _link(aside, lease)
    aside.unlink(missing_ok=True)


def _held_message(run_dir: Path, held: Mapping[str, Any], why: str) -> str:
    job, lease = held.get("job_id"), RunDir(run_dir).lease
    return (f"run directory `{run_dir}` is held by job {job} (`{lease}`: run {held.get('run')} "
            f"on `{held.get('host')}`), and {why}; one job per run directory. Fix: wait until "
            f"job {job} ends, or stop it (`hpcrl cancel {job}`), then `hpcrl submit --resume`; "
            f"if it is over, remove `{lease}`")


def release_lease(run_dir: Path, ctx: JobContext) -> None:
    """Give the lease back at the end of this run (only if it still names this run)."""
    held = read_lease(run_dir)
    if held and held.get("job_id") == ctx.job_id and held.get("run") == ctx.run:
        RunDir(run_dir).lease.unlink(missing_ok=True)
