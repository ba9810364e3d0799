"""Per-job blocks of Ray ports, so that jobs sharing a node never meet on a port.

Every port Ray opens is pinned to a slot of a block derived from the job id and restart count.
The head probes its block by binding each port and moves to the next block when one is taken;
the block it settles on is published in the rendezvous file. Per-node ports (node manager,
object manager, agents, workers) are probed again on each worker, which may shift them on its
own node; the head-only ports (GCS, dashboard, client server) stay the head's.

A probe alone leaves a race: two jobs starting on one node at once can both find the same block
free before either Ray binds it. So an agent first claims a block by binding an abstract Unix
socket named for it and for its user (`PortClaims`), held until the agent exits: the claim is
atomic, vanishes with the process, needs no file, and lives in the node's network namespace,
the same one the ports live in. Abstract sockets have no permissions, so any user could bind
a claim's name: a taken name counts only when its holder, asked over the socket
(`SO_PEERCRED`), is this user. Another user's claims, and names squatted by another user, are
ignored (the probe of the ports alone decides there), so no user can block another's jobs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields

SLOTS = (
    "gcs",
    "dashboard",
    "ray_client_server",
    "dashboard_agent_listen",
    "dashboard_agent_grpc",
    "runtime_env_agent",
    "metrics_export",
    "node_manager",
    "object_manager",
    "autoscaler_metric",
    "dashboard_metric",
)
"""Fixed slots at the start of a block, in order; worker ports follow after `FIXED_SLOTS`."""
FIXED_SLOTS = 16
HEAD_ONLY = ("gcs", "dashboard", "ray_client_server", "autoscaler_metric", "dashboard_metric")


class PortError(ValueError):
    """A port range that cannot hold a block, or no free block was found."""


@dataclass(frozen=True)
class PortRange:
    """Where per-job port blocks may lie (profile `ray.port_base` and friends)."""

    base: int = 20000
    """First port of the first block."""
    limit: int = 32768
    """First port past the last block; stays below Linux's ephemeral range (32768-60999)."""
    block_size: int = 256
    """Ports per job: 16 fixed slots, the rest for Ray worker processes."""

    def __post_init__(self) -> None:
        if not 1024 <= self.base < self.limit <= 65536:
            raise PortError(
                f"port range {self.base}..{self.limit} is invalid; need 1024 <= `port_base` < "
                "limit <= 65536"
            )
        if self.block_size < FIXED_SLOTS + 8:
            raise PortError(
                f"`block_size` {self.block_size} is too small; need at least {FIXED_SLOTS + 8} "
                "(fixed slots plus a few worker ports)"
            )
        if self.blocks < 1:
            raise PortError(
                f"port range {self.base}..{self.limit} cannot hold one block of "
                f"{self.block_size}; lower `port_base` or the block size"
            )

    @property
    def blocks(self) -> int:
        return (self.limit - self.base) // self.block_size


SITE_BLOCKS = 64
"""Blocks in a site's range from `ray.port_base`."""


def site_port_range(port_base: int | None) -> PortRange:
    """The range the job's blocks lie in: `SITE_BLOCKS` blocks from the profile's
    `ray.port_base` (keep it clear of ephemeral ports), or the default range."""
    defaults = PortRange()
    if not port_base:
        return defaults
    return PortRange(base=port_base, limit=min(65536, port_base + SITE_BLOCKS * defaults.block_size))


@dataclass(frozen=True)
class PortBlock:
    """Every port of one Ray node of one job; written to and read from the rendezvous file."""

    gcs: int
    dashboard: int
    ray_client_server: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    node_manager: int
    object_manager: int
    autoscaler_metric: int
    dashboard_metric: int
    min_worker_port: int
    max_worker_port: int

    def all_ports(self) -> list[int]:
        fixed = [getattr(self, s) for s in SLOTS]
        return fixed + list(range(self.min_worker_port, self.max_worker_port + 1))

    def node_ports(self) -> list[int]:
        """The ports every node opens (not the head-only ones)."""
        fixed = [getattr(self, s) for s in SLOTS if s not in HEAD_ONLY]
        return fixed + list(range(self.min_worker_port, self.max_worker_port + 1))

    def ray_start_args(self, head: bool, dashboard: bool) -> list[str]:
        """`ray start` flags pinning every port of this node."""
        args = [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--min-worker-port={self.min_worker_port}",
            f"--max-worker-port={self.max_worker_port}",
        ]
        if head:
            args += [f"--port={self.gcs}", f"--ray-client-server-port={self.ray_client_server}"]
            if dashboard:
                args += [f"--dashboard-port={self.dashboard}"]
        return args

    def env(self) -> dict[str, str]:
        """Ports Ray reads from the environment instead of flags."""
        return {
            "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metric),
            "DASHBOARD_METRIC_PORT": str(self.dashboard_metric),
        }

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, int]) -> PortBlock:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = sorted(set(names) - set(data))
        if unknown or missing:
            raise PortError(
                f"port block has unknown keys {unknown} / lacks {missing}; valid keys: "
                f"{', '.join(names)}"
            )
        return cls(**{k: int(data[k]) for k in names})

    def with_node_ports_from(self, other: PortBlock) -> PortBlock:
        """This block's head-only ports with `other`'s per-node ports."""
        merged = other.to_dict()
        merged.update({s: getattr(self, s) for s in HEAD_ONLY})
        return PortBlock(**merged)


def job_number(job_id: str) -> int:
    """A number for a job id: the id itself when numeric (neighbouring jobs get neighbouring
    blocks), else a stable hash (for `local-...` ids)."""
    digits = job_id.split("_", 1)[0]
    if digits.isdigit():
        return int(digits)
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:6], "big")


def block_at(rng: PortRange, index: int) -> PortBlock:
    """The block with number `index` (modulo the number of blocks) of `rng`."""
    start = rng.base + (index % rng.blocks) * rng.block_size
    ports = {slot: start + i for i, slot in enumerate(SLOTS)}
    return PortBlock(
        **ports,
        min_worker_port=start + FIXED_SLOTS,
        max_worker_port=start + rng.block_size - 1,
    )


def first_index(job_id: str, restart: int, rng: PortRange) -> int:
    """Where the search for this job's block starts; a restart starts elsewhere, away from
    ports the previous run may still hold."""
    return (job_number(job_id) + 17 * restart) % rng.blocks


def port_is_free(port: int) -> bool:
    """True when `port` can be bound on every IPv4 and (if present) IPv6 interface."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this node
        with sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                raise
    return True


CLAIM_PREFIX = "hpcrl-port-block-"
"""Abstract socket name of a claim, followed by the block's first port."""


def claim_holder_uid(name: str) -> int | None:
    """The uid of the process listening on abstract socket `name`, None when none answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            probe.connect(f"\0{name}")
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


class PortClaims:
    """The port blocks this process has claimed on its node, held until `release`.

    This user's other agents on the node (of any job) see a claimed block as taken; other
    users' claims are ignored (see the module docstring). Where abstract Unix sockets do not
    exist (not Linux), or another user squats the name, claiming succeeds without holding
    anything and the probe alone decides.
    """

    def __init__(self, prefix: str = CLAIM_PREFIX, uid: int | None = None) -> None:
        self.prefix = prefix
        self.uid = os.getuid() if uid is None else uid
        self._held: dict[int, socket.socket | None] = {}

    def name(self, block: PortBlock) -> str:
        """The abstract socket name of this user's claim on `block` (without the NUL)."""
        return f"{self.prefix}{self.uid}-{block.gcs}"

    def claim(self, block: PortBlock) -> bool:
        """True when this process now holds `block` (or already did); False when another
        process of this user does."""
        key = block.gcs
        if key in self._held:
            return True
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(f"\0{self.name(block)}")
            sock.listen(128)  # answers `claim_holder_uid`
        except OSError as exc:
            if sock is not None:
                sock.close()
            if exc.errno == errno.EADDRINUSE and claim_holder_uid(self.name(block)) == self.uid:
                return False
            sock = None  # no abstract sockets, or a name another user squats: the probe decides
        self._held[key] = sock
        return True

    def release(self, block: PortBlock | None = None) -> None:
        """Give back `block`, or every block held."""
        keys = list(self._held) if block is None else [block.gcs]
        for key in keys:
            sock = self._held.pop(key, None)
            if sock is not None:
                sock.close()


def find_free_block(
    rng: PortRange,
    start_index: int,
    ports_of: Callable[[PortBlock], Iterable[int]] = PortBlock.all_ports,
    is_free: Callable[[int], bool] = port_is_free,
    claims: PortClaims | None = None,
) -> PortBlock:
    """The first block from `start_index` on whose `ports_of(block)` are all free (and, with
    `claims`, that no other agent on this node has claimed; the block returned stays claimed)."""
    for step in range(rng.blocks):
        block = block_at(rng, start_index + step)
        if claims is not None and not claims.claim(block):
            continue
        if all(is_free(p) for p in ports_of(block)):
            return block
        if claims is not None:
            claims.release(block)
    raise PortError(
        f"every one of the {rng.blocks} port blocks in {rng.base}..{rng.limit} has a port in "
        "use on this node; widen the range (`ray.port_base`) or stop stale Ray processes"
    )
