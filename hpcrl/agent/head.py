"""The head's part of a job: launch Ray's head, wait until every node joined (or, for a payload
that waits for its nodes itself, until the head's own Ray is up), run the payload and watch it,
the cluster's joining and health and the clock until it exits or the job must end.

The head wires the parts: `Launcher` (Ray and the GCS watcher), `GcsWatch` (the cluster),
`StopControl` (signals and the clock become a stop request), `Requeuer` (what the payload's
requeue status leads to), `SlowNodes` (a node the trainer named slow).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.agent import requeue as rq
from hpcrl.agent.launch import HeadCluster, Launcher
from hpcrl.agent.node import TICK_S, AgentError, Heartbeat, Node, Outcome
from hpcrl.agent.procs import Child
from hpcrl.agent.requeuer import Requeuer
from hpcrl.agent.slow import SlowNodes
from hpcrl.agent.stop import Deadline, SignalInbox, StopControl
from hpcrl.agent.watch import (
    GcsWatch,
    dead_nodes,
    ray_exited,
    signalled_before_payload,
    stop_requested,
)
from hpcrl.diagnosis import as_job_nodes, blamed_nodes
from hpcrl.netaddr import format_host
from hpcrl.payloads import verl
from hpcrl.runreport import gpus_env, trainer_dirs
from hpcrl.runstate import PAYLOAD_EXITED, PAYLOAD_STARTED, STOP_REQUESTED
from hpcrl.slurm import SlurmError, run_slurm
from trainer.exit_codes import REQUEUE_EXIT_CODE


@dataclass
class Head:
    """Rank 0's run, from launch to the payload's outcome."""

    node: Node
    heartbeat: Heartbeat
    inbox: SignalInbox
    launcher: Launcher
    started: float = field(default_factory=time.time)
    """When this run's head started: diagnoses older than this are an earlier run's."""

    def run(self) -> Outcome:
        node = self.node
        deadline = Deadline.learn(node.ctx, node.env, node.job, node.log)
        cluster = self.launcher.head()
        ray = cluster.ray
        stop = StopControl(node.job, node.paths, self.inbox, deadline, node.log,
                           local=node.ctx.local, job_id=node.ctx.job_id)
        requeuer = Requeuer(node.ctx, node.job, node.run_dir, self.inbox, node.log, stop, deadline)
        watch = GcsWatch(node, cluster.gcs_lines, self.heartbeat.peers)

        def warned() -> Outcome | None:
            """The time limit is near before the payload started: do not start it."""
            why = stop.warning(payload_started=False)
            if why is None:
                return None
            node.log.info("%s before the payload started: not starting it", why)
            node.state.append(STOP_REQUESTED, reason=why, payload_started=False)
            return requeuer.after_request(f"{why} before the payload started", REQUEUE_EXIT_CODE)

        failed = watch.wait_for_cluster(
            self.heartbeat,
            warned,
            lambda: ray_exited(node, ray)
            or signalled_before_payload(node, self.inbox)
            or stop_requested(node.paths)
            or self._cancelled_before_payload(stop),
            head_only=node.job.payload_start == "head-alive",
        )
        if failed:
            return failed
        self.heartbeat.write("running")
        payload = self._start_payload(cluster, deadline, watch)
        return self._watch_payload(payload, ray, watch, stop, requeuer)

    def _payload_env(self, cluster: HeadCluster, deadline: Deadline) -> dict[str, str]:
        node, end = self.node, deadline.end_time
        return {
            **cluster.env,
            "RAY_ADDRESS": cluster.gcs,
            "MASTER_ADDR": format_host(cluster.address.address),
            "HPCRL_RUN_DIR": str(node.run_dir),
            "HPCRL_RESTART": str(node.ctx.run),
            "HPCRL_JOB_ID": node.ctx.job_id,
            "HPCRL_NUM_NODES": str(node.ctx.num_nodes),
            "HPCRL_JOIN_TIMEOUT_S": f"{node.job.join_timeout_s:.0f}",
            **gpus_env(node.job.profile),
            **({rq.END_TIME_ENV: f"{end:.0f}"} if end else {}),
        }

    def _start_payload(self, cluster: HeadCluster, deadline: Deadline, watch: GcsWatch) -> Child:
        node, job = self.node, self.node.job
        workdir = str(job.container.get("workdir") or node.run_dir)
        when = ("" if watch.complete else
                f"{len(watch.seen)}/{node.ctx.num_nodes} nodes joined, the others join while it "
                "starts (`payload_start: head-alive`); ")
        node.log.info("%sstarting the payload: %s", when, " ".join(job.payload))
        host_cwd = workdir if job.runtime == "none" else str(node.run_dir)
        argv = list(job.payload)
        if verl.is_verl(argv):
            argv = self._verl_argv(cluster)
        child = node.start("payload", "payload", argv,
                           self._payload_env(cluster, deadline), workdir,
                           node.paths.payload_log, host_cwd, echo=sys.stdout)
        node.state.append(PAYLOAD_STARTED, pid=child.pid, nodes=node.ctx.num_nodes)
        return child

    def _verl_argv(self, cluster: HeadCluster) -> list[str]:
        """verl's line under `verl_launch.py`, after checking Ray's CPUs against verl's need."""
        node = self.node
        cpus = cluster.cpus * node.ctx.num_nodes if cluster.cpus is not None else None
        refused = verl.check_cpus(cpus, node.job.payload)
        if refused:
            raise AgentError(refused)
        if node.ctx.num_nodes != node.job.nodes:
            raise AgentError(
                f"the job asked for {node.job.nodes} nodes and has {node.ctx.num_nodes}: verl's "
                "checkpoints are tied to the world size (`model_world_size_{N}_rank_{r}.pt`), so "
                "it cannot resume on another node count. Fix: resubmit with `--nodes "
                f"{node.job.nodes}` when that many are free")
        helper = node.paths.helper(verl.LAUNCHER)
        helper.write_text(Path(verl.__file__).with_name(verl.LAUNCHER).read_text())
        return verl.launcher_argv(node.job.payload[0], helper, node.job.payload)

    def _watch_payload(
        self, payload: Child, ray: Child, watch: GcsWatch, stop: StopControl, requeuer: Requeuer
    ) -> Outcome:
        """Until the payload exits: signals and the clock reach it as a stop request; a lost
        node ends the job, unless the payload was asked to stop (Slurm's SIGTERM reaches Ray
        too) and may still checkpoint."""
        started, ignored, noted = time.monotonic(), False, False
        slow = SlowNodes(requeuer, self.started)
        kind = verl.VerlKind(self.node, stop) if verl.is_verl(self.node.job.payload) else None
        while True:
            stop.take_signals(payload if kind is None else None)
            stop.check_cancel()
            if stop.reason is None:
                why = stop.warning(payload_started=True)
                if why:
                    stop.ask(why)
            slow.check(stop)
            if kind is None:
                stop.deliver(payload, started)
            else:
                kind.tick(payload)
            noted = noted or self._note_stop(stop)
            code = payload.poll()
            if code is not None:
                code = code if code >= 0 else 128 - code
                code = kind.status(code, REQUEUE_EXIT_CODE) if kind else code
                return self._outcome(code, stop, requeuer, watch, slow)
            watch.progress()  # the nodes still joining, if any
            watch.refresh()
            failed = ray_exited(self.node, ray) or stop_requested(self.node.paths) \
                or watch.lost_nodes()
            if failed and stop.reason is None:
                if kind is not None:
                    kind.after_loss()
                return self._after_failure(failed, requeuer, watch)
            if failed and not ignored:
                ignored = True
                self.node.log.info("%s; waiting for the payload, which was asked to stop",
                                   failed.cause)
            self.heartbeat.beat("running")
            time.sleep(TICK_S)

    def _after_failure(self, failed: Outcome, requeuer: Requeuer, watch: GcsWatch) -> Outcome:
        """A failure while the payload ran: if nodes died with it (their agents stopped
        beating) or were cut off (they left the GCS while their agents beat on), the job is
        requeued without them; otherwise it ends as `failed` says (a payload's own error is not
        retried)."""
        self.node.log.error("%s; checking whether nodes died with it (their heartbeats)",
                            failed.cause)  # first: Slurm may end this agent meanwhile
        dead = dead_nodes(self.node, self.heartbeat)
        cut = [(r, h) for r, h in watch.cut_off() if r not in {r for r, _ in dead}]
        hosts = [host for _, host in dead + cut]
        blamed, strangers = as_job_nodes(self._blamed(), self.node.ctx.nodes)
        if strangers:
            self.node.log.error("the trainer's watchdog blamed host(s) %s, which are no node of this job (%s): "
                                "not excluded", ", ".join(strangers), ", ".join(self.node.ctx.nodes))
        blamed = [h for h in blamed if h not in hosts]
        if blamed:  # alive, but the trainer's watchdog found a rank stopped or in D state there, or GPU errors
            self.node.log.error("%s; the trainer's watchdog blamed node(s) %s (a stuck rank's process "
                                "stopped or in uninterruptible I/O, or GPU errors)", failed.cause, ", ".join(blamed))
            hosts += blamed
        if not hosts:
            return failed
        if dead:
            self.node.log.error("%s; node(s) %s died", failed.cause,
                                ", ".join(h for _, h in dead))
        if cut:
            self.node.log.error("%s; node(s) %s left the Ray cluster while their agents still "
                                "beat: their network is cut off", failed.cause,
                                ", ".join(h for _, h in cut))
        why = {**{h: "was cut off (it left the Ray cluster while its agent beat on)" for _, h in cut},
               **{h: "holds a stuck rank (its process stopped or in uninterruptible I/O, or its GPUs "
                     "reported errors: the trainer's watchdog, `hpcrl status`)" for h in blamed}}
        return requeuer.after_node_loss(hosts, failed.cause, why)

    def _blamed(self) -> list[str]:
        """Nodes the trainer's watchdog blamed in this run (:func:`hpcrl.diagnosis.blamed_nodes`,
        from the trainer's run directory); none when it wrote nothing or cannot be read."""
        try:
            return blamed_nodes(trainer_dirs(self.node.run_dir)[0], since=self.started)
        except (OSError, ValueError):
            return []

    def _cancelled_before_payload(self, stop: StopControl) -> Outcome | None:
        why = stop.check_cancel()
        if why is None:
            return None
        return Outcome(f"{why} before the payload started", 0, self.node.ctx.hostname,
                       then=self._scancel)

    def _scancel(self) -> str:
        """After the teardown, `scancel` this job: Slurm records it cancelled and never
        requeues it (what `hpcrl cancel` asked)."""
        ctx = self.node.ctx
        self.node.paths.cancel.unlink(missing_ok=True)  # acted on
        if ctx.local:
            return "cancelled (`hpcrl cancel`)"
        try:
            run_slurm(["scancel", ctx.job_id], shielded=True)
        except (SlurmError, OSError) as exc:
            return f"could not `scancel {ctx.job_id}`: {exc}"
        return f"cancelled job {ctx.job_id} with `scancel` (`hpcrl cancel`)"

    def _note_stop(self, stop: StopControl) -> bool:
        """Record the stop request in the state file once there is one; True when recorded."""
        if stop.reason is None:
            return False
        self.node.state.append(STOP_REQUESTED, reason=stop.reason, payload_started=True,
                               terminated_by=stop.terminated_by)
        return True

    def _outcome(self, status: int, stop: StopControl, requeuer: Requeuer, watch: GcsWatch,
                 slow: SlowNodes) -> Outcome:
        self.node.state.append(PAYLOAD_EXITED, status=status, stop_reason=stop.reason)
        cause = f"payload exited with status {status}"
        if not watch.complete:  # it started with the head alone; say who never came
            cause += (f" while {len(watch.seen)}/{self.node.ctx.num_nodes} nodes had joined "
                      f"(missing: {'; '.join(watch.missing())})")
        if stop.reason:
            cause += f" after the stop request ({stop.reason})"
        if status not in (0, REQUEUE_EXIT_CODE) and stop.reason is None:
            return self._after_failure(Outcome(cause, status, self.node.ctx.hostname), requeuer,
                                       watch)
        if stop.cancelled and status in (0, REQUEUE_EXIT_CODE):
            done = "checkpointed" if status == REQUEUE_EXIT_CODE else "finished"
            cause += "" if stop.reason == stop.cancelled else f" ({stop.cancelled})"
            return Outcome(f"{cause}: {done}; the job ends, not requeued",
                           status, self.node.ctx.hostname, then=self._scancel)
        if status != REQUEUE_EXIT_CODE:
            return Outcome(cause, status, self.node.ctx.hostname)
        return slow.requeue(stop, status, cause) or requeuer.after_request(f"{cause}: checkpointed, asks to be requeued", status)
