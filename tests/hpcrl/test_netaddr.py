from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcrl.netaddr import (
    AddressError,
    NetworkPolicy,
    NodeAddress,
    choose_address,
    format_host,
    format_hostport,
    host_name_addresses,
    interface_of,
    local_addresses,
    parse_hostname_ip,
    parse_ip_json,
    socket_ifname_env,
)

DATA = Path(__file__).parents[1] / "data"


def lab_node() -> list[NodeAddress]:
    # `ip -j addr` inside a lab node namespace: lo, eth0 (10.77.0.11, fd77::11), docker0, podman0
    return parse_ip_json((DATA / "ip_addr_labnode.json").read_text())


def lab_node_v6_only() -> list[NodeAddress]:
    links = json.loads((DATA / "ip_addr_labnode.json").read_text())
    for link in links:
        link["addr_info"] = [a for a in link["addr_info"] if a["family"] == "inet6"]
    return parse_ip_json(json.dumps(links))


def test_parse_hostname_outputs_keep_order() -> None:
    v6_first = parse_hostname_ip((DATA / "hostname_ip_labnode.txt").read_text())
    assert [a.address for a in v6_first] == ["fd77::11", "10.77.0.11"]
    assert all(a.interface is None for a in v6_first)
    dash_i = parse_hostname_ip((DATA / "hostname_I_labnode.txt").read_text())
    assert [a.address for a in dash_i] == ["10.77.0.11", "fd77::11"]
    assert parse_hostname_ip("127.0.0.1\n")[0].scope == "host"


def test_hostname_ip_order_does_not_fool_the_policy() -> None:
    # The seeds take the first word unless it is longer than 16 characters: `fd77::11` is not,
    # so they hand an IPv6 address to a v4 `host:port`. The policy picks by family instead.
    found = parse_hostname_ip("fd77::11 10.77.0.11")
    assert choose_address(found, NetworkPolicy()).address == "10.77.0.11"
    assert choose_address(found, NetworkPolicy(family="ipv6")).address == "fd77::11"


def test_lab_node_choices() -> None:
    found = lab_node()
    assert choose_address(found, NetworkPolicy()) == NodeAddress("10.77.0.11", "eth0")
    assert choose_address(found, NetworkPolicy(family="ipv6")).address == "fd77::11"
    assert choose_address(found, NetworkPolicy(interface="eth0", family="ipv4")).interface == "eth0"
    assert choose_address(lab_node_v6_only(), NetworkPolicy()).address == "fd77::11"
    assert interface_of("fd77::11", found) == "eth0"


def test_host_name_addresses_come_first_without_a_named_interface() -> None:
    # a node with a management network first and InfiniBand second; the host name resolves
    # to the InfiniBand address (as /etc/hosts says on many clusters)
    found = [NodeAddress("192.168.1.5", "eno1"), NodeAddress("10.10.0.5", "ib0")]
    assert choose_address(found, NetworkPolicy()).address == "192.168.1.5"
    assert choose_address(found, NetworkPolicy(), ["10.10.0.5"]).address == "10.10.0.5"
    # a loopback host-name entry (as on this machine) is passed over
    assert choose_address(found, NetworkPolicy(), ["127.0.1.1"]).address == "192.168.1.5"
    # a named interface wins over the host name
    assert choose_address(found, NetworkPolicy("eno1"), ["10.10.0.5"]).interface == "eno1"
    # the lab: `fd77::11 10.77.0.11` for the host name, auto family -> IPv4
    lab = lab_node()
    assert choose_address(lab, NetworkPolicy(), ["fd77::11", "10.77.0.11"]).address == "10.77.0.11"
    assert host_name_addresses("localhost")


def test_bridges_are_never_chosen() -> None:
    found = [a for a in lab_node() if a.interface != "eth0"]
    with pytest.raises(AddressError) as err:
        choose_address(found, NetworkPolicy())
    msg = str(err.value)
    assert "172.17.0.1 on docker0 (container bridge)" in msg
    assert "10.88.0.1 on podman0 (container bridge)" in msg
    assert "127.0.0.1 on lo (loopback)" in msg
    assert "link-local" in msg and "network.family" in msg


def test_named_interface_missing_lists_what_was_found() -> None:
    with pytest.raises(
        AddressError, match=r"interface `ib0`.*10\.77\.0\.11 on eth0 \(not on `ib0`\)"
    ):
        choose_address(lab_node(), NetworkPolicy(interface="ib0"))


def test_host_fixture_skips_down_and_link_local() -> None:
    found = parse_ip_json((DATA / "ip_addr_host.json").read_text())
    assert all(a.interface not in ("ifb0", "ifb1") for a in found)
    chosen = choose_address(found, NetworkPolicy())
    assert chosen == NodeAddress("192.0.2.2", "eth0")


def test_bad_family_and_bad_json() -> None:
    with pytest.raises(AddressError, match="valid values: auto, ipv4, ipv6"):
        NetworkPolicy(family="v6")
    with pytest.raises(AddressError, match="not JSON"):
        parse_ip_json("eth0: 10.0.0.1")


def test_formats() -> None:
    assert format_hostport("fd77::11", 6379) == "[fd77::11]:6379"
    assert format_hostport("[fd77::11]", 6379) == "[fd77::11]:6379"
    assert format_hostport("10.77.0.11", 6379) == "10.77.0.11:6379"
    assert format_host("[fd77::11]") == "fd77::11"
    assert socket_ifname_env("eth0") == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert socket_ifname_env(None) == {}


@given(st.ip_addresses(), st.integers(1, 65535))
def test_hostport_round_trips(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> None:
    text = format_hostport(str(ip), port)
    host, _, port_text = text.rpartition(":")
    assert int(port_text) == port
    assert ipaddress.ip_address(host.strip("[]")) == ip
    assert host.startswith("[") == (ip.version == 6)
    assert "[" not in format_host(str(ip))


@given(
    st.lists(st.tuples(st.ip_addresses(), st.sampled_from(["eth0", "ib0", "docker0", "lo", None])))
)
def test_choice_is_never_excluded_kind(pairs: list) -> None:
    found = [NodeAddress(str(ip), name, "global") for ip, name in pairs]
    for policy in (NetworkPolicy(), NetworkPolicy(family="ipv6"), NetworkPolicy(interface="ib0")):
        try:
            chosen = choose_address(found, policy)
        except AddressError as exc:
            assert "found:" in str(exc)
            continue
        ip = ipaddress.ip_address(chosen.address)
        assert not (ip.is_loopback or ip.is_link_local or ip.is_multicast)
        assert chosen.interface not in ("docker0", "lo")
        if policy.interface:
            assert chosen.interface == policy.interface
        if policy.family == "ipv6":
            assert ip.version == 6


def test_local_addresses_falls_back_to_hostname() -> None:
    calls: list[list[str]] = []

    def run(argv):  # the one seam: the command runner
        calls.append(list(argv))
        if argv[0] == "ip":
            raise OSError("no ip")
        return "fd77::11 10.77.0.11\n"

    assert [a.address for a in local_addresses(run)] == ["fd77::11", "10.77.0.11"]
    assert calls[-1] == ["hostname", "--ip-address"]


def test_local_addresses_on_this_machine() -> None:
    found = local_addresses()
    assert any(a.interface == "lo" for a in found)
