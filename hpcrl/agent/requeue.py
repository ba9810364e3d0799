"""Stop and requeue: what the head's agent decides when the payload asks to be run again.

The payload (the trainer) checkpoints and exits with `REQUEUE_EXIT_CODE` when asked to stop, or
by itself when the job's end time nears. The head's agent then requeues the job from the host
(`scontrol requeue`, which the container may lack), unless `max_requeues` is reached or Slurm
itself ended the job (SIGTERM: preemption, `scontrol requeue`, `scancel`, the time limit; Slurm
requeues preempted and requeued jobs on its own and a cancelled job must stay cancelled).

Everything here is pure except :func:`scontrol_requeue`, the one seam that runs the command.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcrl.slurm import parse_slurm_time, run_slurm, show_job
from hpcrl.slurm_env import JobContext
from trainer.deadline import END_TIME_ENV  # the job's end time, passed to the payload

REQUEUE = "requeue"
NO_SLURM = "no-slurm"
MAX_REACHED = "max-requeues-reached"
ENDED_BY_SLURM = "ended-by-slurm"


@dataclass(frozen=True)
class RequeueDecision:
    """What to do after the payload asked to be requeued."""

    action: str
    """`requeue`, `no-slurm`, `max-requeues-reached` or `ended-by-slurm`."""
    message: str
    """One line for the agent's log and the job summary."""


def requeue_target(ctx: JobContext) -> str:
    """The id `scontrol requeue` needs: `<array job>_<task>` for an array task, else the job id."""
    if ctx.array_job_id and ctx.array_task_id is not None:
        return f"{ctx.array_job_id}_{ctx.array_task_id}"
    return ctx.job_id


def decide_requeue(
    ctx: JobContext,
    max_requeues: int,
    run_dir: str,
    terminated_by: str | None = None,
    preempted: bool = False,
) -> RequeueDecision:
    """Whether the head's agent requeues the job after the payload's requeue status.

    `terminated_by` names the signal with which Slurm ended the job (SIGTERM), if one came;
    `preempted`: Slurm says the job is being preempted and still runs (a partition GraceTime).
    Slurm requeues a preempted job itself only when it outlives the grace time, so one that
    checkpointed in time must be requeued by the agent (regardless of `max_requeues`, which
    bounds the job's own requeues: Slurm's REQUEUE preemption does not count them either).
    """
    resume = f"`hpcrl submit --resume --run-dir {run_dir} ...`"
    if ctx.local:
        return RequeueDecision(
            NO_SLURM,
            "the payload checkpointed and asked to be requeued, but this job does not run under "
            f"Slurm; continue it with {resume}",
        )
    if terminated_by and preempted:
        return RequeueDecision(
            REQUEUE,
            f"preempted within the partition's grace time: Slurm would end job "
            f"{requeue_target(ctx)} without requeueing it; requeueing it",
        )
    if terminated_by:
        return RequeueDecision(
            ENDED_BY_SLURM,
            f"the payload checkpointed after {terminated_by}: Slurm ended the job (preemption, "
            "`scontrol requeue`, `scancel` or the time limit) and requeues it itself when it was "
            "preempted or requeued; the agent does not requeue it again",
        )
    if ctx.restart >= max_requeues:
        return RequeueDecision(
            MAX_REACHED,
            f"max_requeues reached: job {requeue_target(ctx)} ran {ctx.restart + 1} times "
            f"(restart {ctx.restart}, `max_requeues` is {max_requeues}), so it is not requeued "
            f"again. The checkpoint is intact: continue with {resume}, or raise "
            "`slurm.max_requeues` in the site profile",
        )
    return RequeueDecision(
        REQUEUE,
        f"requeueing job {requeue_target(ctx)} (restart {ctx.restart + 1} of at most "
        f"{max_requeues})",
    )


NO_EXCLUSIONS = ("", "(null)", "None")


def merged_exclusions(current: str, lost: Sequence[str]) -> str:
    """`ExcNodeList` for the requeued job: what it already excludes (the user's `--exclude`,
    earlier lost nodes; Slurm hostlist syntax, kept as written) and the nodes just lost."""
    kept = [] if current.strip() in NO_EXCLUSIONS else [current.strip()]
    return ",".join([*kept, *(h for h in dict.fromkeys(lost) if h not in kept)])


def shrunk_nodes(nodes: int, lost: int, spares: int, min_nodes: int | None) -> int | None:
    """The node count a job requeued after losing `lost` of its `nodes` asks for: None (as
    many as now) when `spares` free nodes make up for the lost ones or the run may not shrink
    (`min_nodes` None); else as many as the survivors and the spares, not below `min_nodes`."""
    if min_nodes is None or min_nodes >= nodes:
        return None
    count = max(min_nodes, min(nodes, nodes - lost + spares))
    return count if count < nodes else None


def spared_without(nodes: int, leaving: int, spares: int, min_nodes: int | None) -> str | None:
    """Whether a job of `nodes` nodes can go on without `leaving` of them that still work (slow
    ones): how, when `spares` idle nodes replace them or the run may shrink as after a node loss
    (:func:`shrunk_nodes`); None when it cannot (it would wait in the queue for a spare, which a
    working node does not warrant)."""
    if spares >= leaving:
        return f"{spares} idle spare node(s) can take {'its' if leaving == 1 else 'their'} place"
    count = shrunk_nodes(nodes, leaving, spares, min_nodes)
    if count is None or count > nodes - leaving + spares:  # below `min_nodes`: it would wait
        return None
    return f"the run may go on on {count} of its {nodes} nodes (`slurm.min_nodes` {min_nodes})"


def node_loss_message(lost: Sequence[str], decision: RequeueDecision, excluded: str,
                      shrunk: tuple[int, int] | None = None, why: Mapping[str, str] | None = None) -> str:
    """What the log and the summary say when lost nodes end the job; `shrunk`: (nodes asked
    for now, before); `why`: what happened to each node (by name; `died` where not given)."""
    nodes = ", ".join(f"`{h}`" for h in lost)
    what = (f"node {nodes} died" if not why else
            "; ".join(f"node `{h}` {why.get(h, 'died')}" for h in lost))
    if decision.action != REQUEUE:
        return f"{what}; {decision.message}"
    where = ("on the nodes Slurm gives it next (it waits while the partition has no spare node)"
             if shrunk is None else
             f"on {shrunk[0]} nodes instead of {shrunk[1]} (no spare node was free; "
             "`slurm.min_nodes` allows it), the trainer on as many")
    return (f"{what}; {decision.message}, excluding {nodes} (`ExcNodeList={excluded}`"
            f"); the run resumes from its newest complete checkpoint {where}")


def idle_spares(partition: str, excluded: str) -> int:
    """Idle nodes of `partition` that a job excluding `excluded` (hostlist) could get."""
    idle = set(run_slurm(["sinfo", "-h", "-N", "-t", "idle", "-p", partition, "-o", "%N"]).split())
    if excluded.strip() in NO_EXCLUSIONS:
        return len(idle)
    return len(idle - set(run_slurm(["scontrol", "show", "hostnames", excluded]).split()))


def preempted_in_grace(info: Mapping[str, str]) -> bool:
    """From `scontrol show job`: preemption has begun (`PreemptTime` set) and the job still runs,
    i.e. the partition's GraceTime is running out."""
    preempt = info.get("PreemptTime", "None").strip()
    return info.get("JobState") == "RUNNING" and preempt not in ("", "None", "N/A", "Unknown")


def already_requeued(error_text: str) -> bool:
    """True when `scontrol requeue` failed because Slurm is already requeueing the job."""
    return "pending execution" in error_text.lower()


#: Seconds the agent's own clock waits past the moment Slurm's warning is due before acting in
#: its place: Slurm's periodic timer can send it a few seconds late, and the signal, not the
#: clock, is what the run should record when it comes.
CLOCK_GRACE_S = 3.0


def warning_due(end_time: float | None, lead_s: float, now: float) -> bool:
    """The agent's own clock: Slurm's warning is due `lead_s` before the end; the clock stands
    in for it `CLOCK_GRACE_S` later (Slurm may signal late, or not reach the agent at all)."""
    return end_time is not None and now >= end_time - lead_s + CLOCK_GRACE_S


def caught_signals(proc_status: str) -> set[int]:
    """Signal numbers a process handles, from its `/proc/<pid>/status` text (`SigCgt:` mask)."""
    for line in proc_status.splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split(":", 1)[1].strip(), 16)
            return {n + 1 for n in range(64) if mask >> n & 1}
    return set()


def end_time_from_env(env: Mapping[str, str]) -> float | None:
    """`HPCRL_JOB_END_TIME` (Unix seconds) from `env`, None when unset or not a number."""
    raw = (env.get(END_TIME_ENV) or "").strip()
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def describe_end(end_time: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end_time))
    return f"the job ends at {stamp}, in {end_time - now:.0f} s"


def scontrol_requeue(target: str) -> None:
    """Requeue job `target` with `scontrol requeue` (on the host: the container may lack it)."""
    run_slurm(["scontrol", "requeue", target])


def resize_fields(info: Mapping[str, str], nodes: int, to: int) -> list[str]:
    """The `scontrol update` fields that move a pending job of `nodes` nodes (`info`: its
    `scontrol show job`) to `to` nodes: the node count as min and max, one task per node, and
    its CPUs scaled alike; Slurm keeps the first run's task and CPU totals otherwise and calls
    the smaller job never runnable ("Requested node configuration is not available")."""
    fields = [f"NumNodes={to}-{to}", f"NumTasks={to}"]
    cpus = info.get("NumCPUs", "")
    if cpus.isdigit():
        fields.append(f"NumCPUs={-(-int(cpus) * to // nodes)}")
    return fields


def scontrol_exclude(target: str, nodes: str, resize: Sequence[str] = ()) -> None:
    """Set the (requeued, pending) job's `ExcNodeList` and the `resize` fields (see
    `resize_fields`): Slurm refuses both for a running job, and sends the requeued job's
    processes SIGTERM, this command's too unless shielded."""
    run_slurm(["scontrol", "update", f"JobId={target}", f"ExcNodeList={nodes}", *resize],
              shielded=True)


def scontrol_end_time(target: str) -> float | None:
    """The job's end time from `scontrol show job` (None when Slurm does not say)."""
    return parse_slurm_time(show_job(target).get("EndTime", ""))
