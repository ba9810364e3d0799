"""The weight broadcast between the pools (:mod:`trainer.workers.weight_broadcast`): real gloo
groups of one sender and two receivers in processes of their own, over a real TCP store."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from typing import Any

import pytest
import torch

from trainer.workers import weight_broadcast as WB


def state(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A model-like state: fp32 matrices, a bf16 tensor, an int buffer, an empty tensor, one
    tensor larger than a bucket, and a tied name sent twice."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(50, 16, generator=g)
    return [("embed.weight", emb), ("layers.0.q", torch.randn(16, 16, generator=g)),
            ("layers.0.norm", torch.randn(16, generator=g).to(torch.bfloat16)),
            ("layers.0.steps", torch.arange(7, dtype=torch.int64)), ("layers.0.empty", torch.zeros(0, 4)),
            ("layers.1.big", torch.randn(40, 40, generator=g)), ("layers.1.k", torch.randn(3, 5, generator=g)),
            ("lm_head.weight", emb)]


def layout_of(tensors: list[tuple[str, torch.Tensor]], wire: torch.dtype | None) -> WB.Layout:
    return WB.plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors), 2048, wire)


def _sender(address: WB.BroadcastAddress, store_port: int, versions: list[int], out: Any) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(address.host, store_port, address.world_size, True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    pg = WB.open_group(address, 0, 60, store=store)
    for v in versions:  # odd versions in turn, even ones pipelined
        sender = WB.Sender(pg, address.layout, torch.device("cpu"), overlap=v % 2 == 0)
        stats = sender.send(state(v), v)
        out.put(("sent", v, stats.bytes))


def _receiver(address: WB.BroadcastAddress, rank: int, versions: list[int], out: Any) -> None:
    pg = WB.open_group(address, rank, 60)
    for v in versions:
        receiver = WB.Receiver(pg, address.layout, torch.device("cpu"), overlap=v % 2 == 0)
        try:
            kept = [item for bucket in receiver.buckets(v) for item in bucket]  # every bucket kept to the end
        except RuntimeError as err:
            out.put(("error", rank, str(err)))
            return
        # plain bytes through the queue: a tensor's shared storage would die with this process
        out.put(("got", rank, v, [(n, str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                                  for n, t in kept], receiver.received))


def run_group(layout: WB.Layout, send_versions: list[int], receive_versions: list[int], *,
              timeout: float = 120) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_port = WB.serve_store("127.0.0.1", 1, 5).port  # a free port: bound, read, released
    address = WB.BroadcastAddress("127.0.0.1", store_port, 3, "gloo", layout)
    procs = [ctx.Process(target=_sender, args=(address, store_port, send_versions, out))]
    procs += [ctx.Process(target=_receiver, args=(address, r, receive_versions, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        while len(got) < len(send_versions) + 2 * len(receive_versions):
            item = out.get(timeout=timeout)
            got.append(item)
            if item[0] == "error":
                break
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5 if got and got[-1][0] == "error" else 30)
            if p.is_alive():
                p.kill()
    return got


def test_every_receiver_gets_every_tensor_in_the_engine_dtype_in_turn_and_pipelined() -> None:
    layout = layout_of(state(), torch.bfloat16)
    assert len(layout.buckets) >= 3 and layout.largest > 2048  # the big tensor travels alone
    got = run_group(layout, [1, 2, 3, 4], [1, 2, 3, 4])
    sent = [g for g in got if g[0] == "sent"]
    received = [g for g in got if g[0] == "got"]
    assert len(sent) == 4 and len(received) == 8, got
    for _, rank, version, tensors, nbytes in received:
        expect = state(version)
        assert [n for n, *_ in tensors] == [n for n, _ in expect]
        for (name, dtype, shape, raw), (_, e) in zip(tensors, expect, strict=True):
            kind = getattr(torch, dtype.removeprefix("torch."))
            t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind) if raw
                 else torch.empty(0, dtype=kind)).view(shape)
            wire = torch.bfloat16 if e.dtype.is_floating_point else e.dtype
            assert t.dtype == wire and t.shape == e.shape, name
            assert torch.equal(t, e.to(wire)), (rank, version, name)  # the engine's own cast, bit for bit
        assert nbytes == layout.total_bytes


def test_a_receiver_out_of_step_fails_naming_both_versions() -> None:
    layout = layout_of(state(), None)
    got = run_group(layout, [3], [4], timeout=60)
    errors = [g for g in got if g[0] == "error"]
    assert errors and "sender sends version 3" in errors[0][2] and "expects version 4" in errors[0][2], got


def test_the_layout_aligns_every_tensor_and_its_digest_sees_any_change() -> None:
    tensors = state()
    layout = layout_of(tensors, None)
    assert all(s.offset % WB.ALIGN == 0 for _, s in layout.slots())
    assert [s.name for _, s in layout.slots()] == [n for n, _ in tensors]
    for b, bucket in enumerate(layout.buckets):
        assert bucket[-1].offset + bucket[-1].nbytes == layout.sizes[b]
        assert layout.sizes[b] <= 2048 or len(bucket) == 1
    renamed = [("x" + n, t) for n, t in tensors]
    assert layout_of(renamed, None).digest != layout.digest
    assert layout_of(tensors, torch.bfloat16).digest != layout.digest
    assert layout_of(tensors, None).digest == layout.digest


def test_a_sender_whose_state_differs_from_the_layout_names_the_tensor() -> None:
    layout = layout_of(state(), None)

    class NoGroup:  # the header goes out before the first tensor is checked: a group of one
        def broadcast(self, tensors: Any, opts: Any) -> Any:
            class Done:
                def wait(self) -> bool:
                    return True
            return Done()

    sender = WB.Sender(NoGroup(), layout, torch.device("cpu"), overlap=False)
    with pytest.raises(RuntimeError, match=r"got `layers.0.k` \(3, 5\), the layout expects `layers.0.q` \(16, 16\)"):
        sender.send([state()[0], ("layers.0.k", torch.zeros(3, 5))], 1)
    with pytest.raises(RuntimeError, match="ended before `layers.0.q`"):
        sender.send(state()[:1], 1)


GROUP_TIMEOUT_S = 600
"""The group's timeout in the test below: `actor_rollout_ref.nccl_timeout`'s default."""


def _sender_until_error(address: WB.BroadcastAddress, store_port: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(address.host, store_port, address.world_size, True,
                          timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S), wait_for_workers=False)
    pg = WB.open_group(address, 0, GROUP_TIMEOUT_S, store=store)
    try:
        for v in range(1, 1000):  # syncs until one fails
            WB.Sender(pg, address.layout, torch.device("cpu"), overlap=True).send(state(v % 3), v)
    except RuntimeError as err:
        out.put(("error", time.time(), str(err)))


def _receiver_killed_mid_sync(address: WB.BroadcastAddress, rank: int, out: Any) -> None:
    import os
    import signal

    pg = WB.open_group(address, rank, GROUP_TIMEOUT_S)
    buckets = WB.Receiver(pg, address.layout, torch.device("cpu"), overlap=True).buckets(1)
    next(buckets)  # the header and the first bucket of the first sync, the next one posted
    out.put(("dying", time.time()))
    out.close()
    out.join_thread()  # the queue's feeder thread has sent that line
    os.kill(os.getpid(), signal.SIGKILL)  # as a rollout node's processes die


def test_a_receiver_killed_mid_sync_fails_the_sender_at_once_not_at_the_groups_timeout() -> None:
    """A rollout rank whose process dies inside a sync (SIGKILL, as when its node dies): actor
    rank 0's broadcast fails within seconds (the kernel closes the dead process's sockets, gloo
    reads the reset), not after the group's timeout; the other receiver is left waiting, which
    the driver ends with the run (its pool group is killed at the first failure)."""
    layout = layout_of(state(), None)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_port = WB.serve_store("127.0.0.1", 1, 5).port
    address = WB.BroadcastAddress("127.0.0.1", store_port, 3, "gloo", layout)
    procs = [ctx.Process(target=_sender_until_error, args=(address, store_port, out)),
             ctx.Process(target=_receiver, args=(address, 1, list(range(1, 1000)), out)),
             ctx.Process(target=_receiver_killed_mid_sync, args=(address, 2, out))]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    try:
        while not {"dying", "error"} <= got.keys():
            item = out.get(timeout=120)
            got.setdefault(item[0], item)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    (_, died), (_, failed, message) = got["dying"], got["error"]
    assert 0 < failed - died < 30, f"the sender failed {failed - died:.1f} s after the receiver died: {message}"
    assert "Connection reset by peer" in message or "Connection closed by peer" in message, message


class _Side:
    """A worker group for `sync_pool`: its broadcast or its receive fails after `after_s`
    seconds (or never returns: None)."""

    def __init__(self, failure: str, after_s: float | None) -> None:
        self.world_size, self.failure, self.after_s = 1, failure, after_s

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        return "float32" if method == "wire_dtype" else "the address"

    def run(self, method: str, *args: Any) -> list[Any]:
        return self.run_each(method, [args])

    def run_each(self, method: str, per_rank: Any) -> list[Any]:
        from trainer.workers.group import WorkerFailure

        if self.after_s is None:
            threading.Event().wait()  # a receiver left waiting for buckets (a daemon thread)
        time.sleep(self.after_s)
        raise WorkerFailure(self.failure)


@pytest.mark.parametrize("pool_after_s", [0.5, None])
def test_a_sync_whose_pool_rank_died_raises_the_pools_failure_not_the_senders_reset(
        monkeypatch: pytest.MonkeyPatch, pool_after_s: float | None) -> None:
    """A pool rank that dies inside a sync resets actor rank 0's connection at once, and Ray
    reports the rank dead only seconds later: the sync raises the pool's failure (the dead rank,
    its node), not gloo's reset on the trainer's rank; a pool that reports nothing within
    `PEER_FAILURE_WAIT_S` leaves the sender's failure raised."""
    from trainer.config.async_training import CheckpointEngineConfig
    from trainer.stages import sync
    from trainer.workers.group import WorkerFailure

    monkeypatch.setattr(sync, "PEER_FAILURE_WAIT_S", 5.0)
    actor = _Side("rank 0 of actor_rollout_ref on node `node1` raised RuntimeError: Connection reset by peer", 0.0)
    pool = _Side("rank 0 of rollout on node `node2` died (ActorDiedError)", pool_after_s)
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as raised:
        sync.sync_pool(actor, pool, 3, lambda *_: None, CheckpointEngineConfig(True, True, 4096))
    took = time.monotonic() - start
    if pool_after_s is not None:
        assert "node `node2` died" in str(raised.value) and took < 3, (raised.value, took)
    else:
        assert "Connection reset by peer" in str(raised.value) and 5 <= took < 8, (raised.value, took)
