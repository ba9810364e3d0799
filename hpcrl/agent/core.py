"""The node agent: rendezvous, Ray start, wait for the cluster, run the payload, end cleanly.

One agent runs on every node of a job. Rank 0 (the head) picks its address and a free port
block, writes the auth token and publishes both; the others wait for that file and join. The
head waits until the GCS lists every node alive, then runs the payload. Whatever ends first
(payload exit, a node's Ray or agent dying, a signal) ends the job on every node.

`Agent.run` wires the parts, each with one job: `launch` (address, ports, rendezvous, Ray),
`watch` (Ray, the GCS, heartbeats, the stop file), `stop` (signals and the clock become a stop
request), `requeuer` (the requeue decision), `head` (the head's run of the payload) and
`teardown`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.head import Head
from hpcrl.agent.jobfile import AgentJob, load_job
from hpcrl.agent.launch import Launcher
from hpcrl.agent.lease import release_lease, take_lease
from hpcrl.agent.node import (
    AgentError,
    ContainerWrap,
    Heartbeat,
    Node,
    Outcome,
    check_image,
    container_wrap,
    make_node_tmp,
    open_log,
    state_writer,
)
from hpcrl.agent.ports import PortClaims
from hpcrl.agent.procs import Child
from hpcrl.agent.stop import SignalInbox
from hpcrl.agent.teardown import Teardown
from hpcrl.agent.watch import early_stop_reason, watch_worker
from hpcrl.netaddr import NodeAddress, local_addresses
from hpcrl.rundir import RunPaths
from hpcrl.runstate import AGENT_STARTED, Retrying, process_start
from hpcrl.slurm_env import JobContext, job_context

__all__ = ["Agent", "AgentError", "ContainerWrap", "Outcome", "container_wrap"]


class Agent:
    """One node's agent. `run()` returns the exit status of the node's part of the job."""

    def __init__(
        self,
        run_dir: Path,
        env: Mapping[str, str] | None = None,
        wrap: ContainerWrap = container_wrap,
        addresses: Callable[[], list[NodeAddress]] = local_addresses,
        context: JobContext | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.env = dict(os.environ if env is None else env)
        self.wrap = wrap
        self.addresses = addresses
        self.ctx = context or job_context(self.env)
        self.paths = RunPaths(self.run_dir, self.ctx.run)
        self.claims = PortClaims()
        """Port blocks claimed on this node; held until Ray is torn down."""
        self.leased = False
        """The head holds the run directory's lease (`hpcrl.agent.lease`)."""

    def run(self) -> int:
        try:
            rdv.check_new_run(self.paths, self.ctx.job_id)  # before this run writes a file there
            log = open_log(self.paths, self.ctx)
        except (OSError, rdv.RendezvousError) as exc:
            print(f"hpcrl-agent[{self.ctx.hostname}]: {exc}", file=sys.stderr)
            return 1
        inbox = SignalInbox()
        heartbeat = Heartbeat(self.paths, self.ctx, retry=Retrying(warn=log.warning))
        children: dict[str, Child] = {}
        job: AgentJob | None = None
        tmp: Path | None = None
        outcome = Outcome("agent error", 1, self.ctx.hostname)
        inbox.install()
        try:
            state_writer(self.run_dir, self.ctx).append(
                AGENT_STARTED, pid=os.getpid(), start=process_start(os.getpid()),
                nodes=self.ctx.num_nodes, job_id=self.ctx.job_id)
            nonce = self.env.get(rdv.CANARY_ENV)
            if nonce:
                rdv.verify_canary(self.run_dir, nonce, self.ctx.hostname)
            job = load_job(self.run_dir)
            tmp = make_node_tmp(self.ctx, self.env)
            log.info("working directory %s, safe_path %s (python -P), private temp dir %s",
                     os.getcwd(), bool(sys.flags.safe_path), tmp)
            node = Node(self.run_dir, self.env, self.ctx, self.paths, job, log, self.wrap, children,
                        tmp)
            heartbeat.retry.patience_s = job.heartbeat_timeout_s
            outcome = self._run_node(node, heartbeat, inbox)
        except Exception as exc:  # every failure ends the job with a message naming the node
            outcome = Outcome(f"{type(exc).__name__}: {exc}", 1, self.ctx.hostname)
            log.error("node %s failed: %s", self.ctx.hostname, exc)
            try:
                rdv.request_stop(self.paths, self.ctx.node_rank, self.ctx.hostname, outcome.cause)
            except OSError:
                pass
        finally:
            Teardown(self.paths, self.ctx, log, heartbeat, children, job, tmp).run(outcome)
            self.claims.release()
            self._release_lease()
            inbox.restore()
        return outcome.exit_code

    def _release_lease(self) -> None:
        if self.leased:
            try:
                release_lease(self.run_dir, self.ctx)
            except OSError:
                pass  # the next job takes a lease whose job is over

    def _run_node(self, node: Node, heartbeat: Heartbeat, inbox: SignalInbox) -> Outcome:
        """The head runs the payload; a worker keeps its Ray up until the job ends."""
        check_image(node.job, node.ctx.hostname)
        if node.job.nodes != node.ctx.num_nodes:
            node.log.info(
                "job asked for %d nodes, the allocation has %d; using %d",
                node.job.nodes,
                node.ctx.num_nodes,
                node.ctx.num_nodes,
            )
        launcher = Launcher(node, heartbeat, self.addresses, self.claims)
        if node.ctx.is_head:
            note = take_lease(self.run_dir, node.ctx)  # one job per run directory
            self.leased = True
            if note:
                node.log.info("%s", note)
            return Head(node, heartbeat, inbox, launcher).run()
        ray = launcher.worker(keep_waiting=lambda: early_stop_reason(node.paths, inbox))
        return watch_worker(node, ray, heartbeat, inbox)
