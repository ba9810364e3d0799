"""Watch: whether the job can go on. Ray on this node, the stop file any node may write, the
GCS's view of which nodes are alive (head), the other agents' heartbeats, and the head's wait
until every node joined.

Each check returns an :class:`~hpcrl.agent.node.Outcome` when the job must end, None otherwise.
"""

from __future__ import annotations

import json
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.node import BEAT_S, TICK_S, AgentError, Heartbeat, Node, Outcome
from hpcrl.agent.procs import Child
from hpcrl.agent.requeuer import Requeuer
from hpcrl.agent.stop import SignalInbox
from hpcrl.rundir import RunPaths
from hpcrl.runstate import NODES_JOINED


def ray_exited(node: Node, ray: Child) -> Outcome | None:
    """Ray on this node ended: the node is gone from the cluster."""
    code = ray.poll()
    if code is None:
        return None
    refused = _launcher_refusal(ray.log_path)
    return Outcome(
        f"Ray on `{node.ctx.hostname}` exited with code {code}; "
        + (f"{refused} (`{ray.log_path}`)" if refused else f"see `{ray.log_path}`"),
        1,
        node.ctx.hostname,
    )


def _launcher_refusal(log: Any) -> str | None:
    """The launcher's own refusal (`ray_launch: ...`, e.g. a Ray without token auth) in `log`."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read()[-4000:].splitlines()
    except (OSError, TypeError):
        return None
    return next((ln.strip() for ln in reversed(lines) if ln.startswith("ray_launch: ")), None)


def stop_requested(paths: RunPaths) -> Outcome | None:
    """Another node (or `hpcrl cancel`) wrote the stop file."""
    stop = rdv.read_stop(paths)
    if not stop:
        return None
    rank = f" (rank {stop['rank']})" if isinstance(stop.get("rank"), int) else ""
    return Outcome(
        f"node `{stop.get('by')}`{rank} ended the job: {stop.get('reason')}", 1, str(stop.get("by"))
    )


def early_stop_reason(paths: RunPaths, inbox: SignalInbox) -> str | None:
    """Why a worker waiting for the head's publication stops waiting."""
    stop = rdv.read_stop(paths)
    if stop:
        return f"{stop.get('by')} asked to stop: {stop.get('reason')}"
    sig = inbox.stopping()
    return None if sig is None else f"this agent got {signal.Signals(sig).name}"


def signalled_before_payload(node: Node, inbox: SignalInbox) -> Outcome | None:
    """SIGTERM or SIGINT reached the head before the payload started: the job ends."""
    sig = inbox.stopping()
    if sig is None:
        return None
    name = signal.Signals(sig).name
    return Outcome(f"{name} before the payload started", 128 + sig, node.ctx.hostname)


@dataclass
class GcsWatch:
    """The head's view of the cluster: the newest set of nodes the GCS lists alive
    (`ADDRESS:NODE_MANAGER_PORT` keys, from the watcher's lines) against the nodes' files, and
    the nodes' joining, which may go on while the payload runs (`payload_start: head-alive`)."""

    node: Node
    lines: queue.Queue[str]
    peers: rdv.Peers | None = None
    """The node files as the head reads them (the head's `Heartbeat.peers`)."""
    alive: set[str] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)
    """Ranks ever listed alive: only these can be lost (the others have not joined yet)."""
    complete: bool = False
    """Every node joined."""
    _shown: int = -1
    _noted: float = field(default_factory=time.monotonic)
    _deadline: float = 0.0

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.node.job.join_timeout_s
        if self.peers is None:
            self.peers = rdv.Peers(self.node.paths, expected=self.node.ctx.num_nodes)

    def files(self, max_age_s: float = 0.0) -> dict[int, dict[str, Any]]:
        """Every node file present (read again unless read within `max_age_s`)."""
        assert self.peers is not None
        return self.peers.read(max_age_s=max_age_s)

    def refresh(self) -> None:
        """Take the watcher's new lines; keep the newest set of alive nodes."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if "alive" in data:
                self.alive = set(data["alive"])

    def joined(self) -> tuple[set[int], dict[int, dict[str, Any]]]:
        """The ranks whose Ray node is alive, and every node file."""
        arrived = self.files()
        joined = {r for r, d in arrived.items() if _key(d) in self.alive}
        return joined, arrived

    def lost_nodes(self) -> Outcome | None:
        """A node's Ray left the GCS after it had joined, or its agent stopped its heartbeat
        (its file did not change for `heartbeat_timeout_s`; read once per beat)."""
        assert self.peers is not None
        arrived = self.files(max_age_s=BEAT_S)
        for rank, d in sorted(arrived.items()):
            if rank in self.seen and _key(d) not in self.alive:
                return Outcome(
                    f"Ray on node `{d.get('host')}` (rank {rank}) is no longer alive in the GCS",
                    1,
                    str(d.get("host")),
                )
        for rank in self.peers.stale(self.node.job.heartbeat_timeout_s):
            if rank != self.node.ctx.node_rank:
                host = arrived[rank].get("host")
                return Outcome(
                    f"agent on `{host}` (rank {rank}) stopped its heartbeat", 1, str(host)
                )
        return None

    def cut_off(self) -> list[tuple[int, str]]:
        """Other nodes that joined and are no longer alive in the GCS, whatever their agents'
        heartbeats say: with its network cut from the head's, a node's agent may go on beating
        through the shared file system while Ray (and every collective) lost it."""
        self.refresh()
        arrived = self.files(max_age_s=BEAT_S)
        return [(r, str(d.get("host"))) for r, d in sorted(arrived.items())
                if r in self.seen and r != self.node.ctx.node_rank and _key(d) not in self.alive]

    def missing(self) -> list[str]:
        """The nodes not (yet) in the cluster, each with why (:func:`rdv.missing_nodes`)."""
        joined, arrived = self.joined()
        return rdv.missing_nodes(self.node.ctx.nodes, arrived, joined)

    def progress(self) -> bool:
        """One look at the joining: writes `head-alive` once the GCS lists the head (the
        workers start Ray then), records each change, names the missing nodes every 10 s and
        raises AgentError when they did not join within `join_timeout_s`. True once every node
        joined."""
        if self.complete:
            return True
        node, n = self.node, self.node.ctx.num_nodes
        self.refresh()
        joined, arrived = self.joined()
        self.seen |= joined
        if 0 in joined and not node.paths.head_alive.exists():
            node.retry.run(lambda: rdv.atomic_write_text(node.paths.head_alive,
                                                         f"{time.time()}\n", 0o600),
                           f"`{node.paths.head_alive}`")
            node.log.info("head node alive in the GCS; workers start Ray now")
        if len(joined) != self._shown:
            self._shown = len(joined)
            node.log.info("%d/%d nodes joined", self._shown, n)
            node.state.append(NODES_JOINED, joined=self._shown, total=n)
        if len(joined) == n:
            self.complete = True
            node.log.info("all %d nodes joined", n)
            return True
        now = time.monotonic()
        missing = rdv.missing_nodes(node.ctx.nodes, arrived, joined)
        if now - self._noted > 10:
            node.log.info("%d/%d nodes joined; waiting for %s", len(joined), n, ", ".join(missing))
            self._noted = now
        if now > self._deadline:
            raise AgentError(
                f"only {len(joined)}/{n} nodes joined the Ray cluster within "
                f"{node.job.join_timeout_s:.0f} s; missing: {'; '.join(missing)}. See their "
                f"agent logs in `{node.paths.logs}`"
            )
        return False

    def wait_for_cluster(
        self,
        heartbeat: Heartbeat,
        warned: Callable[[], Outcome | None],
        failure: Callable[[], Outcome | None],
        head_only: bool = False,
    ) -> Outcome | None:
        """Wait until every node's Ray is alive in the GCS, or only the head's (`head_only`;
        :meth:`progress` then goes on while the payload runs): None; or `warned` (the time
        limit is near, checked first) or `failure` says the job ends."""
        while True:
            early = warned()
            if early:
                return early
            if self.progress() or (head_only and 0 in self.seen):
                return None
            failed = failure()
            if failed:
                return failed
            heartbeat.beat("starting")
            time.sleep(TICK_S)


def _key(node_file: dict[str, Any]) -> str:
    """How the GCS names a node: its address and node-manager port."""
    return f"{node_file.get('address')}:{node_file.get('node_manager_port')}"


def dead_nodes(node: Node, heartbeat: Heartbeat) -> list[tuple[int, str]]:
    """After a failure seen now: the other nodes whose agent died with it. Waits until each
    has either beaten since (its file changed: alive, within `BEAT_S`) or stayed silent for
    `heartbeat_timeout_s` (dead), so that a failure of the payload alone ends the job as before
    and a node's death (slurmd, agent, Ray and trainer gone) is told apart from it."""
    limit, me, peers = node.job.heartbeat_timeout_s, node.ctx.node_rank, heartbeat.peers
    since = peers.clock()
    while True:
        others = {r: d for r, d in peers.read().items() if r != me}
        dead = set(peers.stale(limit, others))
        undecided = [r for r, d in others.items() if r not in dead
                     and d.get("state") != "exited" and not peers.changed_after(r, since)]
        if not undecided:
            return [(r, str(others[r].get("host"))) for r in sorted(dead)]
        heartbeat.beat("running")
        time.sleep(TICK_S)


def lost_head(node: Node, heartbeat: Heartbeat, inbox: SignalInbox) -> Outcome | None:
    """The head's agent stopped beating: the head node died. The lowest-ranked worker still
    alive requeues the job excluding the dead nodes (the head would have); the others end."""
    head = heartbeat.peers.read([0], max_age_s=BEAT_S).get(0)
    if not head or not heartbeat.peers.stale(node.job.heartbeat_timeout_s, [0]):
        return None
    host = str(head.get("host") or node.ctx.nodes[0])
    cause = f"the head `{host}` stopped its heartbeat"
    dead = dead_nodes(node, heartbeat)
    alive = [r for r in range(1, node.ctx.num_nodes) if r not in {r for r, _ in dead}]
    if alive and min(alive) != node.ctx.node_rank:
        # no stop request: rank min(alive) would read it first and end without requeueing
        return Outcome(f"{cause}; rank {min(alive)} requeues the job", 1, host, announce=False)
    node.log.error("%s; this node (the lowest-ranked alive) requeues the job", cause)
    requeuer = Requeuer(node.ctx, node.job, node.run_dir, inbox, node.log)
    return requeuer.after_node_loss([h for _, h in dead], cause)


def watch_worker(node: Node, ray: Child, heartbeat: Heartbeat, inbox: SignalInbox) -> Outcome:
    """A worker keeps Ray up until the head ends the job (stop file), its own Ray or the head's
    heartbeat stops (then the lowest-ranked live worker requeues the job), or, after SIGTERM,
    the head does not end the job within ten grace times."""
    term_at: float | None = None
    while True:
        stop = rdv.read_stop(node.paths)
        if stop:
            by = stop.get("by")
            mine = stop.get("rank") == node.ctx.node_rank
            return Outcome(
                f"stop requested by `{by}`: {stop.get('reason')}", 1 if mine else 0, str(by)
            )
        failed = ray_exited(node, ray)
        if failed:
            return failed
        failed = lost_head(node, heartbeat, inbox)
        if failed:
            return failed
        sigs = [signal.Signals(s).name for s in inbox.take()]
        if sigs:
            node.log.info("got %s; Ray stays up until the head ends the job", ", ".join(sigs))
            if ("SIGTERM" in sigs or "SIGINT" in sigs) and term_at is None:
                term_at = time.monotonic()
        if term_at is not None and time.monotonic() - term_at > 10 * node.job.grace_s:
            return Outcome(
                "SIGTERM and the head did not end the job", 128 + signal.SIGTERM, node.ctx.hostname
            )
        heartbeat.beat("running")
        time.sleep(TICK_S)
