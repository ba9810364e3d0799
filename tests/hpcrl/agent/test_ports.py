from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcrl.agent.ports import (
    FIXED_SLOTS,
    PortBlock,
    PortClaims,
    PortError,
    PortRange,
    block_at,
    claim_holder_uid,
    find_free_block,
    first_index,
    job_number,
    port_is_free,
)

ranges = st.builds(
    lambda base, blocks, size: PortRange(base, base + blocks * size, size),
    st.integers(1024, 40000),
    st.integers(1, 60),
    st.integers(FIXED_SLOTS + 8, 400),
)


@given(ranges, st.integers(0, 10**9))
def test_block_lies_in_range_and_ports_are_distinct(rng: PortRange, index: int) -> None:
    block = block_at(rng, index)
    ports = block.all_ports()
    assert len(ports) == len(set(ports)) == len(ports)
    assert all(rng.base <= p < rng.limit for p in ports)
    assert block.max_worker_port > block.min_worker_port


@given(ranges, st.integers(0, 10**9), st.integers(0, 10**9))
def test_distinct_blocks_do_not_overlap(rng: PortRange, i: int, j: int) -> None:
    a, b = block_at(rng, i), block_at(rng, j)
    if i % rng.blocks != j % rng.blocks:
        assert not set(a.all_ports()) & set(b.all_ports())
    else:
        assert a == b


def test_neighbouring_jobs_and_restarts_get_different_blocks() -> None:
    rng = PortRange()
    assert first_index("1000", 0, rng) != first_index("1001", 0, rng)
    assert first_index("1000", 0, rng) != first_index("1000", 1, rng)
    assert job_number("1000_3") == 1000  # array task ids
    assert job_number("local-ab12") == job_number("local-ab12") != job_number("local-ab13")


def test_flags_and_env_cover_every_port() -> None:
    block = block_at(PortRange(), 0)
    head = " ".join(block.ray_start_args(head=True, dashboard=True))
    for port in [
        block.gcs,
        block.dashboard,
        block.ray_client_server,
        block.node_manager,
        block.object_manager,
        block.dashboard_agent_listen,
        block.dashboard_agent_grpc,
        block.runtime_env_agent,
        block.metrics_export,
        block.min_worker_port,
        block.max_worker_port,
    ]:
        assert f"={port}" in head
    worker = " ".join(block.ray_start_args(head=False, dashboard=True))
    assert f"--port={block.gcs}" not in worker and "--dashboard-port" not in worker
    assert "--dashboard-port" not in " ".join(block.ray_start_args(head=True, dashboard=False))
    assert block.env() == {
        "AUTOSCALER_METRIC_PORT": str(block.autoscaler_metric),
        "DASHBOARD_METRIC_PORT": str(block.dashboard_metric),
    }


def test_round_trip_and_unknown_keys() -> None:
    block = block_at(PortRange(), 3)
    assert PortBlock.from_dict(block.to_dict()) == block
    with pytest.raises(PortError, match="unknown keys \\['gcs_port'\\]"):
        PortBlock.from_dict(dict(block.to_dict(), gcs_port=1))


def test_bad_ranges() -> None:
    with pytest.raises(PortError, match="port_base"):
        PortRange(base=80)
    with pytest.raises(PortError, match="cannot hold one block"):
        PortRange(base=20000, limit=20100, block_size=256)


def test_busy_port_moves_to_next_block() -> None:
    rng = PortRange(base=21000, limit=23000, block_size=64)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        assert not port_is_free(busy)
        first = block_at(rng, 2)
        chosen = find_free_block(rng, 2, is_free=lambda p: p != first.gcs and port_is_free(p))
        assert chosen == block_at(rng, 3)


def test_real_bind_probe_shifts_past_a_listening_socket() -> None:
    rng = PortRange(base=24000, limit=26000, block_size=64)
    start = find_free_block(rng, 0)
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", start.object_manager))
        holder.listen()
        index = (start.gcs - rng.base) // rng.block_size
        moved = find_free_block(rng, index)
        assert moved != start and start.object_manager not in moved.all_ports()


def test_no_free_block_error() -> None:
    with pytest.raises(PortError, match="widen the range"):
        find_free_block(PortRange(), 0, is_free=lambda p: False)


def test_worker_keeps_head_ports_and_takes_own_node_ports() -> None:
    rng = PortRange()
    head, local = block_at(rng, 0), block_at(rng, 5)
    merged = head.with_node_ports_from(local)
    assert merged.gcs == head.gcs and merged.ray_client_server == head.ray_client_server
    assert merged.node_manager == local.node_manager
    assert merged.min_worker_port == local.min_worker_port


def test_a_block_claimed_by_another_agent_is_skipped_until_released() -> None:
    """Two agents starting on one node at once: the first claims its block before Ray binds it,
    so the second, whose probe still finds every port free, moves on."""
    rng = PortRange(base=21000, limit=23000, block_size=64)
    prefix = f"hpcrl-test-{os.getpid()}-"
    first, second = PortClaims(prefix), PortClaims(prefix)
    try:
        a = find_free_block(rng, 4, is_free=lambda p: True, claims=first)
        b = find_free_block(rng, 4, is_free=lambda p: True, claims=second)
        assert (a, b) == (block_at(rng, 4), block_at(rng, 5))
        assert find_free_block(rng, 4, is_free=lambda p: True, claims=first) == a  # already its own
        first.release()
        assert find_free_block(rng, 4, is_free=lambda p: True, claims=PortClaims(prefix)) == a
    finally:
        first.release()
        second.release()


def test_a_claim_with_taken_ports_is_given_back() -> None:
    rng = PortRange(base=21000, limit=23000, block_size=64)
    prefix = f"hpcrl-test-{os.getpid()}-"
    claims = PortClaims(prefix)
    busy = block_at(rng, 2).node_manager
    chosen = find_free_block(rng, 2, is_free=lambda p: p != busy, claims=claims)
    assert chosen == block_at(rng, 3)
    assert PortClaims(prefix).claim(block_at(rng, 2)), "the block with a taken port stays unclaimed"
    claims.release()


def test_a_claim_ends_with_its_process_and_names_it_while_held() -> None:
    from hpcrl.agent.launch import taken_port

    rng = PortRange(base=21000, limit=23000, block_size=64)
    prefix = f"hpcrl-test-{os.getpid()}-"
    block = block_at(rng, 6)
    code = (
        "import sys; from hpcrl.agent.ports import PortClaims, PortBlock\n"
        f"c = PortClaims({prefix!r}); assert c.claim(PortBlock(**{block.to_dict()!r}))\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        mine = PortClaims(prefix)
        assert not mine.claim(block)
        assert f"claimed by another hpcrl agent on this node: pid {holder.pid} (" in taken_port(block, mine)
    finally:
        holder.kill()
        holder.wait()
    assert mine.claim(block), "a dead agent's claim must vanish with it"
    mine.release()


@pytest.mark.skipif(os.getuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="starts the system Python as another user (needs root)")
@pytest.mark.parametrize("listens", [True, False])
def test_another_users_claim_on_our_name_is_ignored(listens: bool) -> None:
    """Abstract sockets have no permissions: a process of user `nobody` binds this user's claim
    name for a block (listening or not). The block stays claimable; this user's own holder
    still keeps it."""
    rng = PortRange(base=21000, limit=23000, block_size=64)
    prefix = f"hpcrl-test-{os.getpid()}-"
    mine = PortClaims(prefix)
    block = block_at(rng, 7)
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind('\\0' + {mine.name(block)!r})\n"
        + ("s.listen(8)\n" if listens else "")
        + "print('squatting', flush=True); sys.stdin.read()\n"
    )
    squatter = subprocess.Popen(["/usr/bin/python3", "-I", "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, user=65534, group=65534)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "squatting"
        assert claim_holder_uid(mine.name(block)) == (65534 if listens else None)
        assert find_free_block(rng, 7, is_free=lambda p: True, claims=mine) == block
        assert mine.name(block) == f"{prefix}{os.getuid()}-{block.gcs}"
    finally:
        squatter.kill()
        squatter.wait()
        mine.release()
    held = PortClaims(prefix)
    assert held.claim(block) and claim_holder_uid(held.name(block)) == os.getuid()
    assert not PortClaims(prefix).claim(block), "this user's own claim still counts"
    held.release()


def test_time_wait_is_told_apart_from_a_holder() -> None:
    from hpcrl.agent.launch import taken_port
    from hpcrl.agent.procs import port_closing

    rng = PortRange(base=21000, limit=23000, block_size=64)
    block = find_free_block(rng, 9)
    with socket.socket() as server:
        server.bind(("127.0.0.1", block.gcs))
        server.listen()
        client = socket.create_connection(("127.0.0.1", block.gcs))
        conn, _ = server.accept()
        conn.close()  # the side that closes first keeps TIME_WAIT on the server's port
        client.close()
    assert not port_is_free(block.gcs) and port_closing(block.gcs)
    assert "(TIME_WAIT)" in taken_port(block, PortClaims(f"hpcrl-test-{os.getpid()}-"))
