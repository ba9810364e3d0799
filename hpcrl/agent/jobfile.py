"""What the agent reads from `RUN_DIR/job.json`, the job description written at submission.

A small reader of the parts the agent needs (network policy, Ray settings, container, extra
environment, payload). Sections the agent does not use are left to the submission side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.agent.ports import PortRange
from hpcrl.netaddr import NetworkPolicy

RAY_KEYS = ("dashboard", "dashboard_host", "port_base", "port_limit", "port_block_size")
AGENT_KEYS = ("join_timeout_s", "grace_s", "heartbeat_timeout_s")


class JobFileError(ValueError):
    """`job.json` is missing or does not describe a job the agent can run."""


@dataclass(frozen=True)
class AgentJob:
    """The agent's view of a job."""

    payload: tuple[str, ...]
    """Command run on the head once every node joined (argv, inside the container)."""
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
    """Profile section `container`: `runtime` (none, podman, apptainer), `image`, ..."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for Ray and the payload (profile section `env`)."""
    workdir: str | None = None
    """Working directory of the payload; the agent's own when None."""
    join_timeout_s: float = 300.0
    """How long the nodes may take to publish, arrive and join Ray."""
    grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when the job ends for a failure."""
    heartbeat_timeout_s: float = 15.0
    """A node whose agent is silent this long counts as dead."""

    @property
    def runtime(self) -> str:
        return str(self.container.get("runtime", "none"))


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
    agent = _section(data, "agent", "job")
    _check_keys(ray, RAY_KEYS, "profile.ray")
    _check_keys(agent, AGENT_KEYS, "job.agent")
    defaults = PortRange()
    ports = PortRange(
        base=int(ray.get("port_base", defaults.base)),
        limit=int(ray.get("port_limit", defaults.limit)),
        block_size=int(ray.get("port_block_size", defaults.block_size)),
    )
    env = _section(profile, "env", "profile")
    nodes = data.get("nodes", 1)
    if not isinstance(nodes, int) or nodes < 1:
        raise JobFileError(f"`nodes` is {nodes!r}; expected a whole number of at least 1")
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
        workdir=data.get("workdir"),
        **{k: float(agent[k]) for k in AGENT_KEYS if k in agent},
    )


def load_job(run_dir: Path) -> AgentJob:
    path = run_dir / "job.json"
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobFileError(
            f"cannot read `{path}` ({exc.strerror}); the run directory must be created by "
            "`hpcrl submit` and be visible on every node"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobFileError(f"`{path}` is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise JobFileError(f"`{path}` holds {type(data).__name__}, expected a JSON object")
    return parse_job(data)
