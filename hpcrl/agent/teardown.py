"""Teardown: whatever ended the node's part of the job, stop what it started, remove what its
containers left, keep Ray's logs, and write the node's (and, on the head, the job's) summary.

It runs for every outcome, also when the job file could not be read: then nothing was started.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.jobfile import AgentJob
from hpcrl.agent.node import (
    TICK_S,
    Heartbeat,
    Outcome,
    close_log,
    container_name,
    state_writer,
)
from hpcrl.agent.procs import Child, kill_all, processes_mentioning
from hpcrl.rundir import RunPaths
from hpcrl.runstate import RUN_ENDED, TEARDOWN_DONE
from hpcrl.runtimes import get as runtime
from hpcrl.slurm_env import JobContext

DEFAULT_GRACE_S = 10.0
"""How long the payload gets after SIGTERM when the job file (and its `grace_s`) is unknown."""


@dataclass
class Teardown:
    """Ends one node's part of the job. `children` are the processes the node started, by role
    (`payload`, `watch`, `ray`); `job` is None when the job file could not be read."""

    paths: RunPaths
    ctx: JobContext
    log: logging.Logger
    heartbeat: Heartbeat
    children: dict[str, Child]
    job: AgentJob | None
    tmp: Path | None
    """The node's temp dir (None: not made)."""

    def run(self, outcome: Outcome) -> None:
        if outcome.announce:
            self._announce(outcome)
        self._stop_children()
        leftovers = processes_mentioning(str(self.tmp)) if self.tmp else []
        if leftovers:
            self.log.info("killing %d leftover processes of this run", len(leftovers))
            kill_all(leftovers)
        self._keep_ray_logs()
        summary = (f"node {self.ctx.hostname} (rank {self.ctx.node_rank}): {outcome.cause}; "
                   f"exit {outcome.exit_code}")
        self.log.info("summary: %s", summary)
        try:
            self.heartbeat.write("exited", summary=summary, exit_code=outcome.exit_code)
        except OSError:
            pass
        if self.ctx.is_head:
            self._write_summary(outcome)
        if outcome.then is not None:
            done = outcome.then()
            self.log.info("%s", done)
            with open(self.paths.summary, "a") as fh:
                fh.write(done + "\n")
        self._record(TEARDOWN_DONE, exit_code=outcome.exit_code)
        close_log(self.log)

    def _record(self, event: str, **fields: object) -> None:
        """A line in the state file; a run directory gone or full must not stop the teardown."""
        try:
            state_writer(self.paths.run_dir, self.ctx).append(event, **fields)
        except OSError as exc:
            self.log.info("could not write the state file: %s", exc)

    def _announce(self, outcome: Outcome) -> None:
        """Tell every node the job ends; the first request names the cause, later ones change
        nothing. The head writes its headline first: Slurm may kill the rest (`KillWait`)."""
        code = outcome.exit_code if outcome.cause.startswith("payload exited") else None
        try:
            rdv.request_stop(self.paths, self.ctx.node_rank, self.ctx.hostname, outcome.cause, code)
            if self.ctx.is_head:
                rdv.atomic_write_text(self.paths.summary, self._headline(outcome) + "\n")
        except OSError:
            pass
        if self.ctx.is_head:
            self._record(RUN_ENDED, summary=self._headline(outcome), cause=outcome.cause,
                         exit_code=outcome.exit_code)

    def _stop_children(self) -> None:
        """The payload gets its grace time; then the watcher and Ray stop, and their containers
        are removed where the runtime keeps them after its client is killed."""
        payload = self.children.get("payload")
        if payload is not None and payload.poll() is None:
            grace = self.job.grace_s if self.job else DEFAULT_GRACE_S
            self.log.info("stopping the payload (SIGTERM, SIGKILL after %.0f s)", grace)
            payload.stop(grace)
        elif payload is not None:
            payload.close()
        for role in ("watch", "ray"):  # both block SIGTERM (ray_launch.py, gcs_watch.py)
            child = self.children.get(role)
            if child is not None:
                child.stop(0.0, sig=signal.SIGKILL)
        for role in ("payload", "watch", "ray"):
            if role in self.children and self.job is not None:
                self._remove_container(self.job, role)

    def _remove_container(self, job: AgentJob, role: str) -> None:
        binary = str(job.container.get("binary") or job.runtime)
        name = container_name(self.ctx, role)
        command = runtime(job.runtime).remove(binary, name)
        if command is None:
            return
        try:
            subprocess.run(command, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            self.log.info("could not remove container %s: %s", name, exc)

    def _keep_ray_logs(self) -> None:
        tmp = self.tmp
        if tmp is None:
            return
        src = tmp / "session_latest" / "logs"
        if src.is_dir():
            shutil.copytree(
                src,
                self.paths.node_log("ray", self.ctx.node_rank, self.ctx.hostname),
                dirs_exist_ok=True,
                ignore_dangling_symlinks=True,
                symlinks=False,
            )
        shutil.rmtree(tmp, ignore_errors=True)

    def _headline(self, outcome: Outcome) -> str:
        return (
            f"job {self.ctx.job_id} restart {self.ctx.restart}: {outcome.cause} "
            f"(exit {outcome.exit_code})"
        )

    def _write_summary(self, outcome: Outcome) -> None:
        """One line per node; waits up to 5 s for the final report of nodes still beating."""
        deadline = time.monotonic() + 5.0
        while True:
            nodes = self.heartbeat.peers.read()
            silent = set(self.heartbeat.peers.stale(4.0))
            pending = [
                r
                for r in range(self.ctx.num_nodes)
                if r in nodes and nodes[r].get("state") != "exited" and r not in silent
            ]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(TICK_S)
        lines = [self._headline(outcome)]
        for rank, host in enumerate(self.ctx.nodes):
            lines.append(
                nodes.get(rank, {}).get("summary") or f"node {host} (rank {rank}): no final report"
            )
        for line in lines:
            self.log.info("%s", line)
        rdv.atomic_write_text(self.paths.summary, "\n".join(lines) + "\n", 0o600)
