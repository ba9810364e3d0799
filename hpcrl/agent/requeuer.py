"""The head's requeue decision: after the payload asked to be requeued (or the warning came
before it started), decide with :func:`~hpcrl.agent.requeue.decide_requeue` and requeue the job
from the host, once: after the teardown, or at once when the job's end is too near to wait.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.agent import requeue as rq
from hpcrl.agent.jobfile import AgentJob
from hpcrl.agent.node import Outcome, state_writer
from hpcrl.agent.stop import Deadline, SignalInbox, StopControl
from hpcrl.runstate import REQUEUE_DECIDED, REQUEUE_DONE
from hpcrl.slurm import SlurmError, parse_slurm_time, show_job
from hpcrl.slurm_env import JobContext

REQUEUE_FIRST_S = 60.0
"""With less time than this before the job's end, requeue before the teardown, not after: the
teardown (Ray stopped on every node, containers removed) can take 10-20 s on a loaded node, and
Slurm enforces the time limit on its own clock (its periodic check), so a requeue that comes
after the limit is killed with the job, which then ends TIMEOUT and never runs again."""


@dataclass
class Requeuer:
    """Decides and performs the requeue of this job; `requeue` is the one seam that asks Slurm."""

    ctx: JobContext
    job: AgentJob
    run_dir: Path
    inbox: SignalInbox
    log: logging.Logger
    stop: StopControl | None = None
    """The head's stop control (None on a worker, which requeues only for a lost head)."""
    deadline: Deadline | None = None

    def after_request(self, what: str, status: int) -> Outcome:
        """Decide with `decide_requeue`; the outcome names the decision and, when the job is to
        be requeued after the teardown, carries that requeue as `then` (Slurm ends every
        process of the job at once and kills what is left `KillWait` later)."""
        terminated_by = self.terminated_by
        preempted = bool(terminated_by) and not self.ctx.local and self._preempted()
        decision = rq.decide_requeue(
            self.ctx, self.job.max_requeues, str(self.run_dir), terminated_by, preempted
        )
        message, then = decision.message, None
        if decision.action == rq.REQUEUE:
            target = rq.requeue_target(self.ctx)
            left = self.deadline.left() if self.deadline else None
            if left is not None and left < REQUEUE_FIRST_S:
                message = f"{message}; {self.requeue_now(target)}"
            else:
                then = functools.partial(self.requeue_now, target)
        log = self.log.error if decision.action == rq.MAX_REACHED else self.log.info
        log("%s", message)
        state_writer(self.run_dir, self.ctx).append(
            REQUEUE_DECIDED, action=decision.action, message=message, deferred=then is not None)
        return Outcome(f"{what}; {message}", status, self.ctx.hostname, then)

    @property
    def terminated_by(self) -> str | None:
        return self.stop.terminated_by if self.stop else None

    def after_node_loss(self, lost: list[str], what: str, why: Mapping[str, str] | None = None,
                        status: int = 1) -> Outcome:
        """Nodes died or were cut off: the job is requeued at once, as after a requeue request
        (same decision and `max_requeues`), with the lost nodes added to the job's
        `ExcNodeList` once it is pending again (Slurm refuses that for a running job), so that
        the rerun resumes on other nodes, or on fewer (`slurm.min_nodes`) when no spare is
        free. The last complete checkpoint stands; nothing could be saved, since a rank is
        gone. `why`: what happened to each node, for the message (`died` where not given).
        Also the requeue without slow nodes (:mod:`hpcrl.agent.slow`), after the payload
        checkpointed (`status`: its exit status)."""
        decision = rq.decide_requeue(self.ctx, self.job.max_requeues, str(self.run_dir),
                                     self.terminated_by)
        excluded, count, info = "", None, {}
        if decision.action == rq.REQUEUE:
            info = self._job_info()
            excluded = rq.merged_exclusions(info.get("ExcNodeList", ""), lost)
            count = self._shrunk(info.get("Partition", ""), excluded, len(lost))
        shrunk = None if count is None else (count, self.ctx.num_nodes)
        message = rq.node_loss_message(lost, decision, excluded, shrunk, why)
        requeue = decision.action == rq.REQUEUE
        (self.log.info if requeue else self.log.error)("%s", message)
        state_writer(self.run_dir, self.ctx).append(
            REQUEUE_DECIDED, action=decision.action, message=message, deferred=False,
            lost_nodes=lost, exclude=excluded, nodes=count or self.ctx.num_nodes)
        if not requeue:
            return Outcome(f"{what}; {message}", status, self.ctx.hostname)
        # at once, not after the teardown: nothing is left to save, and Slurm requeues the job
        # itself once it marks a dead node down (`SlurmdTimeout`), without the exclusion
        resize = () if count is None else rq.resize_fields(info, self.ctx.num_nodes, count)
        done = self.requeue_now(rq.requeue_target(self.ctx), excluded, resize)
        return Outcome(f"{what}; {message}; {done}", status, self.ctx.hostname)

    def _job_info(self) -> dict[str, str]:
        """`scontrol show job`: its `ExcNodeList` (the user's `--exclude` and earlier lost
        nodes) and `Partition`; empty when Slurm does not answer."""
        try:
            return show_job(self.ctx.job_id)
        except (SlurmError, OSError) as exc:
            self.log.info("cannot read the job's ExcNodeList: %s", exc)
            return {}

    def _shrunk(self, partition: str, excluded: str, lost: int) -> int | None:
        """Fewer nodes for the rerun when no spare is free and `slurm.min_nodes` allows it."""
        if self.job.min_nodes is None or self.job.min_nodes >= self.ctx.num_nodes:
            return None
        spares = self._spares(partition, excluded)
        return rq.shrunk_nodes(self.ctx.num_nodes, lost, spares, self.job.min_nodes)

    def _spares(self, partition: str, excluded: str) -> int:
        try:
            return rq.idle_spares(partition, excluded) if partition else 0
        except (SlurmError, OSError, subprocess.SubprocessError) as exc:
            self.log.info("cannot count the idle nodes of partition %s: %s", partition, exc)
            return 0

    def spared(self, nodes: Sequence[str]) -> tuple[str | None, str]:
        """Whether the job can go on without `nodes`, which still work (slow ones): how (None:
        it cannot), and the `ExcNodeList` it would have (the user's `--exclude` kept)."""
        if self.ctx.local:
            return None, ""
        info = self._job_info()
        excluded = rq.merged_exclusions(info.get("ExcNodeList", ""), nodes)
        spares = self._spares(info.get("Partition", ""), excluded)
        return rq.spared_without(self.ctx.num_nodes, len(nodes), spares, self.job.min_nodes), excluded

    def requeue_now(self, target: str, exclude: str | None = None,
                    resize: Sequence[str] = ()) -> str:
        """Requeue `target` and, with `exclude`, set its `ExcNodeList` (and the `resize` fields,
        its node count) once it is pending; returns what happened (also in the state file)."""
        done, requeued = self._requeue_now(target)
        if exclude and (requeued or signal.SIGTERM in self.inbox.noted):
            # SIGTERM meanwhile: Slurm may have requeued the job itself (a node it marked down)
            done += "; " + self._exclude(target, exclude, resize)
        state_writer(self.run_dir, self.ctx).append(REQUEUE_DONE, target=target, message=done)
        return done

    def _requeue_now(self, target: str) -> tuple[str, bool]:
        if signal.SIGTERM in self.inbox.noted and not self.terminated_by:
            return (f"not requeueing job {target}: SIGTERM arrived meanwhile (`scancel`, "
                    "preemption or `scontrol requeue`); Slurm decides whether it runs again"), False
        try:
            self.requeue(target)
        except (SlurmError, OSError, subprocess.SubprocessError) as exc:
            if rq.already_requeued(str(exc)):
                return f"Slurm is already requeueing job {target}", True
            self.log.error("could not requeue job %s: %s", target, exc)
            return f"could not requeue job {target}: {exc}", False
        return (
            f"requeued job {target} with `scontrol requeue` (restart {self.ctx.restart + 1} of "
            f"at most {self.job.max_requeues})"
        ), True

    def _exclude(self, target: str, nodes: str, resize: Sequence[str]) -> str:
        count = "".join(f" {field}" for field in resize)
        try:
            rq.scontrol_exclude(target, nodes, resize)
        except (SlurmError, OSError, subprocess.SubprocessError) as exc:
            self.log.error("could not set ExcNodeList=%s%s on job %s: %s", nodes, count, target,
                           exc)
            return (f"could not exclude {nodes} ({exc}); the rerun may land on the lost node: "
                    f"`scontrol update JobId={target} ExcNodeList={nodes}{count}` while it is "
                    "pending")
        return f"set `ExcNodeList={nodes}`" + (f" and `{count.strip()}`" if count else "")

    def requeue(self, target: str) -> None:
        """The one place that requeues the job (on the host, never in the container)."""
        rq.scontrol_requeue(target)

    def _preempted(self) -> bool:
        """Whether Slurm is preempting the job with a grace time (it then ends the job without
        requeueing it if it stops in time); the job's new end time becomes the deadline."""
        try:
            info = show_job(self.ctx.job_id)
        except (SlurmError, OSError) as exc:
            self.log.info("cannot ask Slurm about the job: %s", exc)
            return False
        if not rq.preempted_in_grace(info):
            return False
        if self.deadline is not None:
            self.deadline.end_time = parse_slurm_time(info.get("EndTime", "")) or self.deadline.end_time
        return True

