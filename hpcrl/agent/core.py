"""The node agent: rendezvous, Ray start, wait for the cluster, run the payload, end cleanly.

One agent runs on every node of a job. Rank 0 (the head) picks its address and a free port
block, writes the auth token and publishes both; the others wait for that file and join. The
head waits until the GCS lists every node alive, then runs the payload. Whatever ends first
(payload exit, a node's Ray or agent dying, a signal) ends the job on every node.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.agent import rendezvous as rdv
from hpcrl.agent import requeue as rq
from hpcrl.agent.jobfile import AgentJob, load_job
from hpcrl.agent.ports import PortBlock, find_free_block, first_index
from hpcrl.agent.procs import Child, kill_all, processes_mentioning
from hpcrl.netaddr import (
    NetworkPolicy,
    NodeAddress,
    choose_address,
    format_host,
    format_hostport,
    host_name_addresses,
    local_addresses,
    socket_ifname_env,
)
from hpcrl.slurm import SlurmError, show_job
from hpcrl.slurm_env import JobContext, job_context
from trainer.exit_codes import REQUEUE_EXIT_CODE

ContainerWrap = Callable[
    [AgentJob, Sequence[str], Mapping[str, str], Sequence[str], str, str],
    tuple[list[str], dict[str, str]],
]
"""(job, argv, env for the container, binds, workdir, container name) -> (argv that runs `argv`
in the job's container, variables to add to that command's own environment)."""

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TICK_S = 0.1
PAYLOAD_ARM_S = 30.0
"""A payload that does not handle the stop signal after this long gets it anyway."""
REQUEUE_FIRST_S = 60.0
"""With less time than this before the job's end, requeue before the teardown, not after: the
teardown (Ray stopped on every node, containers removed) can take 10-20 s on a loaded node, and
Slurm enforces the time limit on its own clock (its periodic check), so a requeue that comes
after the limit is killed with the job, which then ends TIMEOUT and never runs again."""
RAY_STOP_S = 10.0
WATCHER = "gcs_watch.py"
LAUNCHER = "ray_launch.py"
OCI_RUNTIMES = ("podman", "docker")


class AgentError(RuntimeError):
    """The job cannot go on; the message names the node and the cause."""


def container_wrap(
    job: AgentJob,
    argv: Sequence[str],
    env: Mapping[str, str],
    binds: Sequence[str],
    workdir: str,
    name: str,
) -> tuple[list[str], dict[str, str]]:
    """Runtime `none` runs `argv` as is; the others through `hpcrl.containers`."""
    if job.runtime == "none":
        return list(argv), dict(env)
    try:
        from hpcrl.containers import container_command  # type: ignore[import-not-found]
        from hpcrl.profiles import profile_from_dict  # type: ignore[import-not-found]
    except ImportError:
        raise AgentError(
            f"container runtime `{job.runtime}` needs `hpcrl.containers`, which this "
            "installation lacks; install the full hpcrl or set `container.runtime: none`"
        ) from None
    profile = profile_from_dict(job.profile)
    cmd = container_command(
        profile.container,
        argv,
        env,
        passthrough=job.secrets,
        binds=binds,
        workdir=workdir,
        name=name,
    )
    return list(cmd.argv), dict(cmd.env)


def ray_version_env(job: AgentJob, ray_version: str) -> dict[str, str]:
    """The profile's `ray.version_env` variables that apply to `ray_version`."""
    if not job.version_env:
        return {}
    from hpcrl.profiles import env_for_ray_version, profile_from_dict  # type: ignore[import-not-found]

    return dict(env_for_ray_version(profile_from_dict(job.profile).ray.version_env, ray_version))


@dataclass
class Outcome:
    """Why the job ended and with what status."""

    cause: str
    exit_code: int
    node: str


@dataclass
class _Flags:
    signals: list[int] = field(default_factory=list)


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
        self.paths = rdv.RunPaths(self.run_dir, self.ctx.restart)
        self.tag = f"{self.ctx.node_rank}-{self.ctx.hostname}"
        self.tmp = Path(f"/tmp/hr-{self.ctx.job_id}-{self.ctx.restart}-{self.ctx.node_rank}")
        self.log = logging.getLogger(f"hpcrl.agent.{self.tag}")
        self.flags = _Flags()
        self.ray: Child | None = None
        self.watch: Child | None = None
        self.payload: Child | None = None
        self.gcs_lines: queue.Queue[str] = queue.Queue()
        self.job: AgentJob | None = None
        self.self_keys: set[str] = set()
        self._node_info: dict[str, Any] = {}
        self._last_beat = 0.0
        self.end_time: float | None = self.ctx.end_time or (
            rq.end_time_from_env(self.env) if self.ctx.local else None
        )
        self.stop_reason: str | None = None
        """Why the payload was asked to stop (warning, clock, SIGTERM); None while it was not."""
        self.terminated_by: str | None = None
        """`SIGTERM` once Slurm (or anyone) asked the job to end; the agent then never requeues."""
        self._pending_stop: int | None = None
        self._requeue_target: str | None = None
        self._payload_started = 0.0
        self._ignored_failure = False

    # --- set-up ------------------------------------------------------------------------------

    def _setup_logging(self) -> None:
        self.paths.create(self.ctx.hostname)
        fmt = logging.Formatter(
            f"%(asctime)s hpcrl-agent[{self.ctx.hostname} rank {self.ctx.node_rank}] %(message)s"
        )
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        for handler in (
            logging.FileHandler(self.paths.logs / f"agent-{self.tag}.log"),
            logging.StreamHandler(sys.stderr),
        ):
            handler.setFormatter(fmt)
            self.log.addHandler(handler)

    def _install_signal_handlers(self) -> dict[int, Any]:
        """Handlers only note the signal; the main loop acts. Returns the previous handlers."""

        def note(signum: int, _frame: object) -> None:
            self.flags.signals.append(signum)

        return {sig: signal.signal(sig, note) for sig in FORWARDED_SIGNALS}

    def _address(self, policy: NetworkPolicy) -> NodeAddress:
        return choose_address(self.addresses(), policy, host_name_addresses())

    def _ray_env(self, token: Path, ports: PortBlock, iface: str | None) -> dict[str, str]:
        assert self.job is not None
        return {
            **self.env,
            **self.job.env,
            **self._version_env(),
            **ports.env(),
            **socket_ifname_env(iface),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def _python(self) -> str:
        assert self.job is not None
        return self.job.python or sys.executable

    def _container_name(self, role: str) -> str:
        return f"hr-{self.ctx.job_id}-{self.ctx.restart}-{self.ctx.node_rank}-{role}"

    def _in_container(
        self, role: str, argv: Sequence[str], env: Mapping[str, str], workdir: str
    ) -> tuple[list[str], dict[str, str]]:
        """The command running `argv` in the job's container, and its process environment."""
        assert self.job is not None
        # the container gets what the agent adds and, always, the profile's environment (the batch
        # script exported it to the agent too, but a container starts from a clean environment)
        extra = {k: v for k, v in env.items() if k in self.job.env or self.env.get(k) != v}
        binds = [str(self.run_dir), str(self.tmp)]
        wrapped, add = self.wrap(self.job, argv, extra, binds, workdir, self._container_name(role))
        return wrapped, {**env, **add}

    def _version_env(self) -> dict[str, str]:
        """Profile variables chosen by the Ray version in the container (asked only if needed)."""
        assert self.job is not None
        if not self.job.version_env:
            return {}
        argv, env = self._in_container(
            "version",
            [self._python(), "-c", "import ray; print(ray.__version__)"],
            self.env,
            str(self.run_dir),
        )
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise AgentError(
                f"cannot read Ray's version in the container on `{self.ctx.hostname}` "
                f"({out.stderr.strip()[-300:]}); is Ray installed in the image?"
            )
        return ray_version_env(self.job, out.stdout.strip().splitlines()[-1])

    def _remove_container(self, role: str) -> None:
        """Podman/Docker keep a container running when their client is killed: remove it."""
        assert self.job is not None
        if self.job.runtime not in OCI_RUNTIMES:
            return
        binary = str(self.job.container.get("binary") or self.job.runtime)
        try:
            subprocess.run(
                [binary, "rm", "-f", "--ignore", self._container_name(role)],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self.log.info("could not remove container %s: %s", self._container_name(role), exc)

    def _start_ray(
        self, head: bool, address: str, ports: PortBlock, gcs: str, env: dict[str, str]
    ) -> None:
        assert self.job is not None
        self._remove_stale_temp_dirs()
        self.tmp.mkdir(mode=0o700, parents=True)
        argv = [
            "start",
            "--block",
            f"--node-ip-address={format_host(address)}",
            f"--temp-dir={self.tmp}",
            "--disable-usage-stats",
            *ports.ray_start_args(head, self.job.dashboard),
        ]
        if head:
            argv += ["--head", f"--include-dashboard={str(self.job.dashboard).lower()}"]
            if self.job.dashboard:
                argv += [f"--dashboard-host={self.job.dashboard_host}"]
        else:
            argv += [f"--address={gcs}"]
        self.log.info("starting Ray %s: ray %s", "head" if head else "worker", " ".join(argv))
        if head:
            argv = [self._python(), "-m", "ray.scripts.scripts", *argv]
        else:  # Ray's CLI loads now and runs once the head node is alive (see ray_launch.py)
            go, timeout = str(self.paths.head_alive), f"{self.job.join_timeout_s:.0f}"
            argv = [self._python(), str(self.paths.root / LAUNCHER), go, timeout, "--", *argv]
        wrapped, proc_env = self._in_container("ray", argv, env, str(self.tmp))
        self.ray = Child(
            "ray",
            wrapped,
            proc_env,
            self.paths.logs / f"ray-start-{self.tag}.log",
            cwd=str(self.tmp),
        )

    def _remove_stale_temp_dirs(self) -> None:
        """Temp dirs of this job's earlier runs on this node whose agent was killed."""
        pattern = f"hr-{self.ctx.job_id}-*-{self.ctx.node_rank}"
        for stale in self.tmp.parent.glob(pattern):
            if stale == self.tmp or not processes_mentioning(str(stale)):
                shutil.rmtree(stale, ignore_errors=True)

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._setup_logging()
        except (OSError, rdv.RendezvousError) as exc:
            print(f"hpcrl-agent[{self.ctx.hostname}]: {exc}", file=sys.stderr)
            return 1
        previous = self._install_signal_handlers()
        outcome = Outcome("agent error", 1, self.ctx.hostname)
        try:
            nonce = self.env.get(rdv.CANARY_ENV)
            if nonce:
                rdv.verify_canary(self.run_dir, nonce, self.ctx.hostname)
            self.job = load_job(self.run_dir)
            if self.job.nodes != self.ctx.num_nodes:
                self.log.info(
                    "job asked for %d nodes, the allocation has %d; using %d",
                    self.job.nodes,
                    self.ctx.num_nodes,
                    self.ctx.num_nodes,
                )
            outcome = self._run_head() if self.ctx.is_head else self._run_worker()
        except Exception as exc:  # every failure ends the job with a message naming the node
            outcome = Outcome(f"{type(exc).__name__}: {exc}", 1, self.ctx.hostname)
            self.log.error("node %s failed: %s", self.ctx.hostname, exc)
            try:
                rdv.request_stop(self.paths, self.ctx.node_rank, self.ctx.hostname, outcome.cause)
            except OSError:
                pass
        finally:
            self._teardown(outcome)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return outcome.exit_code

    def _write_state(self, state: str, **extra: Any) -> None:
        rdv.write_node(
            self.paths,
            self.ctx.node_rank,
            {"host": self.ctx.hostname, "state": state, **self._node_info, **extra},
        )

    def _beat(self, state: str) -> None:
        """Refresh this node's file every 2 s: the heartbeat the other nodes watch."""
        if time.monotonic() - self._last_beat > 2:
            self._write_state(state)
            self._last_beat = time.monotonic()

    def _run_head(self) -> Outcome:
        assert self.job is not None
        self._learn_end_time()
        addr = self._address(self.job.network)
        ports = find_free_block(
            self.job.ports, first_index(self.ctx.job_id, self.ctx.restart, self.job.ports)
        )
        token = rdv.write_token(self.paths)
        gcs = format_hostport(addr.address, ports.gcs)
        self._node_info = {
            "address": addr.address,
            "node_manager_port": ports.node_manager,
            "interface": addr.interface,
        }
        self._copy_helpers()
        rdv.publish(
            self.paths,
            {
                "job_id": self.ctx.job_id,
                "restart": self.ctx.restart,
                "head": self.ctx.hostname,
                "address": addr.address,
                "gcs_address": gcs,
                "family": addr.family,
                "ports": ports.to_dict(),
                "token_path": str(token),
                "nodes": list(self.ctx.nodes),
            },
        )
        self.log.info(
            "head address %s (%s), GCS %s, port block %d-%d, token in run directory",
            addr.address,
            addr.interface or "interface unknown",
            gcs,
            ports.gcs,
            ports.max_worker_port,
        )
        self._write_state("starting")
        env = self._ray_env(token, ports, addr.interface)
        self._start_ray(True, addr.address, ports, gcs, env)
        self._node_info["ray_pid"] = self.ray.pid if self.ray else None
        self._start_watch(gcs, env)
        failed = self._wait_for_cluster()
        if failed:
            return failed
        self._write_state("running")
        return self._run_payload(addr, gcs, token, env)

    def _run_worker(self) -> Outcome:
        assert self.job is not None
        head = self.ctx.nodes[0]
        self._write_state("waiting")
        info = rdv.wait_for_publication(
            self.paths, head, self.job.join_timeout_s, keep_waiting=self._early_stop_reason
        )
        policy = NetworkPolicy(self.job.network.interface, info["family"])
        addr = self._address(policy)
        head_ports = PortBlock.from_dict(info["ports"])
        ports = head_ports
        same_host = addr.address == info["address"]  # several agents on one machine
        if same_host or not all(map(_free, head_ports.node_ports())):
            head_index = (head_ports.gcs - self.job.ports.base) // self.job.ports.block_size
            local = find_free_block(
                self.job.ports, head_index + self.ctx.node_rank, ports_of=PortBlock.node_ports
            )
            ports = head_ports.with_node_ports_from(local)
            self.log.info(
                "head's per-node ports are taken here; using %d-%d on this node",
                ports.node_manager,
                ports.max_worker_port,
            )
        self._node_info = {
            "address": addr.address,
            "node_manager_port": ports.node_manager,
            "interface": addr.interface,
        }
        self._write_state("starting")
        env = self._ray_env(Path(info["token_path"]), ports, addr.interface)
        self._start_ray(False, addr.address, ports, info["gcs_address"], env)
        self._node_info["ray_pid"] = self.ray.pid if self.ray else None
        return self._worker_loop()

    # --- head: waiting for the cluster ---------------------------------------------------------

    def _copy_helpers(self) -> None:
        """Put the scripts that run next to Ray (in the container) into the run directory,
        before the workers learn of it."""
        for name in (WATCHER, LAUNCHER):
            text = Path(__file__).with_name(name).read_text()
            rdv.atomic_write_text(self.paths.root / name, text, 0o600)

    def _start_watch(self, gcs: str, env: dict[str, str]) -> None:
        argv = [self._python(), str(self.paths.root / WATCHER), gcs, "0.1"]
        wrapped, proc_env = self._in_container("watch", argv, env, str(self.tmp))
        self.watch = Child(
            "gcs-watch",
            wrapped,
            proc_env,
            self.paths.logs / f"gcs-watch-{self.tag}.log",
            cwd=str(self.tmp),
            on_line=self.gcs_lines.put,
        )

    def _alive_keys(self) -> set[str] | None:
        """The newest set of alive nodes reported by the watcher, None if nothing new."""
        import json

        latest = None
        while True:
            try:
                line = self.gcs_lines.get_nowait()
            except queue.Empty:
                return latest
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if "alive" in data:
                latest = set(data["alive"])

    def _joined_ranks(self, alive: set[str]) -> tuple[set[int], dict[int, dict[str, Any]]]:
        arrived = rdv.read_nodes(self.paths)
        joined = {
            r
            for r, d in arrived.items()
            if f"{d.get('address')}:{d.get('node_manager_port')}" in alive
        }
        return joined, arrived

    def _wait_for_cluster(self) -> Outcome | None:
        assert self.job is not None
        n = self.ctx.num_nodes
        deadline = time.monotonic() + self.job.join_timeout_s
        alive: set[str] = set()
        shown, last_note = -1, time.monotonic()
        while True:
            warned = self._warning()
            if warned:
                self.log.info("%s before the payload started: not starting it", warned)
                return self._after_requeue_request(
                    f"{warned} before the payload started", REQUEUE_EXIT_CODE
                )
            newest = self._alive_keys()
            if newest is not None:
                alive = newest
            joined, arrived = self._joined_ranks(alive)
            if 0 in joined and not self.paths.head_alive.exists():
                rdv.atomic_write_text(self.paths.head_alive, f"{time.time()}\n", 0o600)
                self.log.info("head node alive in the GCS; workers start Ray now")
            if len(joined) != shown:
                shown = len(joined)
                self.log.info("%d/%d nodes joined", shown, n)
            if len(joined) == n:
                self.self_keys = alive
                return None
            failed = self._common_failure() or self._stop_requested()
            if failed:
                return failed
            self._beat("starting")
            now = time.monotonic()
            missing = rdv.missing_nodes(self.ctx.nodes, arrived, joined)
            if now - last_note > 10:
                self.log.info("%d/%d nodes joined; waiting for %s", shown, n, ", ".join(missing))
                last_note = now
            if now > deadline:
                raise AgentError(
                    f"only {len(joined)}/{n} nodes joined the Ray cluster within "
                    f"{self.job.join_timeout_s:.0f} s; missing: {'; '.join(missing)}. See their "
                    f"agent logs in `{self.paths.logs}`"
                )
            time.sleep(TICK_S)

    # --- failure detection shared by head and workers -------------------------------------------

    def _early_stop_reason(self) -> str | None:
        stop = rdv.read_stop(self.paths)
        if stop:
            return f"{stop.get('by')} asked to stop: {stop.get('reason')}"
        for sig in STOPPING_SIGNALS:
            if sig in self.flags.signals:
                return f"this agent got {signal.Signals(sig).name}"
        return None

    def _common_failure(self) -> Outcome | None:
        if self.ray is not None and self.ray.poll() is not None:
            return Outcome(
                f"Ray on `{self.ctx.hostname}` exited with code {self.ray.poll()}; "
                f"see `{self.ray.log_path}`",
                1,
                self.ctx.hostname,
            )
        if self.payload is None and self.ctx.is_head:
            for sig in STOPPING_SIGNALS:
                if sig in self.flags.signals:
                    name = signal.Signals(sig).name
                    return Outcome(
                        f"{name} before the payload started", 128 + sig, self.ctx.hostname
                    )
        return None

    def _stop_requested(self) -> Outcome | None:
        stop = rdv.read_stop(self.paths)
        if not stop:
            return None
        return Outcome(
            f"node `{stop.get('by')}` ended the job: {stop.get('reason')}", 1, str(stop.get("by"))
        )

    def _lost_nodes(self, alive: set[str]) -> Outcome | None:
        assert self.job is not None
        arrived = rdv.read_nodes(self.paths)
        for rank, d in sorted(arrived.items()):
            key = f"{d.get('address')}:{d.get('node_manager_port')}"
            if key not in alive:
                return Outcome(
                    f"Ray on node `{d.get('host')}` (rank {rank}) is no longer alive in the GCS",
                    1,
                    str(d.get("host")),
                )
        for rank in rdv.stale_nodes(arrived, self.job.heartbeat_timeout_s):
            if rank != self.ctx.node_rank:
                host = arrived[rank].get("host")
                return Outcome(
                    f"agent on `{host}` (rank {rank}) stopped its heartbeat", 1, str(host)
                )
        return None

    # --- head: payload ------------------------------------------------------------------------

    def _payload_env(self, addr: NodeAddress, gcs: str, ray_env: dict[str, str]) -> dict[str, str]:
        return {
            **ray_env,
            "RAY_ADDRESS": gcs,
            "MASTER_ADDR": format_host(addr.address),
            "HPCRL_RUN_DIR": str(self.run_dir),
            "HPCRL_RESTART": str(self.ctx.restart),
            "HPCRL_JOB_ID": self.ctx.job_id,
            "HPCRL_NUM_NODES": str(self.ctx.num_nodes),
            **({rq.END_TIME_ENV: f"{self.end_time:.0f}"} if self.end_time else {}),
        }

    def _run_payload(
        self, addr: NodeAddress, gcs: str, token: Path, ray_env: dict[str, str]
    ) -> Outcome:
        assert self.job is not None
        env = self._payload_env(addr, gcs, ray_env)
        workdir = str(self.job.container.get("workdir") or self.run_dir)
        argv, proc_env = self._in_container("payload", self.job.payload, env, workdir)
        self.log.info(
            "all %d nodes joined; starting the payload: %s",
            self.ctx.num_nodes,
            " ".join(self.job.payload),
        )
        host_cwd = workdir if self.job.runtime == "none" else str(self.run_dir)
        self.payload = Child(
            "payload",
            argv,
            proc_env,
            self.paths.logs / "payload.log",
            cwd=host_cwd,
            echo=sys.stdout,
        )
        self._payload_started = time.monotonic()
        alive = self.self_keys
        while True:
            self._take_signals()
            if self.stop_reason is None:
                warned = self._warning()
                if warned:
                    self._ask_payload_to_stop(warned)
            self._deliver_stop()
            code = self.payload.poll()
            if code is not None:
                return self._payload_outcome(code if code >= 0 else 128 - code)
            newest = self._alive_keys()
            if newest is not None:
                alive = newest
            failed = self._common_failure() or self._stop_requested() or self._lost_nodes(alive)
            if failed and self.stop_reason is None:
                return failed
            if failed and not self._ignored_failure:  # Slurm's SIGTERM reaches Ray too
                self._ignored_failure = True
                self.log.info("%s; waiting for the payload, which was asked to stop", failed.cause)
            self._beat("running")
            time.sleep(TICK_S)

    # --- head: stop and requeue ---------------------------------------------------------------

    def _take_signals(self) -> None:
        """Act on the signals the handler noted: SIGTERM goes to the payload as is (and means
        Slurm ends the job); the warning signal becomes a stop request; others pass through."""
        assert self.job is not None
        while self.flags.signals:
            sig = self.flags.signals.pop(0)
            name = signal.Signals(sig).name
            if sig == signal.SIGTERM:
                self.terminated_by = self.terminated_by or name
                self.stop_reason = self.stop_reason or name
            elif name == f"SIG{self.job.warning_signal}":
                self._ask_payload_to_stop(f"the warning signal {name} reached the agent")
                continue
            if self.payload is not None:
                self.log.info("forwarding %s to the payload", name)
                self.payload.send(sig)

    def _warning(self) -> str | None:
        """Why the time limit is near: the batch script noted Slurm's warning, or the agent's
        own clock says the warning is due (Slurm may signal late, or, through submitit, only to
        a shell that cannot act on it)."""
        assert self.job is not None
        if self.paths.warning.exists():
            return "Slurm's time-limit warning reached the batch script"
        warning = int(getattr(signal, f"SIG{self.job.warning_signal}"))
        if self.payload is None and warning in self.flags.signals:
            return f"the warning signal SIG{self.job.warning_signal} reached the agent"
        now = time.time()
        if rq.warning_due(self.end_time, self.job.signal_lead_s, now):
            assert self.end_time is not None
            return (
                f"{rq.describe_end(self.end_time, now)} (the warning is due "
                f"{self.job.signal_lead_s:.0f} s before)"
            )
        return None

    def _ask_payload_to_stop(self, reason: str) -> None:
        assert self.job is not None
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._pending_stop = int(getattr(signal, f"SIG{self.job.stop_signal}"))
        self.log.info(
            "%s; asking the payload to checkpoint and stop (SIG%s)", reason, self.job.stop_signal
        )

    def _deliver_stop(self) -> None:
        """Send the pending stop signal once the payload handles it (a signal that arrives
        before its handler is installed would kill it), or after `PAYLOAD_ARM_S` anyway."""
        if self._pending_stop is None or self.payload is None:
            return
        waited = time.monotonic() - self._payload_started
        if waited < PAYLOAD_ARM_S and not self._payload_handles(self._pending_stop):
            return
        self.payload.send(self._pending_stop)
        self._pending_stop = None

    def _payload_handles(self, sig: int) -> bool:
        assert self.job is not None and self.payload is not None
        if self.job.runtime != "none":  # the runtime's client relays signals into the container
            return True
        try:
            status = Path(f"/proc/{self.payload.pid}/status").read_text()
        except OSError:
            return True
        return sig in rq.caught_signals(status)

    def _payload_outcome(self, status: int) -> Outcome:
        cause = f"payload exited with status {status}"
        if self.stop_reason:
            cause += f" after the stop request ({self.stop_reason})"
        if status != REQUEUE_EXIT_CODE:
            return Outcome(cause, status, self.ctx.hostname)
        return self._after_requeue_request(f"{cause}: checkpointed, asks to be requeued", status)

    def _after_requeue_request(self, what: str, status: int) -> Outcome:
        """Decide with `decide_requeue`; the outcome names the decision. The requeue itself
        comes after the teardown (Slurm ends every process of the job at once and kills what is
        left `KillWait` later), or right away when the job's end is too near to wait."""
        assert self.job is not None
        preempted = bool(self.terminated_by) and not self.ctx.local and self._preempted()
        decision = rq.decide_requeue(
            self.ctx, self.job.max_requeues, str(self.run_dir), self.terminated_by, preempted
        )
        message = decision.message
        if decision.action == rq.REQUEUE:
            self._requeue_target = rq.requeue_target(self.ctx)
            left = None if self.end_time is None else self.end_time - time.time()
            if left is not None and left < REQUEUE_FIRST_S:
                message = f"{message}; {self._requeue_now()}"
        log = self.log.error if decision.action == rq.MAX_REACHED else self.log.info
        log("%s", message)
        return Outcome(f"{what}; {message}", status, self.ctx.hostname)

    def _requeue_now(self) -> str:
        """Requeue `_requeue_target` once; returns what happened."""
        assert self.job is not None and self._requeue_target is not None
        target, self._requeue_target = self._requeue_target, None
        if signal.SIGTERM in self.flags.signals and not self.terminated_by:
            return (f"not requeueing job {target}: SIGTERM arrived meanwhile (`scancel`, "
                    "preemption or `scontrol requeue`); Slurm decides whether it runs again")
        try:
            self._requeue(target)
        except (SlurmError, OSError, subprocess.SubprocessError) as exc:
            if rq.already_requeued(str(exc)):
                return f"Slurm is already requeueing job {target}"
            self.log.error("could not requeue job %s: %s", target, exc)
            return f"could not requeue job {target}: {exc}"
        return (
            f"requeued job {target} with `scontrol requeue` (restart {self.ctx.restart + 1} of "
            f"at most {self.job.max_requeues})"
        )

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
        from hpcrl.slurm import parse_slurm_time

        self.end_time = parse_slurm_time(info.get("EndTime", "")) or self.end_time
        return True

    def _requeue(self, target: str) -> None:
        """The one place that requeues the job (on the host, never in the container)."""
        rq.scontrol_requeue(target)

    def _learn_end_time(self) -> None:
        """When Slurm ends this job: `SLURM_JOB_END_TIME`, else `scontrol show job`."""
        assert self.job is not None
        if self.end_time is None and not self.ctx.local:
            try:
                self.end_time = rq.scontrol_end_time(self.ctx.job_id)
            except (SlurmError, OSError) as exc:
                self.log.info("cannot read the job's end time from Slurm: %s", exc)
        if self.end_time is not None:
            self.log.info(
                "%s; the payload is asked to stop %.0f s before",
                rq.describe_end(self.end_time, time.time()),
                self.job.signal_lead_s,
            )

    # --- worker -------------------------------------------------------------------------------

    def _worker_loop(self) -> Outcome:
        assert self.job is not None
        term_at: float | None = None
        while True:
            stop = rdv.read_stop(self.paths)
            if stop:
                by = stop.get("by")
                mine = stop.get("rank") == self.ctx.node_rank
                return Outcome(
                    f"stop requested by `{by}`: {stop.get('reason')}", 1 if mine else 0, str(by)
                )
            failed = self._common_failure()
            if failed:
                return failed
            head = rdv.read_nodes(self.paths).get(0)
            if head and rdv.stale_nodes({0: head}, self.job.heartbeat_timeout_s):
                return Outcome(
                    f"the head `{self.ctx.nodes[0]}` stopped its heartbeat", 1, self.ctx.nodes[0]
                )
            if self.flags.signals:
                sigs = [signal.Signals(s).name for s in self.flags.signals]
                self.flags.signals.clear()
                self.log.info("got %s; Ray stays up until the head ends the job", ", ".join(sigs))
                if ("SIGTERM" in sigs or "SIGINT" in sigs) and term_at is None:
                    term_at = time.monotonic()
            if term_at is not None and time.monotonic() - term_at > 10 * self.job.grace_s:
                return Outcome(
                    "SIGTERM and the head did not end the job",
                    128 + signal.SIGTERM,
                    self.ctx.hostname,
                )
            self._beat("running")
            time.sleep(TICK_S)

    # --- teardown -----------------------------------------------------------------------------

    def _teardown(self, outcome: Outcome) -> None:
        grace = self.job.grace_s if self.job else 10.0
        code = outcome.exit_code if outcome.cause.startswith("payload exited") else None
        try:  # the first request names the cause; later ones change nothing
            rdv.request_stop(self.paths, self.ctx.node_rank, self.ctx.hostname, outcome.cause, code)
            if self.ctx.is_head:  # Slurm may kill the rest of the teardown (`KillWait`)
                rdv.atomic_write_text(self.paths.root / "summary.txt", self._headline(outcome) + "\n")
        except OSError:
            pass
        if self.payload is not None and self.payload.poll() is None:
            self.log.info("stopping the payload (SIGTERM, SIGKILL after %.0f s)", grace)
            self.payload.stop(grace)
        elif self.payload is not None:
            self.payload.close()
        for role, child in (("watch", self.watch), ("ray", self.ray)):
            if child is not None:
                child.stop(RAY_STOP_S if role == "ray" else 1.0, term_group=role != "ray")
        if self.job is not None:
            for role, child in (
                ("payload", self.payload),
                ("watch", self.watch),
                ("ray", self.ray),
            ):
                if child is not None:
                    self._remove_container(role)
        leftovers = processes_mentioning(str(self.tmp))
        if leftovers:
            self.log.info("killing %d leftover processes of this run", len(leftovers))
            kill_all(leftovers)
        self._keep_ray_logs()
        summary = f"node {self.ctx.hostname} (rank {self.ctx.node_rank}): {outcome.cause}; exit {outcome.exit_code}"
        self.log.info("summary: %s", summary)
        try:
            self._write_state("exited", summary=summary, exit_code=outcome.exit_code)
        except OSError:
            pass
        if self.ctx.is_head:
            self._write_summary(outcome)
        if self._requeue_target is not None:
            done = self._requeue_now()
            self.log.info("%s", done)
            with open(self.paths.root / "summary.txt", "a") as fh:
                fh.write(done + "\n")
        for handler in list(self.log.handlers):
            handler.close()
            self.log.removeHandler(handler)

    def _keep_ray_logs(self) -> None:
        src = self.tmp / "session_latest" / "logs"
        if src.is_dir():
            shutil.copytree(
                src,
                self.paths.logs / f"ray-{self.tag}",
                dirs_exist_ok=True,
                ignore_dangling_symlinks=True,
                symlinks=False,
            )
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _headline(self, outcome: Outcome) -> str:
        return (
            f"job {self.ctx.job_id} restart {self.ctx.restart}: {outcome.cause} "
            f"(exit {outcome.exit_code})"
        )

    def _write_summary(self, outcome: Outcome) -> None:
        """One line per node; waits up to 5 s for the final report of nodes still beating."""
        deadline = time.monotonic() + 5.0
        while True:
            nodes = rdv.read_nodes(self.paths)
            silent = set(rdv.stale_nodes(nodes, 4.0))
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
        rdv.atomic_write_text(self.paths.root / "summary.txt", "\n".join(lines) + "\n", 0o600)


def _free(port: int) -> bool:
    from hpcrl.agent.ports import port_is_free

    return port_is_free(port)
