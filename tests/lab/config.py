"""The lab's shape as data: names, addresses and paths of one lab instance."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Several labs can run side by side on one machine: instance N (env HPCRL_LAB_INSTANCE, default 0)
# gets its own subnet (10.77.N.0/24, fd77:N::/64), bridge, namespace names and state directory.
INSTANCE = int(os.environ.get("HPCRL_LAB_INSTANCE", "0"))
if not 0 <= INSTANCE <= 99:
    raise ValueError(f"HPCRL_LAB_INSTANCE must be 0..99, got {INSTANCE}")
_SUFFIX = "" if INSTANCE == 0 else str(INSTANCE)
STATE_DIR = Path(os.environ.get("HPCRL_LAB_DIR", f"/run/hpcrl-lab{_SUFFIX}"))

# What the lab builds once per machine and reuses: the root filesystem, the SIF and the downloaded
# packages (HPCRL_LAB_CACHE), and Apptainer with its private glibc (HPCRL_LAB_APPTAINER). Point both
# at empty directories to rebuild everything, as a fresh machine does (README: "Testing").
DEFAULT_CACHE_DIR = Path("/var/cache/hpcrl-lab")
DEFAULT_APPTAINER_PREFIX = Path("/opt/hpcrl-lab/apptainer")
DEFAULT_IMAGE = "localhost/hpcrl-lab:latest"
CACHE_DIR = Path(os.environ.get("HPCRL_LAB_CACHE") or DEFAULT_CACHE_DIR)
APPTAINER_PREFIX = Path(os.environ.get("HPCRL_LAB_APPTAINER") or DEFAULT_APPTAINER_PREFIX)

BRIDGE = f"hrlbr{INSTANCE}"
NETNS_PREFIX = f"hrl{_SUFFIX}-"
VETH_PREFIX = f"hrlv{_SUFFIX}-"
V4_NET = f"10.77.{INSTANCE}"
V6_NET = "fd77:" if INSTANCE == 0 else f"fd77:{INSTANCE}:"
V4_GATEWAY = f"{V4_NET}.1"
V6_GATEWAY = f"{V6_NET}:1"
CONTROLLER = "slurmctl"
SIF = CACHE_DIR / "hpcrl-lab.sif"


def _image_name() -> str:
    """The Podman image lives in Podman's own store, outside CACHE_DIR: a cache of its own gets an
    image tag of its own, so that an empty cache means building (importing) the image again."""
    if os.environ.get("HPCRL_LAB_IMAGE"):
        return os.environ["HPCRL_LAB_IMAGE"]
    if CACHE_DIR.resolve() == DEFAULT_CACHE_DIR:
        return DEFAULT_IMAGE
    digest = hashlib.sha256(str(CACHE_DIR.resolve()).encode()).hexdigest()[:12]
    return f"localhost/hpcrl-lab:cache-{digest}"


IMAGE = _image_name()


def cache_env() -> dict[str, str]:
    """The variables naming this lab's caches and image. The `slurmlab` site profiles read them
    (`${env:HPCRL_LAB_IMAGE:-...}`), so a job submitted by a test uses the images this lab built."""
    return {"HPCRL_LAB_CACHE": str(CACHE_DIR), "HPCRL_LAB_APPTAINER": str(APPTAINER_PREFIX),
            "HPCRL_LAB_IMAGE": IMAGE}


@dataclass(frozen=True)
class Host:
    """One lab host: the controller or a compute node, each in its own network namespace."""

    name: str
    ipv4: str | None
    ipv6: str

    @property
    def netns(self) -> str:
        return NETNS_PREFIX + self.name

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def veth(self) -> str:
        return VETH_PREFIX + self.name

    @property
    def slurm_addr(self) -> str:
        return self.ipv4 if self.ipv4 else self.ipv6


@dataclass(frozen=True)
class LabConfig:
    """Options of one lab instance (`python -m tests.lab up --help` lists them)."""

    nodes: int = 3
    ipv6_only: bool = False
    grace_time: int = 0
    preempt_send_user_signal: bool = False
    cpus_per_node: int = 2
    memory_mb: int = 4000
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 80:
            raise ValueError(f"`nodes` must be between 1 and 80, got {self.nodes}")
        if self.grace_time < 0:
            raise ValueError(f"`grace_time` must be >= 0 seconds, got {self.grace_time}")

    @property
    def controller(self) -> Host:
        return Host(CONTROLLER, None if self.ipv6_only else f"{V4_NET}.2", f"{V6_NET}:2")

    @property
    def compute(self) -> list[Host]:
        return [
            Host(f"node{i}", None if self.ipv6_only else f"{V4_NET}.{10 + i}", f"{V6_NET}:{10 + i}")
            for i in range(1, self.nodes + 1)
        ]

    @property
    def hosts(self) -> list[Host]:
        return [self.controller, *self.compute]

    @property
    def nodelist(self) -> str:
        return f"node[1-{self.nodes}]" if self.nodes > 1 else "node1"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LabConfig:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Paths:
    """Files of a running lab, all under `STATE_DIR`."""

    root: Path = STATE_DIR

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def slurm_conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    @property
    def resolv_conf(self) -> Path:
        return self.root / "resolv.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge-sock" / "munge.socket"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    def env(self) -> dict[str, str]:
        """Environment a Slurm client in the root namespace needs to talk to the lab."""
        return {"SLURM_CONF": str(self.slurm_conf)}
