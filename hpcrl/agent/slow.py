"""Slow nodes: what the head does when the trainer names a node slow (:mod:`trainer.stragglers`,
a `slow` diagnosis in the trainer's run directory).

Without `slurm.exclude_slow` (`hpcrl submit --exclude-slow`) the head names the node in its log
and the run goes on. With it, when the job can go on without the node (an idle spare node, or
`slurm.min_nodes` allows fewer: :func:`hpcrl.agent.requeue.spared_without`), the head asks the
payload to checkpoint and stop, and then requeues the job as after a node loss
(:meth:`hpcrl.agent.requeuer.Requeuer.after_node_loss`: the node joins the job's `ExcNodeList`,
the user's `--exclude` kept). When it cannot, the node stays and the log says why: a job that
would wait in the queue for a spare node is worse off than one that runs slowly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hpcrl.agent.node import Outcome, state_writer
from hpcrl.agent.requeuer import Requeuer
from hpcrl.agent.stop import StopControl
from hpcrl.diagnosis import as_job_nodes, slow_nodes
from hpcrl.runreport import trainer_dirs

__all__ = ["SLOW_LOOK_S", "SLOW_NODES", "SlowNodes"]

SLOW_LOOK_S = 5.0
"""How often the head reads the trainer's diagnoses for slow nodes (one small file on the shared
file system; the trainer names a node only after `trainer.watchdog.slow_steps` steps)."""

SLOW_NODES = "slow_nodes"
"""State-file event: the trainer named nodes slow, and what the head does about it."""


@dataclass
class SlowNodes:
    """The nodes the trainer named slow in this run, and the head's answer (see the module)."""

    requeuer: Requeuer
    """Its job, context, run directory and log, and the requeue as after a node loss."""
    started: float
    """This run's start: a diagnosis written before it is an earlier run's."""
    excluding: list[str] = field(default_factory=list)
    """The nodes the payload was asked to stop for, to be excluded at the requeue."""
    reason: str | None = None
    """The stop request asked for them (None: none was)."""
    seen: set[str] = field(default_factory=set)
    _looked: float = 0.0

    def check(self, stop: StopControl) -> None:
        """Every `SLOW_LOOK_S`: act on nodes the trainer named slow since the last look."""
        now = time.monotonic()
        if now - self._looked < SLOW_LOOK_S:
            return
        self._looked = now
        try:
            named = slow_nodes(trainer_dirs(self.requeuer.run_dir)[0], since=self.started)
        except (OSError, ValueError):
            return
        new = [h for h in named if h not in self.seen]
        self.seen.update(new)
        ctx, log = self.requeuer.ctx, self.requeuer.log
        hosts, strangers = as_job_nodes(new, ctx.nodes)
        if strangers:
            log.warning("the trainer named host(s) %s slow, which are no node of this job (%s): not excluded",
                        ", ".join(strangers), ", ".join(ctx.nodes))
        if hosts:
            self._act(hosts, stop)

    def _act(self, hosts: list[str], stop: StopControl) -> None:
        names = ", ".join(f"`{h}`" for h in hosts)
        said = f"the trainer named node(s) {names} slow (`hpcrl status` shows why)"
        if not self.requeuer.job.exclude_slow:
            self._note(hosts, "kept", f"{said}; the run goes on with them. `hpcrl submit --exclude-slow` "
                       "(profile `slurm.exclude_slow`) requeues the job without a slow node when a spare is free")
            return
        if stop.reason is not None:
            self._note(hosts, "kept", f"{said}; the payload is already stopping ({stop.reason}): not excluded")
            return
        how, excluded = self.requeuer.spared(self.excluding + hosts)
        if how is None:
            self._note(hosts, "kept", f"{said}; the run goes on with them: no spare node is idle in the "
                       "partition and `slurm.min_nodes` (`--nodes MIN-MAX`) allows no fewer nodes")
            return
        reason = f"{said}, `--exclude-slow`: {how}"
        stop.ask(reason)
        if stop.reason == reason:
            self.excluding += hosts
            self.reason = reason
            self._note(hosts, "exclude", f"{reason}; requeueing without them (`ExcNodeList={excluded}`) "
                       "after the checkpoint")

    def _note(self, hosts: list[str], action: str, message: str) -> None:
        if action == "kept":  # a stop request says itself in the log
            self.requeuer.log.warning("%s", message)
        state_writer(self.requeuer.run_dir, self.requeuer.ctx).append(SLOW_NODES, nodes=hosts, action=action,
                                                                      message=message)

    def requeue(self, stop: StopControl, status: int, cause: str) -> Outcome | None:
        """After the payload checkpointed for this stop request: requeue the job without the
        slow nodes, as after a node loss; None when the payload stopped for another reason."""
        if not self.excluding or stop.reason != self.reason:
            return None
        why = {h: "is slow (the trainer named it; `--exclude-slow`)" for h in self.excluding}
        return self.requeuer.after_node_loss(self.excluding, f"{cause}: checkpointed", why, status)
