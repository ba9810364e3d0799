"""Launch: this node's address and ports, the rendezvous, and the Ray process (and, on the
head, the GCS watcher) started in the job's container.

The head picks its address and a free port block, writes the auth token and publishes both;
a worker waits for that publication and joins, with its own per-node ports when the head's are
taken on its machine.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.jobfile import AgentJob
from hpcrl.agent.node import AgentError, Heartbeat, Node
from hpcrl.agent.ports import (
    PortBlock,
    PortClaims,
    PortError,
    block_at,
    find_free_block,
    first_index,
    port_is_free,
)
from hpcrl.agent.procs import (
    Child,
    port_closing,
    port_holders,
    processes_mentioning,
    unix_name_holders,
)
from hpcrl.agent.stop import Deadline
from hpcrl.allocation import Allocation, AllocationError, CgroupFiles, node_allocation
from hpcrl.netaddr import (
    NetworkPolicy,
    NodeAddress,
    choose_address,
    format_host,
    format_hostport,
    host_name_addresses,
    socket_ifname_env,
)
from hpcrl.payloads import verl
from hpcrl.profile_load import profile_from_dict
from hpcrl.profiles import env_for_ray_version
from hpcrl.runstate import RAY_RESOURCES

WATCHER = "gcs_watch.py"
LAUNCHER = "ray_launch.py"


HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}
"""How fast the GCS declares a silent node dead (Ray's defaults, 3 s apart with 10 s timeouts,
take 30 s or more for a node whose network is cut; a dead process is seen at once either way):
five missed checks 2 s apart. The profile's `env` may set other values."""


def taken_port(block: PortBlock, claims: PortClaims) -> str:
    """Why `block` cannot be used here: the agent that claimed it, or `port P is held by pid N
    (command)` for its first port in use."""
    holders = unix_name_holders(claims.name(block))
    if holders:
        return f"claimed by another hpcrl agent on this node: {', '.join(holders)}"
    for port in block.all_ports():
        if not port_is_free(port):
            holders = port_holders(port)
            if holders:
                return f"port {port} is held by {', '.join(holders)}"
            if port_closing(port):
                return f"port {port} has connections of a stopped process closing (TIME_WAIT)"
            return f"port {port} is in use (its process is not visible here: another user's)"
    return "its ports were freed since"


def ray_version_env(job: AgentJob, ray_version: str) -> dict[str, str]:
    """The profile's `ray.version_env` variables that apply to `ray_version`."""
    if not job.version_env:
        return {}

    return dict(env_for_ray_version(profile_from_dict(job.profile).ray.version_env, ray_version))


INHERITED_TOKEN = "RAY_AUTH_TOKEN"
"""Ray's token variable, which would win over the job's token file."""
NO_METRICS_ENV = {"RAY_enable_metrics_collection": "0"}
"""Without the dashboard, nothing reads Ray's metrics: this closes each node's metrics export
port, an unauthenticated Prometheus endpoint on every interface.

What stays reachable from other users of the cluster (measured by
`tests/hpcrl/agent/test_ray.py::test_every_process_goes_through_the_container_seam`, which
lists the listening sockets of the job's port block): on every interface, the GCS, node
manager, object manager and dashboard agent gRPC ports, all behind the job's token (a driver
without it is refused); on every interface of the head, the autoscaler and dashboard metric
ports (Prometheus text, read-only: node counts and request statistics, no control), which Ray
binds to all interfaces for a non-loopback head and offers no switch for; the others on the
node address or loopback. torch.distributed's store is described in `trainer.parallel`."""


def ray_start_argv(
    job: AgentJob, head: bool, address: str, temp_dir: Path, ports: PortBlock, gcs: str,
    alloc: Allocation,
) -> list[str]:
    """`ray start ...` for this node (the arguments after `ray`): sized to the job's allocation,
    on this run's address, ports and temp dir; the head with or without the dashboard, a worker
    joining `gcs`."""
    argv = [
        "start",
        "--block",
        f"--node-ip-address={format_host(address)}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *alloc.ray_start_args(),
        *ports.ray_start_args(head, job.dashboard),
    ]
    if head:
        argv += ["--head", f"--include-dashboard={str(job.dashboard).lower()}"]
        if job.dashboard:
            argv += [f"--dashboard-host={job.dashboard_host}"]
    else:
        argv += [f"--address={gcs}"]
    return argv


@dataclass
class HeadCluster:
    """What the head launched: its address, the GCS address, the Ray processes' environment,
    its Ray process, and the watcher's output lines (JSON, one per change of the GCS's alive
    nodes)."""

    address: NodeAddress
    gcs: str
    env: dict[str, str]
    ray: Child
    gcs_lines: queue.Queue[str]
    cpus: int | None = None
    """CPUs Ray offers on this node (None: Ray counts them)."""


@dataclass
class Launcher:
    """Starts this node's part of the Ray cluster."""

    node: Node
    heartbeat: Heartbeat
    addresses: Callable[[], list[NodeAddress]]
    claims: PortClaims
    """The port blocks this agent holds on its node (released by the agent when it exits)."""
    cgroup: CgroupFiles = field(default_factory=CgroupFiles)
    """Where the allocation reads the cgroup, /proc/meminfo and /dev/shm (a fake tree in tests)."""

    def head(self) -> HeadCluster:
        """Address, port block, token, publication; then Ray's head and the GCS watcher."""
        node, job, ctx = self.node, self.node.job, self.node.ctx
        addr = self._address(job.network)
        start = first_index(ctx.job_id, ctx.restart, job.ports)
        first = block_at(job.ports, start)
        try:
            ports = find_free_block(job.ports, start, claims=self.claims)
        except PortError as exc:
            why = taken_port(first, self.claims)
            raise PortError(f"{exc}; in the first block tried, {why}") from None
        if ports != first:
            node.log.info("port block %d-%d is taken here (%s); using %d-%d", first.gcs,
                          first.max_worker_port, taken_port(first, self.claims), ports.gcs,
                          ports.max_worker_port)
        token = rdv.write_token(node.paths)
        gcs = format_hostport(addr.address, ports.gcs)
        self._describe(addr, ports)
        self._copy_helpers()
        info = {
            "job_id": ctx.job_id,
            "restart": ctx.restart,
            "run": ctx.run,
            "head": ctx.hostname,
            "address": addr.address,
            "gcs_address": gcs,
            "family": addr.family,
            "ports": ports.to_dict(),
            "token_path": str(token),
            "nodes": list(ctx.nodes),
        }
        node.retry.run(lambda: rdv.publish(node.paths, info), f"`{node.paths.rendezvous}`")
        node.log.info(
            "head address %s (%s), GCS %s, port block %d-%d, token in run directory",
            addr.address,
            addr.interface or "interface unknown",
            gcs,
            ports.gcs,
            ports.max_worker_port,
        )
        self.heartbeat.write("starting")
        alloc = self.allocation()
        node.state.append(RAY_RESOURCES, allocation=alloc.to_dict())
        env = self._ray_env(token, ports, addr.interface, alloc)
        ray = self._start_ray(True, addr.address, ports, gcs, env, alloc)
        lines: queue.Queue[str] = queue.Queue()
        argv = [node.python, str(node.paths.helper(WATCHER)), gcs, "0.1"]
        log = node.paths.node_log("gcs-watch", ctx.node_rank, ctx.hostname)
        node.start("watch", "gcs-watch", argv, env, str(node.tmp), log,
                   str(node.tmp), on_line=lines.put, death_signal=signal.SIGKILL)
        return HeadCluster(addr, gcs, env, ray, lines, alloc.cpus)

    def worker(self, keep_waiting: Callable[[], str | None]) -> Child:
        """Wait for the head's publication (or `keep_waiting`'s reason to stop), then start Ray;
        returns the Ray process."""
        node, job, ctx = self.node, self.node.job, self.node.ctx
        self.heartbeat.write("waiting")
        info = rdv.wait_for_publication(
            node.paths, ctx.nodes[0], job.join_timeout_s, keep_waiting=keep_waiting,
            job_id=ctx.job_id,
        )
        addr = self._address(NetworkPolicy(job.network.interface, info["family"]))
        head_ports = PortBlock.from_dict(info["ports"])
        ports = head_ports
        same_host = addr.address == info["address"]  # several agents on one machine
        head_index = (head_ports.gcs - job.ports.base) // job.ports.block_size
        start = head_index + (ctx.node_rank if same_host else 0)
        local = find_free_block(job.ports, start, ports_of=PortBlock.node_ports, claims=self.claims)
        if local != head_ports:
            ports = head_ports.with_node_ports_from(local)
            node.log.info(
                "head's per-node ports are taken here (%s); using %d-%d on this node",
                "the head runs on this machine" if same_host else taken_port(head_ports, self.claims),
                ports.node_manager,
                ports.max_worker_port,
            )
        self._describe(addr, ports)
        self.heartbeat.write("starting")
        alloc = self.allocation()
        env = self._ray_env(Path(info["token_path"]), ports, addr.interface, alloc)
        return self._start_ray(False, addr.address, ports, info["gcs_address"], env, alloc)

    def allocation(self) -> Allocation:
        """What this job was granted on this node (Slurm, the cgroup, the profile's `ray.*`
        overrides): Ray is started with exactly that; logged and kept in the heartbeat file."""
        node = self.node
        try:
            alloc = node_allocation(node.env, node.job.ray_overrides, self.cgroup)
        except AllocationError as exc:
            raise AgentError(f"cannot size Ray on `{node.ctx.hostname}`: {exc}") from None
        node.log.info("allocation on this node: %s", alloc.describe())
        self.heartbeat.info["allocation"] = alloc.to_dict()
        return alloc

    def _describe(self, addr: NodeAddress, ports: PortBlock) -> None:
        """What the other nodes learn of this one from its heartbeat file."""
        self.heartbeat.info = {
            "address": addr.address,
            "node_manager_port": ports.node_manager,
            "interface": addr.interface,
        }

    def _address(self, policy: NetworkPolicy) -> NodeAddress:
        return choose_address(self.addresses(), policy, host_name_addresses())

    def _ray_env(
        self, token: Path, ports: PortBlock, iface: str | None, alloc: Allocation
    ) -> dict[str, str]:
        """The environment of Ray's processes, the watch and the payload. The job's own token
        (`RAY_AUTH_TOKEN_PATH`) is the only one: Ray prefers a `RAY_AUTH_TOKEN` variable to the
        file, so one inherited from the submitting environment, the setup lines or the
        profile is dropped."""
        env = {
            **self.node.env,
            **HEALTH_CHECK_ENV,
            **self.node.job.env,
            **self._version_env(),
            **alloc.device_env,  # the devices this job was granted, over the profile's list
            **ports.env(),
            **socket_ifname_env(iface),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            **self._payload_kind_env(),
        }
        if not self.node.job.dashboard:  # nothing reads the metrics: no open Prometheus port
            env.update(NO_METRICS_ENV)
        env.pop(INHERITED_TOKEN, None)
        return env

    def _payload_kind_env(self) -> dict[str, str]:
        """What verl must find in Ray's own environment (`hpcrl.payloads.verl.ray_env`)."""
        node = self.node
        if not verl.is_verl(node.job.payload):
            return {}
        end = Deadline.learn(node.ctx, node.env, node.job, node.log).end_time
        return verl.ray_env(node.paths, end, node.job.signal_lead_s)

    def _version_env(self) -> dict[str, str]:
        """Profile variables chosen by the Ray version in the container (asked only if needed)."""
        node = self.node
        if not node.job.version_env:
            return {}
        argv, env = node.in_container(
            "version",
            [node.python, "-c", "import ray; print(ray.__version__)"],
            node.env,
            str(node.run_dir),
        )
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise AgentError(
                f"cannot read Ray's version in the container on `{node.ctx.hostname}` "
                f"({out.stderr.strip()[-300:]}); is Ray installed in the image?"
            )
        return ray_version_env(node.job, out.stdout.strip().splitlines()[-1])

    def _start_ray(
        self, head: bool, address: str, ports: PortBlock, gcs: str, env: dict[str, str],
        alloc: Allocation,
    ) -> Child:
        node, job = self.node, self.node.job
        self._remove_stale_temp_dirs()
        argv = ray_start_argv(job, head, address, node.tmp, ports, gcs, alloc)
        node.log.info("starting Ray %s: ray %s", "head" if head else "worker", " ".join(argv))
        # SIGTERM blocked in every Ray process, and a Ray without token auth refused (see
        # ray_launch.py); a worker's Ray CLI loads now and runs once the head node is alive
        go, timeout = ("-", "0") if head else (str(node.paths.head_alive), f"{job.join_timeout_s:.0f}")
        argv = [node.python, str(node.paths.helper(LAUNCHER)), go, timeout, "--", *argv]
        log = node.paths.node_log("ray-start", node.ctx.node_rank, node.ctx.hostname)
        ray = node.start("ray", "ray", argv, env, str(node.tmp), log,
                         str(node.tmp), death_signal=signal.SIGKILL)
        self.heartbeat.info["ray_pid"] = ray.pid
        return ray

    def _remove_stale_temp_dirs(self) -> None:
        """Temp dirs of this job's earlier runs on this node whose agent was killed (this
        user's only, and none in use)."""
        ctx, tmp = self.node.ctx, self.node.tmp
        for stale in tmp.parent.glob(f"hr-{ctx.job_id}-*-{ctx.node_rank}-*"):
            if stale == tmp or not stale.is_dir() or stale.stat().st_uid != os.getuid():
                continue
            if not processes_mentioning(str(stale)):
                shutil.rmtree(stale, ignore_errors=True)

    def _copy_helpers(self) -> None:
        """Put the scripts that run next to Ray (in the container) into the run directory,
        before the workers learn of it."""
        for name in (WATCHER, LAUNCHER):
            text = Path(__file__).with_name(name).read_text()
            rdv.atomic_write_text(self.node.paths.helper(name), text, 0o600)
