"""Which address a node offers to the Ray cluster, and how each consumer wants it written.

Parsers turn the output of `ip -j addr` and `hostname --ip-address` into `NodeAddress` records;
`choose_address` applies the site's network policy; the `format_*` helpers write the result for
Ray (`[v6]:port`), for `--node-ip-address`/`MASTER_ADDR` (bare) and for socket-interface
variables. Only `local_addresses` runs a command.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

FAMILIES = ("auto", "ipv4", "ipv6")
"""Valid values of the network policy's `family`."""

BRIDGE_PREFIXES = ("docker", "podman", "cni", "virbr", "veth", "br-", "lxcbr", "flannel", "cali")
"""Interfaces whose names start with these belong to container or VM bridges, never chosen."""


class AddressError(ValueError):
    """No address of this node fits the network policy, or tool output cannot be read."""


@dataclass(frozen=True)
class NodeAddress:
    """One IP address configured on this node."""

    address: str
    """The address without brackets or zone, e.g. `10.77.0.11` or `fd77::11`."""
    interface: str | None
    """Interface carrying it (`eth0`), None when the source does not say (`hostname`)."""
    scope: str = "global"
    """Scope reported by `ip` (`global`, `link`, `host`); derived from the address otherwise."""
    flags: tuple[str, ...] = ()
    """Address flags from `ip` such as `tentative`, `deprecated`, `dadfailed`."""

    @property
    def family(self) -> str:
        return "ipv6" if ":" in self.address else "ipv4"

    def describe(self) -> str:
        return f"{self.address} on {self.interface}" if self.interface else self.address


@dataclass(frozen=True)
class NetworkPolicy:
    """How a site wants the node address picked (profile section `network`)."""

    interface: str | None = None
    """Use only addresses on this interface (e.g. `ib0`); None: any suitable interface."""
    family: str = "auto"
    """`ipv4`, `ipv6`, or `auto` (IPv4 when the node has one, else IPv6)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise AddressError(
                f"network `family` is `{self.family}`; valid values: {', '.join(FAMILIES)}"
            )


def _plain(text: str) -> str:
    """`fe80::1%eth0` -> `fe80::1`; validates the address."""
    bare = text.strip().strip("[]").split("%", 1)[0]
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        raise AddressError(f"`{text}` is not an IP address") from None


def parse_hostname_ip(output: str) -> list[NodeAddress]:
    """Parse `hostname --ip-address` or `hostname -I`: addresses separated by blanks."""
    return [NodeAddress(_plain(tok), None, _scope_of(_plain(tok))) for tok in output.split()]


def parse_ip_json(output: str) -> list[NodeAddress]:
    """Parse `ip -j addr` (iproute2 JSON) into one record per configured address."""
    try:
        links = json.loads(output)
    except json.JSONDecodeError as exc:
        raise AddressError(f"`ip -j addr` printed something that is not JSON ({exc})") from None
    if not isinstance(links, list):
        raise AddressError("`ip -j addr` printed JSON that is not a list of interfaces")
    found: list[NodeAddress] = []
    for link in links:
        name = link.get("ifname")
        if "UP" not in link.get("flags", ["UP"]):
            continue
        for info in link.get("addr_info", []):
            if info.get("family") not in ("inet", "inet6") or "local" not in info:
                continue
            flags = tuple(k for k in ("tentative", "deprecated", "dadfailed") if info.get(k))
            found.append(
                NodeAddress(_plain(info["local"]), name, info.get("scope", "global"), flags)
            )
    return found


def _scope_of(address: str) -> str:
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return "host"
    if ip.is_link_local:
        return "link"
    return "global"


def _rejection(addr: NodeAddress) -> str | None:
    """Why `addr` can never serve as a cluster address, or None if it can."""
    ip = ipaddress.ip_address(addr.address)
    if ip.is_loopback or addr.scope == "host" or addr.interface == "lo":
        return "loopback"
    if ip.is_link_local or addr.scope == "link":
        return "link-local"
    if ip.is_unspecified or ip.is_multicast:
        return "not unicast"
    if addr.interface and addr.interface.startswith(BRIDGE_PREFIXES):
        return "container bridge"
    if addr.flags:
        return ",".join(addr.flags)
    return None


def choose_address(
    found: Sequence[NodeAddress], policy: NetworkPolicy, host_addresses: Sequence[str] = ()
) -> NodeAddress:
    """Pick the node's cluster address under `policy`.

    Never loopback, link-local, a container bridge, or a tentative/deprecated address. Without a
    named interface, addresses the host name resolves to (`host_addresses`) come first, then the
    others in `found` order. The error lists every address found and why it was passed over.
    """
    usable = [a for a in found if _rejection(a) is None]
    if policy.interface is not None:
        usable = [a for a in usable if a.interface == policy.interface]
    else:
        named = {_plain(h) for h in host_addresses}
        usable = [a for a in usable if a.address in named] + [
            a for a in usable if a.address not in named
        ]
    if policy.family == "auto":
        v4 = [a for a in usable if a.family == "ipv4"]
        usable = v4 or usable
    else:
        usable = [a for a in usable if a.family == policy.family]
    if usable:
        return usable[0]
    raise AddressError(_no_fit_message(found, policy))


def host_name_addresses(name: str | None = None) -> list[str]:
    """Addresses this machine's host name resolves to (`/etc/hosts`, DNS), possibly none."""
    import socket

    try:
        infos = socket.getaddrinfo(name or socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [_plain(str(info[4][0])) for info in infos]


def _no_fit_message(found: Sequence[NodeAddress], policy: NetworkPolicy) -> str:
    seen = []
    for a in found:
        why = _rejection(a)
        if why is None and policy.interface is not None and a.interface != policy.interface:
            why = f"not on `{policy.interface}`"
        if why is None and policy.family != "auto" and a.family != policy.family:
            why = f"not {policy.family}"
        seen.append(f"{a.describe()} ({why})")
    wanted = f"interface `{policy.interface}`, " if policy.interface else ""
    return (
        f"no address of this node fits the network policy ({wanted}family `{policy.family}`); "
        f"found: {'; '.join(seen) or 'no addresses at all'}. Fix `network.interface` / "
        "`network.family` in the site profile to name an interface and family the nodes have"
    )


def interface_of(address: str, found: Iterable[NodeAddress]) -> str | None:
    """The interface that carries `address`, if the records say."""
    want = _plain(address)
    for a in found:
        if a.address == want and a.interface:
            return a.interface
    return None


def format_host(address: str) -> str:
    """Bare form for `--node-ip-address` and `MASTER_ADDR` (never bracketed)."""
    return _plain(address)


def format_hostport(address: str, port: int) -> str:
    """`host:port` for Ray addresses: `10.0.0.1:6379`, `[fd77::11]:6379`."""
    bare = _plain(address)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def socket_ifname_env(interface: str | None) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME` for torch.distributed, empty if unknown."""
    if not interface:
        return {}
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def _run(argv: Sequence[str]) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=10).stdout


def local_addresses(run: Callable[[Sequence[str]], str] = _run) -> list[NodeAddress]:
    """This node's addresses: `ip -j addr` (with interfaces), else `hostname --ip-address`."""
    if shutil.which("ip"):
        try:
            return parse_ip_json(run(["ip", "-j", "addr"]))
        except (subprocess.SubprocessError, OSError):
            pass
    try:
        return parse_hostname_ip(run(["hostname", "--ip-address"]))
    except (subprocess.SubprocessError, OSError) as exc:
        raise AddressError(
            f"cannot list this node's addresses: neither `ip -j addr` nor `hostname "
            f"--ip-address` worked ({exc}); install iproute2 on the compute nodes"
        ) from None
