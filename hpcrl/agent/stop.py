"""Stop: signals reach the agent, become a stop request to the payload, which checkpoints and
exits; and the clock that says when the job's time is nearly up.

Signal handlers only note the signal in a :class:`SignalInbox`; the agent's loops act on it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.agent import requeue as rq
from hpcrl.agent.jobfile import AgentJob
from hpcrl.agent.procs import Child
from hpcrl.rundir import RunPaths
from hpcrl.runreport import find_metrics, latest_checkpoint, read_metrics
from hpcrl.runtimes import get as runtime
from hpcrl.slurm import SlurmError, kill_wait_s
from hpcrl.slurm_env import JobContext

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CANCEL_LOOK_S = 1.0
"""How often the head looks for `hpcrl cancel`'s request (one file look on the shared file system)."""
PAYLOAD_ARM_S = 30.0
"""A payload that does not handle the stop signal after this long gets it anyway."""


@dataclass
class SignalInbox:
    """The signals that reached the agent and are not yet acted on, oldest first."""

    noted: list[int] = field(default_factory=list)
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        """Note every forwarded signal from now on (until :meth:`restore`)."""
        self._previous = {sig: signal.signal(sig, self._note) for sig in FORWARDED_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, _frame: object) -> None:
        self.noted.append(signum)

    def take(self) -> list[int]:
        """The noted signals, which are then no longer pending."""
        taken = []
        while self.noted:  # a handler may append meanwhile: pop, never clear
            taken.append(self.noted.pop(0))
        return taken

    def stopping(self) -> int | None:
        """The first pending signal that asks the job to end (SIGTERM, SIGINT), if any."""
        return next((s for s in STOPPING_SIGNALS if s in self.noted), None)


def cancel_request(paths: RunPaths, job_id: str) -> str | None:
    """What `hpcrl cancel` asked of job `job_id`, if it did (a request naming another job, an
    earlier one of this run directory, is not this job's)."""
    try:
        request = json.loads(paths.cancel.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(request, dict) or str(request.get("job_id")) != job_id:
        return None
    return f"`hpcrl cancel` by {request.get('by', 'someone')}"


def sigterm_note(run_dir: Path, kill_wait: int | None) -> str:
    """What a SIGTERM to the job means for the run: the payload saves after its current step if
    that ends before Slurm's SIGKILL; otherwise the steps after the newest checkpoint are
    redone (at most `save_freq`)."""
    newest = latest_checkpoint(run_dir)
    logged = max((r["step"] for r in read_metrics(find_metrics(run_dir))), default=0)
    kill = f"KillWait ({kill_wait} s)" if kill_wait is not None else "Slurm's KillWait"
    where = (f"the newest checkpoint, step {newest[0]}" if newest else "no checkpoint yet: the start")
    redo = logged + 1 - (newest[0] if newest else 0)
    return (f"SIGTERM: the job is ending (cancel, requeue or preemption); Slurm kills every "
            f"process left {kill} later. Ray's processes block SIGTERM: the payload saves after its current step "
            f"(step {logged + 1}) if that ends in time, and nothing is redone; if not, the next run "
            f"resumes from {where}, and redoes {redo} step(s) (at most `trainer.save_freq`)")


@dataclass
class Deadline:
    """When Slurm ends the job (None: no known end). Preemption may move it earlier."""

    end_time: float | None

    @classmethod
    def learn(cls, ctx: JobContext, env: Mapping[str, str], job: AgentJob,
              log: logging.Logger) -> Deadline:
        """`SLURM_JOB_END_TIME` (or, locally, the end-time variable), else `scontrol show job`."""
        end = ctx.end_time or (rq.end_time_from_env(env) if ctx.local else None)
        if end is None and not ctx.local:
            try:
                end = rq.scontrol_end_time(ctx.job_id)
            except (SlurmError, OSError) as exc:
                log.info("cannot read the job's end time from Slurm: %s", exc)
        if end is not None:
            log.info("%s; the payload is asked to stop %.0f s before",
                     rq.describe_end(end, time.time()), job.signal_lead_s)
        return cls(end)

    def left(self) -> float | None:
        """Seconds before the end, None without a known end."""
        return None if self.end_time is None else self.end_time - time.time()


@dataclass
class StopControl:
    """The head's stop request to the payload: why it was asked (`reason`), whether Slurm
    ended the job (`terminated_by`), and the stop signal waiting for the payload to handle it."""

    job: AgentJob
    paths: RunPaths
    inbox: SignalInbox
    deadline: Deadline
    log: logging.Logger
    reason: str | None = None
    """Why the payload was asked to stop (warning, clock, SIGTERM); None while it was not."""
    terminated_by: str | None = None
    """`SIGTERM` once Slurm (or anyone) asked the job to end; the agent then never requeues."""
    local: bool = False
    """Not a Slurm job (`scheduler: local`): no `KillWait` to ask for."""
    job_id: str = ""
    cancelled: str | None = None
    """Why `hpcrl cancel` ended the job (it asked for a checkpoint first); None while it did not."""
    _pending: int | None = None
    _cancel_looked: float = 0.0

    def check_cancel(self) -> str | None:
        """`hpcrl cancel`'s request for this job (`RUN/cancel.json`, looked at every
        `CANCEL_LOOK_S`): the payload is asked to checkpoint and stop, and the job then ends
        without a requeue. Returns why, once there is a request."""
        now = time.monotonic()
        if self.cancelled is None and now - self._cancel_looked >= CANCEL_LOOK_S:
            self._cancel_looked = now
            self.cancelled = cancel_request(self.paths, self.job_id)
            if self.cancelled is not None:
                self.ask(self.cancelled)
        return self.cancelled

    def warning(self, payload_started: bool) -> str | None:
        """Why the time limit is near: the batch script noted Slurm's warning, or the agent's
        own clock says the warning is due (Slurm may signal late, or, through submitit, only to
        a shell that cannot act on it)."""
        if self.paths.warning.exists():
            return "Slurm's time-limit warning reached the batch script"
        warning = int(getattr(signal, f"SIG{self.job.warning_signal}"))
        if not payload_started and warning in self.inbox.noted:
            return f"the warning signal SIG{self.job.warning_signal} reached the agent"
        now, end = time.time(), self.deadline.end_time
        if end is not None and rq.warning_due(end, self.job.signal_lead_s, now):
            return (
                f"{rq.describe_end(end, now)} (the warning is due "
                f"{self.job.signal_lead_s:.0f} s before)"
            )
        return None

    def ask(self, reason: str) -> None:
        """Ask the payload, once, to checkpoint and stop."""
        if self.reason is not None:
            return
        self.reason = reason
        self._pending = int(getattr(signal, f"SIG{self.job.stop_signal}"))
        self.log.info(
            "%s; asking the payload to checkpoint and stop (SIG%s)", reason, self.job.stop_signal
        )

    def take_signals(self, payload: Child | None) -> None:
        """Act on the noted signals: SIGTERM goes to the payload as is (and means Slurm ends
        the job); the warning signal becomes a stop request; others pass through. A payload of
        None (verl, which dies of them) is sent none."""
        for sig in self.inbox.take():
            name = signal.Signals(sig).name
            if sig == signal.SIGTERM:
                if self.terminated_by is None:
                    self.log.info("%s", sigterm_note(self.paths.run_dir,
                                                     None if self.local else kill_wait_s()))
                self.terminated_by = self.terminated_by or name
                self.reason = self.reason or name
            elif name == f"SIG{self.job.warning_signal}":
                self.ask(f"the warning signal {name} reached the agent")
                continue
            if payload is None:
                self.ask(f"{name} reached the agent")
                continue
            self.log.info("forwarding %s to the payload", name)
            payload.send(sig)

    def deliver(self, payload: Child, started: float) -> None:
        """Send the pending stop signal once the payload handles it (a signal that arrives
        before its handler is installed would kill it), or after `PAYLOAD_ARM_S` anyway."""
        if self._pending is None:
            return
        waited = time.monotonic() - started
        if waited < PAYLOAD_ARM_S and not self._handles(payload, self._pending):
            return
        payload.send(self._pending)
        self._pending = None

    def _handles(self, payload: Child, sig: int) -> bool:
        if runtime(self.job.runtime).relays_signals:  # the client passes it into the container
            return True
        try:
            status = Path(f"/proc/{payload.pid}/status").read_text()
        except OSError:
            return True
        return sig in rq.caught_signals(status)
