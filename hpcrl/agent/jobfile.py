"""What the agent reads from `RUN_DIR/job.json`, the job description written at submission.

`job.json` holds `version`, `site`, `profile` (the fully resolved site profile as plain data,
validated when it was written), `payload`, `nodes`, `max_requeues`, `secrets` (variable names)
and `created`. This reader takes the parts the agent needs; the profile's own sections are
validated by the profile loader, not here. An optional `agent` mapping tunes time limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.agent.ports import PortRange, site_port_range
from hpcrl.allocation import AllocationError, RayOverrides
from hpcrl.jobspec import PAYLOAD_STARTS
from hpcrl.netaddr import NetworkPolicy
from hpcrl.rundir import RunFileError, read_job

AGENT_KEYS = ("join_timeout_s", "grace_s", "heartbeat_timeout_s")
AGENT_TEXT_KEYS = ("stop_signal",)


class JobFileError(ValueError):
    """`job.json` is missing or does not describe a job the agent can run."""


@dataclass(frozen=True)
class AgentJob:
    """The agent's view of a job."""

    payload: tuple[str, ...]
    """Command run on the head (argv, inside the container), when `payload_start` says."""
    nodes: int
    """Number of nodes the job asked for."""
    network: NetworkPolicy
    """How each node picks its cluster address."""
    ports: PortRange
    """Where this job's Ray port block may lie."""
    dashboard: bool = False
    """Start the Ray dashboard (on `dashboard_host`)."""
    dashboard_host: str = "127.0.0.1"
    """Where the dashboard listens when on; loopback unless the profile opts in."""
    container: Mapping[str, Any] = field(default_factory=lambda: {"runtime": "none"})
    """Profile section `container`: `runtime` (a name in `hpcrl.runtimes.TABLE`), `image`, ..."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for Ray and the payload (profile section `env`)."""
    version_env: tuple[Mapping[str, Any], ...] = ()
    """Profile `ray.version_env`: variables chosen by the Ray version found on the node."""
    secrets: tuple[str, ...] = ()
    """Names of variables passed through from the job's environment (values never stored)."""
    profile: Mapping[str, Any] = field(default_factory=dict)
    """The whole resolved profile, for the container command builder."""
    join_timeout_s: float = 300.0
    """How long the nodes may take to publish, arrive and join Ray."""
    grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when the job ends for a failure."""
    heartbeat_timeout_s: float = 15.0
    """A node whose agent is silent this long counts as dead."""
    max_requeues: int = 3
    """How often the job may requeue itself (`job.json` `max_requeues`, from `slurm.max_requeues`)."""
    warning_signal: str = "USR1"
    """Slurm's time-limit warning (profile `slurm.signal`, without `SIG`)."""
    signal_lead_s: float = 300.0
    """Seconds before the time limit the warning is due (profile `slurm.signal_lead_s`)."""
    stop_signal: str = "USR2"
    """What the head's agent sends the payload to ask for a checkpoint and a stop."""
    min_nodes: int | None = None
    """Fewest nodes a requeue after a node loss may ask for (profile `slurm.min_nodes`)."""
    exclude_slow: bool = False
    """Requeue the job without a node the trainer named slow, when it can go on without it
    (profile `slurm.exclude_slow`, `hpcrl submit --exclude-slow`)."""
    payload_start: str = "all-joined"
    """`all-joined`: start the payload once every node's Ray is in the cluster; `head-alive`:
    once the head's is (the payload, like the trainer, waits for the nodes it needs itself)."""
    ray_overrides: RayOverrides = RayOverrides()
    """Profile `ray.num_cpus`, `num_gpus`, `memory`, `object_store_memory`: replace what the
    agent derives from the job's allocation on the node (None: derive it)."""

    @property
    def runtime(self) -> str:
        return str(self.container.get("runtime") or "none")

    @property
    def python(self) -> str | None:
        """Python inside the container (`container.python`); None: the agent's own path."""
        value = self.container.get("python")
        return str(value) if value else None


def _section(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise JobFileError(f"`{where}.{key}` is {type(value).__name__}, expected a mapping")
    return dict(value)


def _check_keys(section: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise JobFileError(
            f"unknown key(s) {', '.join(f'`{k}`' for k in unknown)} in `{where}`; valid keys: "
            f"{', '.join(valid)}"
        )


def parse_job(data: Mapping[str, Any]) -> AgentJob:
    """Build the agent's view from the decoded `job.json`."""
    payload = data.get("payload")
    if not isinstance(payload, list) or not payload or not all(isinstance(a, str) for a in payload):
        raise JobFileError(
            f"`payload` is {payload!r}; expected a non-empty list of strings (the command argv)"
        )
    profile = _section(data, "profile", "job")
    network = _section(profile, "network", "profile")
    ray = _section(profile, "ray", "profile")
    agent = _section(profile, "agent", "profile")
    _check_keys(agent, AGENT_KEYS + AGENT_TEXT_KEYS, "profile.agent")
    slurm = _section(profile, "slurm", "profile")
    base = ray.get("port_base")
    ports = site_port_range(int(base) if base else None)
    env = _section(profile, "env", "profile")
    nodes = data.get("nodes", 1)
    if not isinstance(nodes, int) or nodes < 1:
        raise JobFileError(f"`nodes` is {nodes!r}; expected a whole number of at least 1")
    max_requeues = data.get("max_requeues", slurm.get("max_requeues", 3))
    if not isinstance(max_requeues, int) or isinstance(max_requeues, bool) or max_requeues < 0:
        raise JobFileError(
            f"`max_requeues` is {max_requeues!r}; expected a whole number of at least 0"
        )
    start = data.get("payload_start", "all-joined")
    if start not in PAYLOAD_STARTS:
        raise JobFileError(f"`payload_start` is {start!r}; expected one of {', '.join(PAYLOAD_STARTS)}")
    try:
        overrides = RayOverrides.from_profile(ray, "profile.ray")
    except AllocationError as exc:
        raise JobFileError(str(exc)) from None
    return AgentJob(
        payload=tuple(payload),
        nodes=nodes,
        network=NetworkPolicy(
            interface=network.get("interface") or None, family=network.get("family", "auto")
        ),
        ports=ports,
        dashboard=bool(ray.get("dashboard", False)),
        dashboard_host=str(ray.get("dashboard_host") or "127.0.0.1"),
        container=_section(profile, "container", "profile") or {"runtime": "none"},
        env={str(k): str(v) for k, v in env.items()},
        version_env=tuple(ray.get("version_env") or ()),
        secrets=tuple(str(x) for x in data.get("secrets") or ()),
        profile=profile,
        max_requeues=max_requeues,
        warning_signal=signal_name(slurm.get("signal") or "USR1", "profile.slurm.signal"),
        signal_lead_s=float(slurm.get("signal_lead_s", 300)),
        stop_signal=signal_name(agent.get("stop_signal") or "USR2", "profile.agent.stop_signal"),
        ray_overrides=overrides,
        payload_start=start,
        min_nodes=slurm.get("min_nodes") if isinstance(slurm.get("min_nodes"), int) else None,
        exclude_slow=slurm.get("exclude_slow") is True,
        **{k: float(agent[k]) for k in AGENT_KEYS if k in agent},
    )


def signal_name(value: Any, where: str) -> str:
    """`SIGUSR1`, `usr1` -> `USR1`; a name Python's `signal` module does not know is an error."""
    import signal

    name = str(value).upper().removeprefix("SIG")
    if not hasattr(signal, f"SIG{name}"):
        raise JobFileError(f"`{where}` is {value!r}, not a signal name; use e.g. `USR1` or `TERM`")
    return name


def load_job(run_dir: Path) -> AgentJob:
    """The agent's view of `RUN_DIR/job.json` (read by :func:`hpcrl.rundir.read_job`)."""
    try:
        return parse_job(read_job(run_dir))
    except RunFileError as exc:
        raise JobFileError(str(exc)) from None
