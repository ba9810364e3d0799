"""The weight sync between the pools as a collective broadcast: verl's NCCL checkpoint engine
(`verl/checkpoint_engine/nccl_checkpoint_engine.py`, 0.9.1), written here over torch's own
process-group classes.

Actor rank 0 sends, every rank of the rollout pool receives: a group of 1 + pool ranks, apart
from the trainer's own process group, on NCCL between GPUs (RCCL on ROCm: torch's `nccl` backend
is RCCL there) and on gloo between CPUs (the lab). The group is made of
:class:`torch.distributed.ProcessGroupNCCL` or :class:`~torch.distributed.ProcessGroupGloo`
directly over a :class:`~torch.distributed.TCPStore` that actor rank 0 serves, so neither side's
default group is touched (a pool rank has none; the actor's is the trainer's FSDP group). gloo
takes its interface from `GLOO_SOCKET_IFNAME` as the trainer's own group does (the constructor
reads it), NCCL from `NCCL_SOCKET_IFNAME` and the site's IB settings.

The bucket layout (:class:`Layout`) is fixed before the first sync from the names, dtypes and
shapes of the actor's state (:func:`trainer.parallel.state_entries`, known before any gather), so
a sync moves raw bytes only: no per-bucket metadata channel (verl sends each bucket's metadata
over ZeroMQ). Each sync starts with a header (weight version, the layout's digest, bucket count)
that the receivers check, so a sender and receivers out of step fail at once, naming both.

Floating-point tensors travel in the dtype of the pool's engine (`rollout.dtype`, as verl sends
`rollout_dtype`): the engine would cast them on load anyway, so the numbers are the same and the
bytes fewer (half, from fp32 master weights to bf16).

Pipelining (`async_training.checkpoint_engine.overlap_broadcast_and_consume`): the sender fills
one buffer while the other's broadcast is in flight; each receiver posts the next bucket's
receive before handing the engine the last one, so the network and the engine's load overlap.
Without it each bucket is received, then loaded.

Every received bucket is a buffer of its own, handed to the engine as views: vLLM's layer-wise
reload keeps the loaded tensors by reference until every part of a layer has arrived
(`vllm/model_executor/model_loader/reload/layerwise.py`, `info.loaded_weights`), so a buffer
reused for the next bucket would overwrite a fused layer's first half. The caching allocator
hands the freed buffers back without a device allocation.

On GPUs (reasoned, not run here: no GPU has met this path): `ProcessGroupNCCL.broadcast` orders
its stream after the current one and records the tensor's use; :meth:`Work.wait` makes the
current stream wait for the broadcast, so a refill of the sender's buffer, or the engine's load
on the receiver, runs after it. The sender's buffers are allocated once per sync (1 or 2 x the
largest bucket); `trainer.memplan` counts them in the weight-sync phase.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ALIGN", "BroadcastAddress", "Layout", "Receiver", "Sender", "Slot", "SyncStats", "open_group",
           "plan_layout"]

ALIGN = 256
"""Byte alignment of each tensor in a bucket (a dtype view of a byte buffer needs its offset
divisible by the element size; 256 also keeps device copies coalesced)."""


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: its name, the dtype it travels in, its shape, and its
    byte offset in the bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """Every tensor of the sync in order, grouped into buckets of at most `bucket_bytes` (a
    tensor larger than that travels alone)."""

    buckets: tuple[tuple[Slot, ...], ...]
    sizes: tuple[int, ...]
    """Bytes of each bucket."""

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)

    @property
    def digest(self) -> int:
        """A 62-bit digest of every slot: the receivers compare it with the sender's."""
        h = hashlib.sha256()
        for bucket in self.buckets:
            for s in bucket:
                h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.offset};".encode())
            h.update(b"#")
        return int.from_bytes(h.digest()[:8], "little") >> 2

    def slots(self) -> Iterator[tuple[int, Slot]]:
        """Each slot with its bucket's index, in sending order."""
        for b, bucket in enumerate(self.buckets):
            for s in bucket:
                yield b, s


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_layout(entries: Iterable[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int,
                wire_dtype: torch.dtype | None = None) -> Layout:
    """The buckets for `entries` (name, dtype, shape, in the order they are sent), each floating
    tensor in `wire_dtype` when given."""
    if bucket_bytes < 1:
        raise ValueError(f"`bucket_bytes` must be at least 1, received {bucket_bytes}")
    buckets: list[tuple[Slot, ...]] = []
    sizes: list[int] = []
    current: list[Slot] = []
    size = 0
    for name, dtype, shape in entries:
        wire = wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype
        slot = Slot(name, _dtype_name(wire), tuple(int(d) for d in shape), 0)
        start = -(-size // ALIGN) * ALIGN
        if current and start + slot.nbytes > bucket_bytes:
            buckets.append(tuple(current))
            sizes.append(size)
            current, size, start = [], 0, 0
        current.append(Slot(slot.name, slot.dtype, slot.shape, start))
        size = start + slot.nbytes
    if current:
        buckets.append(tuple(current))
        sizes.append(size)
    return Layout(tuple(buckets), tuple(sizes))


@dataclass(frozen=True)
class BroadcastAddress:
    """What a receiver needs to join: the store of actor rank 0, the group's size (1 + pool
    ranks), the backend, and the layout."""

    host: str
    port: int
    world_size: int
    backend: str
    layout: Layout


@dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int
    wait_s: float
    """Seconds the sender was blocked on the network (waiting for a broadcast to finish before
    refilling its buffer)."""


_STORE_PREFIX = "hpcrl-weight-broadcast"


def open_group(address: BroadcastAddress, rank: int, timeout_s: float,
               store: dist.Store | None = None) -> Any:
    """This process's rank `rank` of the broadcast group at `address` (rank 0 passes the store
    it serves). Blocks until every rank has joined: the sender and the receivers call it
    together. Returns the process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address.host.strip("[]"), address.port, address.world_size, False,
                              timeout=timeout)
    prefixed = dist.PrefixStore(_STORE_PREFIX, store)
    if address.backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
    raise ValueError(f"unknown weight-broadcast backend {address.backend!r}; one of nccl, gloo")


def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store on actor rank 0, on a port the system picks (read back as `.port`)."""
    return dist.TCPStore(host.strip("[]"), 0, world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _header(version: int, layout: Layout, device: torch.device) -> torch.Tensor:
    return torch.tensor([version, layout.digest, len(layout.buckets)], dtype=torch.int64, device=device)


class Sender:
    """Actor rank 0's side: :meth:`send` the state tensors of one sync, in layout order."""

    def __init__(self, pg: Any, layout: Layout, device: torch.device, *, overlap: bool) -> None:
        self.pg, self.layout, self.device, self.overlap = pg, layout, device, overlap

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Broadcast `tensors` (name, tensor: the whole tensor, on this rank's device; copied into
        a bucket before the next is asked for) as weight version `version`."""
        start = time.perf_counter()
        wait_s = 0.0
        header = _header(version, self.layout, self.device)
        _broadcast(self.pg, header).wait()
        buffers = [torch.empty(self.layout.largest, dtype=torch.uint8, device=self.device)
                   for _ in range(2 if self.overlap else 1)]
        pending: list[Any] = [None] * len(buffers)
        slots = self.layout.slots()
        filled = -1
        for name, tensor in tensors:
            b, slot = next(slots, (None, None))
            if slot is None or slot.name != name or tuple(tensor.shape) != slot.shape:
                raise RuntimeError(
                    f"the actor's state changed since the weight-broadcast layout was made: got `{name}` "
                    f"{tuple(tensor.shape)}, the layout expects "
                    f"{'nothing more' if slot is None else f'`{slot.name}` {slot.shape}'}")
            which = b % len(buffers)
            if b != filled:  # a new bucket in this buffer: its last broadcast must be done
                if pending[which] is not None:
                    t0 = time.perf_counter()
                    pending[which].wait()
                    wait_s += time.perf_counter() - t0
                    pending[which] = None
                filled = b
            view = buffers[which][slot.offset:slot.offset + slot.nbytes].view(slot.torch_dtype).view(slot.shape)
            view.copy_(tensor.detach())
            if slot is self.layout.buckets[b][-1]:  # the bucket is whole: send it
                work = _broadcast(self.pg, buffers[which][:self.layout.sizes[b]])
                if self.overlap:
                    pending[which] = work
                else:
                    t0 = time.perf_counter()
                    work.wait()
                    wait_s += time.perf_counter() - t0
        missing = next(slots, None)
        if missing is not None:
            raise RuntimeError(f"the actor's state ended before `{missing[1].name}` of the weight-broadcast layout")
        t0 = time.perf_counter()
        for work in pending:
            if work is not None:
                work.wait()
        wait_s += time.perf_counter() - t0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the buffers are freed next
        return SyncStats(time.perf_counter() - start, self.layout.total_bytes, wait_s)


class Receiver:
    """A pool rank's side: :meth:`buckets` yields one sync's buckets as (name, tensor) lists."""

    def __init__(self, pg: Any, layout: Layout, device: torch.device, *, overlap: bool) -> None:
        self.pg, self.layout, self.device, self.overlap = pg, layout, device, overlap
        self.received = 0
        """Bytes of the sync in progress received so far."""

    def check_header(self, version: int) -> None:
        """Receive the sync's header; raise when it is not this receiver's version and layout."""
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        _broadcast(self.pg, header).wait()
        got_version, digest, count = (int(v) for v in header.tolist())
        if (got_version, digest, count) != (version, self.layout.digest, len(self.layout.buckets)):
            raise RuntimeError(
                f"the weight broadcast is out of step: the sender sends version {got_version} in {count} buckets "
                f"(layout {digest:x}), this rollout rank expects version {version} in "
                f"{len(self.layout.buckets)} buckets (layout {self.layout.digest:x})")

    def _post(self, b: int) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(self.layout.sizes[b], dtype=torch.uint8, device=self.device)
        return buffer, _broadcast(self.pg, buffer)

    def _unpack(self, b: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.received += self.layout.sizes[b]
        return [(s.name, buffer[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape))
                for s in self.layout.buckets[b]]

    def buckets(self, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of weight version `version`, each received into a buffer of its own; with
        `overlap`, the next one's receive is posted before this one is yielded. The generator
        must be run to its end: the sender waits for every receiver."""
        self.received = 0
        self.check_header(version)
        count = len(self.layout.buckets)
        if not self.overlap:
            for b in range(count):
                buffer, work = self._post(b)
                work.wait()
                yield self._unpack(b, buffer)
            return
        nxt = self._post(0) if count else None
        for b in range(count):
            assert nxt is not None
            buffer, work = nxt
            work.wait()
            nxt = self._post(b + 1) if b + 1 < count else None
            yield self._unpack(b, buffer)
