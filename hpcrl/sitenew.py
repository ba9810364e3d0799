"""`hpcrl sites new`: a site profile written from what the login node shows.

:func:`gather` reads the machine through one :class:`hpcrl.sitedetect.Probe`; :func:`plan` turns
those facts, the profile extended and the user's flags into values, each with the source it came
from, and NCCL/RCCL settings *proposed* for the NICs found (never set); :func:`render` writes the
YAML with a comment per value. Only what cannot be detected is asked (`ask`), and only on a
terminal: otherwise flags or defaults, each with a note.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcrl import netaddr
from hpcrl.profiles import SiteProfile
from hpcrl.runtimes import podman
from hpcrl.sitedetect import (
    HcaPort,
    NetIf,
    Node,
    Partition,
    Probe,
    hca_ports,
    net_interfaces,
    parse_nodes,
    parse_partitions,
)

RUNTIME_ORDER = ("apptainer", "podman", "enroot")
"""Runtimes looked for on PATH (after the extended profile's own), in this order."""
Ask = Callable[[str, str, Sequence[str]], str]
"""ask(question, default, choices) -> answer."""


@dataclass(frozen=True)
class Facts:
    """What the login node shows."""

    partitions: tuple[Partition, ...] = ()
    nodes: tuple[Node, ...] = ()
    ports: tuple[HcaPort, ...] = ()
    interfaces: tuple[NetIf, ...] = ()
    addresses: tuple[netaddr.NodeAddress, ...] = ()
    runtimes: Mapping[str, str] = field(default_factory=dict)
    """name -> path on PATH."""
    rootless: bool = False
    oci_runtime: str | None = None
    """`podman info`'s OCI runtime (`crun`, `runc`)."""
    accounts: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Flags:
    partition: str | None = None
    account: str | None = None
    runtime: str | None = None
    image: str | None = None
    interactive: bool = True
    """Whether a question can be asked (a terminal); if not, its default is taken."""

    def chosen(self, what: str) -> str:
        """How a value chosen by a question came to be: asked, or its default taken."""
        return "asked" if self.interactive else f"the default: no terminal to ask on ({what} chooses)"


@dataclass
class Plan:
    """Values by dotted key with their source, proposals (NAME -> (value, reason)), notes."""

    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    proposals: dict[str, tuple[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, source: str) -> None:
        self.values[key] = (value, source)


def gather(probe: Probe) -> Facts:
    """Read Slurm, sysfs, the addresses and PATH through `probe`."""
    parts = parse_partitions(probe.run(["scontrol", "show", "partition", "--oneliner"]) or "")
    nodes = parse_nodes(probe.run(["scontrol", "show", "node", "--oneliner"]) or "")
    runtimes = {n: p for n in ("podman", *RUNTIME_ORDER) if (p := probe.which(n))}
    oci = None
    if "podman" in runtimes:
        oci = (probe.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"]) or "").strip() or None
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    assoc = probe.run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"]) if user else None
    accounts = tuple(sorted({a.strip() for a in (assoc or "").splitlines() if a.strip()}))

    def run_or_raise(argv: Sequence[str]) -> str:
        out = probe.run(argv)
        if out is None:
            raise OSError(f"`{' '.join(argv)}` gave nothing")
        return out

    try:
        addresses = tuple(netaddr.local_addresses(run_or_raise))
    except netaddr.AddressError:
        addresses = ()
    return Facts(tuple(parts), tuple(nodes), tuple(hca_ports(probe)), tuple(net_interfaces(probe)),
                 addresses, runtimes, podman.rootless(), oci, accounts, tuple(probe.log))


# ----------------------------------------------------------------------------- Slurm


def _partition(facts: Facts, flags: Flags, want_gpus: bool, ask: Ask, plan: Plan) -> Partition | None:
    names = [p.name for p in facts.partitions]
    if flags.partition:
        found = [p for p in facts.partitions if p.name == flags.partition]
        if names and not found:
            raise ValueError(f"`--partition {flags.partition}`: Slurm has no such partition here; "
                             f"partitions: {', '.join(names)}")
        return found[0] if found else None
    if not facts.partitions:
        plan.notes.append("no partitions (`scontrol show partition` gave none): `slurm.partition` "
                          "is left to the cluster's default; pass `--partition NAME` to set one")
        return None
    candidates = _candidates(facts, want_gpus)
    default = next((p for p in candidates if p.default), candidates[0])
    if len(candidates) == 1:
        return default
    answer = ask(f"partition ({', '.join(p.name for p in candidates)})", default.name,
                 [p.name for p in candidates])
    return next(p for p in candidates if p.name == answer)


def _candidates(facts: Facts, want_gpus: bool) -> list[Partition]:
    """The partitions to choose from: those with GPUs when GPUs are wanted and some have them."""
    with_gpus = [p for p in facts.partitions if any(n.gres for n in _nodes_of(facts, p))]
    return with_gpus if want_gpus and with_gpus else list(facts.partitions)


def _nodes_of(facts: Facts, p: Partition) -> list[Node]:
    return [n for n in facts.nodes if p.name in n.partitions]


def plan_slurm(facts: Facts, parent: SiteProfile | None, flags: Flags, ask: Ask, plan: Plan) -> str | None:
    """The Slurm values; returns the GPU vendor the gres names (`amd`, `nvidia`) or None."""
    want_gpus = bool(parent and parent.slurm.gpus_per_node)
    part = _partition(facts, flags, want_gpus, ask, plan)
    if part is None:
        return None
    several = not flags.partition and len(_candidates(facts, want_gpus)) > 1
    plan.set("slurm.partition", part.name, f"scontrol show partition: {part.record}"
             + (" (--partition)" if flags.partition else f" ({flags.chosen('`--partition`')})" if several else ""))
    nodes = _nodes_of(facts, part)
    if parent and parent.slurm.nodes > part.total_nodes > 0:
        plan.set("slurm.nodes", part.total_nodes, f"scontrol show partition: TotalNodes={part.total_nodes}")
    if part.max_time:
        plan.set("slurm.time", part.max_time, f"scontrol show partition: MaxTime={part.max_time}")
    elif parent:
        plan.notes.append(f"partition `{part.name}` has no MaxTime: `slurm.time` stays {parent.slurm.time!r}")
    if not nodes:
        plan.notes.append(f"no nodes of `{part.name}` listed by `scontrol show node`")
        return None
    where = f"the fewest of the {len(nodes)} node(s) of `{part.name}`"
    plan.set("slurm.cpus_per_task", min(n.cpus for n in nodes),
             f"scontrol show node: CPUTot={min(n.cpus for n in nodes)} ({where})")
    plan.set("slurm.mem", f"{min(n.memory_mb for n in nodes)}M",
             f"scontrol show node: RealMemory={min(n.memory_mb for n in nodes)} MB ({where.replace('fewest', 'least')})")
    found = [n.gres for n in nodes if n.gres is not None]
    if len(found) < len(nodes):
        plan.set("slurm.gpus_per_node", 0, f"scontrol show node: Gres={nodes[0].gres_text} "
                 f"on {len(nodes) - len(found)} node(s): no GPUs requested")
        return None
    low = min(found, key=lambda g: g.count)
    text = next(n.gres_text for n in nodes if n.gres == low)
    plan.set("slurm.gpus_per_node", low.count, f"scontrol show node: Gres={text}")
    if low.memory_gib:
        plan.set("slurm.gpu_memory_gib", low.memory_gib, f"gres type {low.type}: {low.memory_gib} GiB per GPU")
    else:
        plan.notes.append(f"GPU memory of gres type {low.type!r} is not known here: set "
                          "`slurm.gpu_memory_gib` (the memory plan checks against it)")
    return low.vendor


def plan_account(facts: Facts, flags: Flags, plan: Plan) -> None:
    if flags.account:
        plan.set("slurm.account", flags.account, "--account")
    elif len(facts.accounts) == 1:
        plan.set("slurm.account", facts.accounts[0], "sacctmgr show assoc: your one account")
    elif facts.accounts:
        plan.notes.append(f"several accounts ({', '.join(facts.accounts)}): pass `--account NAME` "
                          "or set `slurm.account`; none set")


# ----------------------------------------------------------------------------- container


def _vendor(gres_vendor: str | None, parent: SiteProfile | None) -> str | None:
    if gres_vendor or parent is None:
        return gres_vendor
    if parent.container.gpu in ("rocm", "rocm-host") or "/dev/kfd" in parent.container.devices:
        return "amd"
    return "nvidia" if parent.container.gpu == "nv" else None


def _runtime(facts: Facts, parent: SiteProfile | None, flags: Flags, plan: Plan) -> str:
    if flags.runtime:
        return flags.runtime
    own = parent.container.runtime if parent else None
    for name in ([own] if own and own != "none" else []) + list(RUNTIME_ORDER):
        if name in facts.runtimes:
            return name
    plan.notes.append("none of apptainer, podman, enroot is on PATH: `container.runtime: none` "
                      "(the job runs on the host's Python); load the runtime's module and rerun")
    return "none"


def _gpu_options(runtime: str, vendor: str | None, ib: bool) -> list[tuple[str, Any, str]]:
    if runtime == "apptainer":
        gpu = {"amd": "rocm", "nvidia": "nv"}.get(vendor or "", "none")
        return [("container.gpu", gpu, "the image's own ROCm, /dev/kfd and /dev/dri bound" if gpu == "rocm"
                 else "--nv: the host's driver libraries" if gpu == "nv" else "no GPUs found"),
                ("container.extra_flags", [], "apptainer takes no podman flags")]
    if runtime in ("podman", "docker") and vendor == "amd":
        devices = ["/dev/kfd", "/dev/dri"] + (["/dev/infiniband"] if ib else [])
        return [("container.devices", devices, "ROCm's devices" + (" and the HCAs" if ib else "")),
                ("container.group_add", ["video"], "the devices' group (rootless podman: keep-groups)")]
    if runtime in ("podman", "docker") and vendor == "nvidia":
        return [("container.devices", ["nvidia.com/gpu=all"], "CDI: the NVIDIA container toolkit's spec")]
    return []


def plan_container(facts: Facts, parent: SiteProfile | None, flags: Flags, vendor: str | None,
                   ask: Ask, plan: Plan) -> None:
    runtime = _runtime(facts, parent, flags, plan)
    same = parent is not None and parent.container.runtime == runtime
    where = facts.runtimes.get(runtime, "not on PATH")
    plan.set("container.runtime", runtime, ("--runtime; " if flags.runtime else "") + f"on PATH: {where}")
    if runtime == "podman":
        mode = "rootless" if facts.rootless else "rootful"
        plan.notes.append(f"podman runs {mode} here" + (
            ": `group_add` becomes `--group-add keep-groups` (the user's own host groups, e.g. "
            "render/video for /dev/kfd)" + ("" if facts.oci_runtime == "crun" else
                                            f"; it needs crun, podman info says {facts.oci_runtime!r}")
            if facts.rootless else ""))
    if runtime == "none":
        return
    set_for = _vendor(None, parent)
    if vendor and set_for and vendor != set_for:
        plan.notes.append(f"the GPUs here are {vendor}'s (Slurm's gres) but `{parent.name if parent else ''}` "
                          f"is set up for {set_for}'s: extend "
                          f"{'mi300-cluster' if vendor == 'amd' else 'h100-cluster'} instead")
    if not same:
        for key, value, why in _gpu_options(runtime, _vendor(vendor, parent), bool(facts.ports)):
            plan.set(key, value, why)
    if flags.image or not same:
        default = {"apptainer": "${env:HOME}/images/hpcrl.sif", "enroot": "${env:HOME}/images/hpcrl.sqsh"
                   }.get(runtime, "localhost/hpcrl:latest")
        image = flags.image or ask(f"container image for {runtime}", default, [])
        plan.set("container.image", image, "--image" if flags.image
                 else f"{flags.chosen('`--image`')} (build it: `hpcrl image build`)")


# ----------------------------------------------------------------------------- network


def plan_network(facts: Facts, plan: Plan) -> None:
    seen = ", ".join(f"{i.name} ({'IPoIB' if i.ipoib else 'type ' + str(i.type)}, "
                     f"{'up' if i.up else 'down'})" for i in facts.interfaces if i.name != "lo")
    ipoib = [i for i in facts.interfaces if i.ipoib and i.up]
    if not ipoib:
        plan.notes.append(f"no IP-over-InfiniBand interface here (/sys/class/net: {seen or 'none'}): "
                          "`network.interface` is left as extended (null: the host name's address)")
        return
    name = ipoib[0].name
    try:
        chosen = netaddr.choose_address(facts.addresses, netaddr.NetworkPolicy(name, "auto"))
    except netaddr.AddressError as exc:
        plan.notes.append(f"{name} is IPoIB but has no usable address here ({exc}); interface not set")
        return
    plan.set("network.interface", name, f"/sys/class/net/{name}: type 32 (IP over InfiniBand), up")
    plan.set("network.family", "auto", f"netaddr's head-address policy picks {chosen.address} "
             f"({chosen.family}) on {name} here")


def plan_nics(facts: Facts, parent: SiteProfile | None, plan: Plan) -> None:
    """NCCL/RCCL settings proposed for the HCAs found, never set."""
    active = [p for p in facts.ports if p.active]
    listing = "; ".join(p.describe() for p in facts.ports)
    if not active:
        plan.notes.append("no active RDMA port in /sys/class/infiniband"
                          + (f" ({listing})" if listing else "") +
                          ": NCCL/RCCL will use sockets between nodes; check with `hpcrl doctor`")
        return
    ib = [p for p in active if p.link_layer == "InfiniBand"]
    use = ib or active
    hcas = ",".join(sorted({p.hca for p in use}))
    plan.proposals["NCCL_IB_HCA"] = (f"={hcas}", f"active ports: {listing}; `=` matches these names "
                                     "exactly (a prefix `mlx5_1` would also take mlx5_10); the "
                                     "default (unset) uses every active HCA, management ports too")
    roce = [p for p in use if p.link_layer == "Ethernet"]
    gids = sorted({p.roce_v2_gid for p in roce if p.roce_v2_gid is not None})
    if roce and len(gids) == 1:
        plan.proposals["NCCL_IB_GID_INDEX"] = (str(gids[0]), f"RoCE: the RoCE v2 GID with an IPv4 "
                                               f"address is index {gids[0]} on {roce[0].hca}")
    elif roce:
        plan.notes.append(f"RoCE ports, RoCE v2 GID indexes {gids or 'none found'}: leave "
                          "`NCCL_IB_GID_INDEX` to RCCL/NCCL or set the one your fabric uses")
    old = (parent.env.get("NCCL_IB_HCA") if parent else None) or ""
    names = [n.lstrip("=^") for n in old.split(",") if n]
    if names and not any(p.hca.startswith(n) for n in names for p in use):
        plan.notes.append(f"the extended profile's NCCL_IB_HCA={old} names none of this node's "
                          f"HCAs ({hcas}): RCCL/NCCL would fall back to sockets")


def plan(facts: Facts, parent: SiteProfile | None, flags: Flags, ask: Ask) -> Plan:
    """Every value of the new profile with its source."""
    out = Plan(notes=list(facts.notes))
    vendor = plan_slurm(facts, parent, flags, ask, out)
    plan_account(facts, flags, out)
    plan_container(facts, parent, flags, vendor, ask, out)
    plan_network(facts, out)
    plan_nics(facts, parent, out)
    return out


# ----------------------------------------------------------------------------- writing


def _one_line(text: str) -> str:
    """A comment's text on one line: what a tool printed (an `scontrol` error over several lines)
    would otherwise break out of its comment and the YAML with it."""
    return " ".join(str(text).split())


def _yaml(value: Any) -> str:
    import json

    return json.dumps(value)  # JSON is YAML, quoted where it must be


def render(name: str, parent: str | None, p: Plan, host: str | None = None,
           now: float | None = None) -> str:
    """The profile's YAML: each value with its source, then the proposals, then the notes."""
    host = host or socket.gethostname()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    lines = [f"# Site profile `{name}`, written by `hpcrl sites new` on {host} at {stamp}.",
             "# Each value says where it came from; check them, then run `hpcrl doctor --site "
             f"{name}`."]
    if parent:
        lines.append(f"extends: {parent}")
    lines.append(f"description: {_yaml(f'{name}: detected on {host}' + (f', extends {parent}' if parent else ''))}")
    sections: dict[str, list[str]] = {}
    for key, (value, source) in p.values.items():
        section, _, leaf = key.partition(".")
        sections.setdefault(section, []).append(f"  {leaf}: {_yaml(value)}  # {_one_line(source)}")
    for section, rows in sections.items():
        lines += [f"{section}:", *rows]
    if p.proposals:
        lines += ["# Proposed for the NICs found here, NOT set: uncomment under `env:` after "
                  "checking (`hpcrl doctor` shows the transport NCCL/RCCL chose).", "# env:"]
        lines += [f"#   {k}: {_yaml(v)}  # {_one_line(why)}" for k, (v, why) in p.proposals.items()]
    if p.notes:
        lines += ["# Notes:"] + [f"# - {_one_line(n)}" for n in p.notes]
    return "\n".join(lines) + "\n"
