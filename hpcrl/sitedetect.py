"""What a login node can tell about its cluster, for `hpcrl sites new`.

Pure parsers turn tool output and sysfs text into records: `scontrol show partition|node
--oneliner` (one record per line, read by :func:`hpcrl.slurm.parse_scontrol_show_job`), Slurm's
`Gres=` strings, `/sys/class/infiniband/*/ports/*` and `/sys/class/net/*/type`. Every read of the
machine goes through one :class:`Probe` (commands, files, PATH), which tests replace.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.slurm import parse_scontrol_show_job

# GiB of one GPU by Slurm gres type (lower case), where the type says it alone.
GPU_MEMORY_GIB = {"mi300x": 192, "mi300a": 128, "mi325x": 256, "mi355x": 288, "mi250x": 64,
                  "mi250": 64, "h100": 80, "h200": 141, "gh200": 96, "b200": 180}
_AMD_RE = re.compile(r"^(mi\d|gfx|amd|instinct)", re.I)
_NVIDIA_RE = re.compile(r"^(h\d|a\d|b\d|gh\d|gb\d|l4|v100|t4|nvidia|tesla|rtx)", re.I)
ARPHRD_INFINIBAND = 32
"""`/sys/class/net/IF/type` of an IP-over-InfiniBand interface (`ARPHRD_INFINIBAND`)."""


@dataclass(frozen=True)
class Gres:
    """One `gpu` entry of a node's `Gres=` (`gpu:mi300x:8(S:0-1)`, `gpu:4`)."""

    count: int
    type: str | None

    @property
    def vendor(self) -> str | None:
        """`amd` or `nvidia` when the type name says so."""
        if self.type and _AMD_RE.match(self.type):
            return "amd"
        if self.type and _NVIDIA_RE.match(self.type):
            return "nvidia"
        return None

    @property
    def memory_gib(self) -> int | None:
        return GPU_MEMORY_GIB.get((self.type or "").lower())


def parse_gres(text: str) -> Gres | None:
    """The GPUs of a `Gres=` value (several entries joined by `,`), None without any."""
    count, kind = 0, None
    for entry in re.split(r",(?![^()]*\))", text or ""):
        parts = re.sub(r"\(.*\)$", "", entry.strip()).split(":")
        if parts[0] != "gpu" or len(parts) < 2 or not parts[-1].isdigit():
            continue
        count += int(parts[-1])
        kind = kind or (parts[1] if len(parts) == 3 else None)
    return Gres(count, kind) if count else None


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    max_time: str | None
    """`MaxTime` as Slurm writes it; None for `UNLIMITED`."""
    default_time: str | None
    total_nodes: int
    record: str
    """What `scontrol` printed, for the comments."""


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    memory_mb: int
    gres: Gres | None
    gres_text: str


def _records(text: str) -> list[dict[str, str]]:
    return [parse_scontrol_show_job(line) for line in text.splitlines() if line.strip()]


def _limit(value: str | None) -> str | None:
    return None if not value or value.upper() in ("UNLIMITED", "NONE", "INFINITE") else value


def parse_partitions(text: str) -> list[Partition]:
    """`scontrol show partition --oneliner` -> partitions, in Slurm's order."""
    return [Partition(r["PartitionName"], r.get("Default") == "YES", _limit(r.get("MaxTime")),
                      _limit(r.get("DefaultTime")), int(r.get("TotalNodes") or 0),
                      f"PartitionName={r['PartitionName']} Default={r.get('Default')} "
                      f"MaxTime={r.get('MaxTime')} TotalNodes={r.get('TotalNodes')}")
            for r in _records(text) if "PartitionName" in r]


def parse_nodes(text: str) -> list[Node]:
    """`scontrol show node --oneliner` -> nodes."""
    return [Node(r["NodeName"], tuple(p for p in r.get("Partitions", "").split(",") if p),
                 int(r.get("CPUTot") or 0), int(r.get("RealMemory") or 0),
                 parse_gres(r.get("Gres", "")), r.get("Gres", "(null)"))
            for r in _records(text) if "NodeName" in r]


@dataclass(frozen=True)
class HcaPort:
    """One port of an RDMA device (`/sys/class/infiniband/HCA/ports/N`)."""

    hca: str
    port: int
    state: str
    """`ACTIVE`, `DOWN`, ... (the word after `4: `)."""
    link_layer: str
    """`InfiniBand` or `Ethernet` (RoCE)."""
    rate: str
    roce_v2_gid: int | None = None
    """Index of the first RoCE v2 GID holding an IPv4-mapped address (`::ffff:a.b.c.d`)."""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def describe(self) -> str:
        return f"{self.hca} port {self.port} {self.state} {self.link_layer} {self.rate}".strip()


def parse_port_state(text: str) -> str:
    """`4: ACTIVE` -> `ACTIVE`."""
    return text.strip().partition(":")[2].strip() or text.strip()


def roce_v2_gid_index(gids: Sequence[tuple[int, str, str]]) -> int | None:
    """The first index whose GID is IPv4-mapped (`0000:...:ffff:0a01:0203`) and whose type is
    `RoCE v2`: the GID NCCL/RCCL needs on RoCE (`NCCL_IB_GID_INDEX`); (index, gid, type)."""
    for index, gid, kind in sorted(gids):
        if kind.strip().lower() == "roce v2" and gid.strip().lower().startswith(
                "0000:0000:0000:0000:0000:ffff:"):
            return index
    return None


@dataclass(frozen=True)
class NetIf:
    name: str
    type: int
    up: bool

    @property
    def ipoib(self) -> bool:
        return self.type == ARPHRD_INFINIBAND


@dataclass
class Probe:
    """The one seam to the machine: commands, files under `sys_root`, and PATH."""

    sys_root: Path = Path("/sys")
    timeout_s: float = 20.0
    log: list[str] = field(default_factory=list)

    def run(self, argv: Sequence[str]) -> str | None:
        """stdout of `argv`, None when it is missing or fails (noted in `log`)."""
        if shutil.which(argv[0]) is None:
            self.log.append(f"`{argv[0]}` is not on PATH")
            return None
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=self.timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            self.log.append(f"`{' '.join(argv)}` failed: {exc}")
            return None
        if proc.returncode != 0:
            self.log.append(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()[:200]}")
            return None
        return proc.stdout

    def read(self, rel: str) -> str | None:
        try:
            return (self.sys_root / rel).read_text()
        except OSError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(p.name for p in (self.sys_root / rel).iterdir())
        except OSError:
            return []

    def which(self, name: str) -> str | None:
        return shutil.which(name)


def hca_ports(probe: Probe) -> list[HcaPort]:
    """Every port of every RDMA device in `/sys/class/infiniband`."""
    out = []
    for hca in probe.listdir("class/infiniband"):
        for port in probe.listdir(f"class/infiniband/{hca}/ports"):
            base = f"class/infiniband/{hca}/ports/{port}"
            gids = []
            for i in probe.listdir(f"{base}/gid_attrs/types"):
                kind = probe.read(f"{base}/gid_attrs/types/{i}")
                gid = probe.read(f"{base}/gids/{i}")
                if i.isdigit() and kind and gid:
                    gids.append((int(i), gid, kind))
            out.append(HcaPort(hca, int(port) if port.isdigit() else 0,
                               parse_port_state(probe.read(f"{base}/state") or ""),
                               (probe.read(f"{base}/link_layer") or "").strip(),
                               (probe.read(f"{base}/rate") or "").strip(), roce_v2_gid_index(gids)))
    return out


def net_interfaces(probe: Probe) -> list[NetIf]:
    """`/sys/class/net/*`: type and whether the link is up."""
    out = []
    for name in probe.listdir("class/net"):
        kind = (probe.read(f"class/net/{name}/type") or "0").strip()
        state = (probe.read(f"class/net/{name}/operstate") or "").strip()
        out.append(NetIf(name, int(kind) if kind.isdigit() else 0, state == "up"))
    return out
