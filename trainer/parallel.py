"""torch.distributed pieces of the data-parallel workers (no Ray here).

- :func:`init_process_group`: one group per worker group (gloo on CPU, NCCL on NVIDIA and RCCL
  on AMD GPUs, both named ``nccl`` in torch), rendezvous over TCP at the address and port the
  driver chose; IPv6 addresses are bracketed in the URL. The socket interface comes from
  ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, which the node agent exports on every node.
  **Reach** (measured by ``tests/trainer/test_parallel.py::test_the_store_reach_is_as_stated``):
  rank 0's TCPStore listens on every interface of its node (torch has no bind address for it;
  it listens on ``*:PORT`` even for a store named ``127.0.0.1``) and has no authentication:
  while the group lives, any user who can reach that node and finds the port (free, picked
  per group) can connect, list and read its keys, among them the group's rendezvous (NCCL's
  unique id) and write keys. Gloo's and NCCL's own sockets are reachable likewise. Keeping
  other users out of them takes the site: whole nodes per job (``slurm.exclusive``) on a
  network that only the job's nodes share, or a firewall between users' jobs.
- Data parallelism: with more than one rank the model is sharded with FSDP2 ``fully_shard``
  (:func:`apply_fsdp2`) on GPUs and on the CPU alike (FSDP2 runs over gloo), so parameters,
  gradients and Adam moments per rank fall as 1/W; backward reduce-scatters the gradients. One
  rank forms no process group and keeps a plain module. (:func:`all_reduce_gradients` averages
  the gradients of replicas with one flat all-reduce, for models kept whole on purpose.)
- Loss normalisation: every micro-batch loss is divided by the token/sequence counts of the
  whole mini-batch (the driver counts them, :class:`~trainer.batch.MiniBatchShare`) and
  multiplied by the world size, so the averaged gradient equals the one-rank one whatever the
  number of ranks.
- Micro-batches: by sample count, or by token budget with the same number of micro-batches on
  every rank (:func:`rank_micro_batches`), which FSDP needs (its collectives run per forward).
- Full parameters one at a time (:func:`full_tensors`, ``DTensor.full_tensor()`` per entry, a
  collective) in buckets of bounded size (:func:`weight_buckets`): what the weight sync streams to
  the rollout engine and the HF export writes, never the whole model on one rank. Both read
  :func:`state_entries`: the HF names, shapes and gatherers of the model's state dict, which for a
  LoRA (peft) model are the base model's, adapters merged (:mod:`trainer.lora`).
  :func:`full_model_state` gathers everything at once (tests and small models only).
"""

from __future__ import annotations

import datetime
import heapq
import math
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import torch
import torch.distributed as dist

from trainer import lora
from trainer.batch import micro_batch_rows

__all__ = [
    "DistContext",
    "StateEntry",
    "all_reduce_gradients",
    "all_reduce_max",
    "apply_fsdp2",
    "balanced_partition",
    "balanced_split",
    "free_port",
    "full_model_state",
    "full_tensors",
    "init_method_url",
    "init_process_group",
    "karmarkar_karp",
    "rank_micro_batches",
    "rank_mini_batches",
    "reshard",
    "single_rank",
    "split_rows",
    "state_entries",
    "unique_state_names",
    "weight_buckets",
    "workload",
]


@dataclass(frozen=True)
class DistContext:
    """Where one worker stands in its group."""

    rank: int
    """This worker's rank in its group (0..world_size-1)."""
    world_size: int
    """Workers in the group."""
    backend: str
    """`gloo` (CPU) or `nccl` (NVIDIA NCCL / AMD RCCL)."""
    fsdp: bool
    """Model sharded with FSDP2 (every group of more than one rank, CPU or GPU)."""
    single_device: str = "cpu"
    """The device of a single rank (`backend` none): `cpu` or `cuda`."""

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl" or (self.backend == "none" and self.single_device == "cuda"):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def single_rank(device: torch.device) -> DistContext:
    """A group of one: no process group, no sharding, the model on `device`."""
    return DistContext(rank=0, world_size=1, backend="none", fsdp=False, single_device=device.type)


def init_method_url(host: str, port: int) -> str:
    """`tcp://host:port`, with the IPv6 host in brackets (`tcp://[fd77::11]:29500`)."""
    bare = host.strip("[]")
    return f"tcp://[{bare}]:{port}" if ":" in bare else f"tcp://{bare}:{port}"


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the rendezvous store binds it next)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, *,
                       backend: str | None = None, timeout_s: float = 600.0,
                       device_index: int = 0, shard_alone: bool = False) -> DistContext:
    """Join the group of `world_size` ranks whose rank 0 serves the store at `master_addr`.

    `backend` None picks `nccl` when CUDA (or ROCm) is available, else `gloo`; with `nccl` the
    rank uses GPU `device_index` of this process (the one Ray assigned it,
    :func:`trainer.workers.base.take_ray_device`; never an inherited `LOCAL_RANK`).
    `shard_alone`: a group of one rank still shards with FSDP2 (the one-GPU check,
    `bench/gpu_check.py`, runs the multi-rank path, NCCL and FSDP2 included, on one device).
    """
    fsdp = world_size > 1 or shard_alone
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():  # a second worker in the same process joins the same group
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"cannot also be rank {rank} of {world_size}; start one process per rank")
        return DistContext(rank=rank, world_size=world_size, backend=dist.get_backend(), fsdp=fsdp)
    if chosen == "nccl":
        torch.cuda.set_device(device_index)
    dist.init_process_group(
        chosen, init_method=init_method_url(master_addr, master_port), rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world_size, backend=chosen, fsdp=fsdp)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def consecutive_cpu_group(size: int) -> dist.ProcessGroup | None:
    """This rank's group of `size` consecutive ranks (ranks 0..size-1, size..2*size-1, ...: a
    tensor-parallel engine's ranks), on gloo whatever the world's backend: it carries Python
    objects between the engine's ranks (:mod:`trainer.agent.servers`), never tensors of the
    model. None with `size` 1 or no process group. A collective over the whole world: every rank
    creates every group, in the same order, as ``new_group`` requires."""
    if size <= 1 or not _active():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"groups of {size} consecutive ranks do not divide the {world} ranks")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)), backend="gloo")
        if start <= rank < start + size:
            mine = group
    return mine


def all_reduce_max(value: int) -> int:
    """The largest `value` over all ranks."""
    t = torch.tensor([value], dtype=torch.int64)
    if _active():
        t = t.to(_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_gradients(model: torch.nn.Module, world_size: int) -> None:
    """Average the gradients of a replicated model over the ranks: one flat all-reduce.

    A parameter without a gradient on this rank contributes zeros, so every rank takes part in
    the same collective whatever it computed.
    """
    if world_size <= 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def apply_fsdp2(model: torch.nn.Module, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `model` with FSDP2: each decoder layer is its own unit, then the root. The shards
    stay on the compute device; `param_offload` moves them to the host between phases
    (:mod:`trainer.phases`), not FSDP2's `CPUOffloadPolicy`, whose CPU DTensors would reach
    collectives outside FSDP's forward/backward on an NCCL-only group. `param_dtype` /
    `reduce_dtype` (FSDP2's `MixedPrecisionPolicy`): the dtype parameters are gathered and
    computed in, and the dtype gradients are reduced in; the shards (the master weights the
    optimizer updates) keep the model's dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def apply_autocast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """One rank's mixed precision (no FSDP2 to cast the parameters): every forward of `model`
    runs under `torch.autocast(dtype)`, so matmuls compute in `dtype` while the parameters and
    their gradients (the master weights) keep the model's dtype."""
    contexts: list[torch.autocast] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        device_type = next(module.parameters()).device.type
        contexts.append(torch.autocast(device_type, dtype=dtype))
        contexts[-1].__enter__()

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free the whole parameters FSDP2 keeps on the root unit after a forward pass with no
    backward (it expects the backward to need them): log-prob and value passes call it, and so
    does an update whose rank ran no forward, so that its parameters are the sharded DTensors
    again. A no-op for a model without FSDP."""
    if hasattr(model, "reshard"):
        model.reshard()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    backbone = getattr(model, "backbone", None)  # the critic wraps a transformers model
    if backbone is not None:
        names |= set(getattr(backbone, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def split_rows(n: int, parts: int) -> list[list[int]]:
    """Rows 0..n-1 in `parts` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def workload(lengths: Sequence[int]) -> list[int]:
    """verl's relative cost of a row of `length` real tokens (verl/utils/seqlen_balancing.py
    `calculate_workload`): `24576 * length + length**2`, a dense 7B-shaped block's linear and
    attention FLOPs. What both balancers below weigh, so rows land where verl puts them."""
    return [24576 * int(n) + int(n) ** 2 for n in lengths]


class _LdmState:
    """One partial solution of the largest differencing method: `k` sets, largest first.

    A set is `[sum, [(row, value), ...]]`, ordered as verl orders them (sum, then item count,
    then the items); the state that `heapq` pops first is the one of largest spread, then the
    one whose largest set is largest. These tie-breaks decide which rows share a rank, and
    hence (with verl's per-micro-batch means) the loss, so they are verl's."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[list[Any]]) -> None:
        self.sets = sorted(sets, key=self._key, reverse=True)

    @staticmethod
    def _key(s: list[Any]) -> tuple[int, int, list[tuple[int, int]]]:
        return s[0], len(s[1]), s[1]

    def spread(self) -> int:
        return int(self.sets[0][0] - self.sets[-1][0])

    def __lt__(self, other: _LdmState) -> bool:
        if self.spread() != other.spread():
            return self.spread() > other.spread()
        return self._key(self.sets[0]) > self._key(other.sets[0])

    def absorb(self, other: _LdmState) -> None:
        """Largest set with the other's smallest, and so on down (the differencing step)."""
        k = len(self.sets)
        for i in range(k):
            mine, theirs = self.sets[i], other.sets[k - 1 - i]
            mine[0] += theirs[0]
            mine[1] = mine[1] + theirs[1]
        self.sets = sorted(self.sets, key=self._key, reverse=True)


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Rows in `k` groups of similar `values` totals by the largest differencing method, as
    verl partitions (verl/utils/seqlen_balancing.py `get_seqlen_balanced_partitions`): rows
    sorted by (value, row); with `equal_size`, each run of `k` of them starts a state with one
    row per set (every group then has `len(values) / k` rows), else each row starts one alone;
    the two states of largest spread merge until one is left. Groups largest total first, each
    group's rows in row order."""
    n = len(values)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} rows into {k} non-empty groups")
    if equal_size and n % k:
        raise ValueError(f"{n} rows do not split into {k} groups of equal size")
    items = sorted((int(v), row) for row, v in enumerate(values))
    width = k if equal_size else 1
    heap: list[_LdmState] = []
    for at in range(0, n, width):
        sets = [[v, [(row, v)]] for v, row in items[at:at + width]]
        heapq.heappush(heap, _LdmState(sets + [[0, []] for _ in range(k - len(sets))]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    groups = [sorted(row for row, _ in s[1]) for s in heap[0].sets]
    if not all(groups):
        raise ValueError(f"cannot split {n} rows into {k} non-empty groups of similar totals")
    return groups


def balanced_split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Each data-parallel rank's rows under `trainer.balance_batch`, in the order that rank
    takes them: verl's `_balance_batch` (verl/trainer/ppo/ray_trainer.py). Groups of equal size
    and similar :func:`workload` by :func:`karmarkar_karp`; each group ordered lightest first
    and then every other row, so the heaviest rows sit in the middle
    (`rows[::2] + rows[1::2][::-1]` of the rows sorted by workload). Which rows a rank gets and
    their order decide its mini- and micro-batches, as in verl. A batch that does not divide
    into equal groups (verl refuses it) is cut into contiguous chunks.

    One step asks for the same batch's split in every phase (log-probs, reference, values,
    each update epoch); the partition of 2048 rows over 16 ranks takes about 80 ms here, so the
    last few are remembered by the lengths themselves (fresh lists each call)."""
    return [list(rows) for rows in _balanced_split(tuple(int(n) for n in lengths), parts)]


@lru_cache(maxsize=4)
def _balanced_split(lengths: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    if len(lengths) % parts or len(lengths) < parts:
        return tuple(tuple(rows) for rows in split_rows(len(lengths), parts))
    work = workload(lengths)
    out = []
    for group in karmarkar_karp(work, parts, equal_size=True):
        ordered = sorted(group, key=lambda r: (work[r], r))
        out.append(tuple(ordered[::2] + ordered[1::2][::-1]))
    return tuple(out)


def balanced_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """A rank's rows in `k` dynamic micro-batches, as verl's `rearrange_micro_batches` makes
    them: groups of similar :func:`workload` by :func:`karmarkar_karp` (sizes free), ordered
    heaviest first and then dealt to both ends (`groups[::2][::-1] + groups[1::2]`), so the
    lightest run first and last; each group's rows in row order. Needs `k <= len(lengths)`."""
    work = workload(lengths)
    groups = karmarkar_karp(work, k, equal_size=False)
    groups.sort(key=lambda g: (sum(work[r] for r in g), g[0]), reverse=True)
    return groups[::2][::-1] + groups[1::2]


def rank_mini_batches(per_rank: Sequence[Sequence[int]], local_size: int) -> list[list[list[int]]]:
    """Mini-batches as verl forms them once the batch is split over the ranks (`per_rank`: each
    rank's rows in its order): each rank cuts its rows into consecutive local mini-batches of
    `local_size` rows (verl/workers/actor/dp_actor.py `update_policy`: `data.split`), and
    mini-batch k is every rank's k-th cut. Per mini-batch, per rank, its rows."""
    count = max(-(-len(rows) // local_size) for rows in per_rank)
    return [[list(rows[k * local_size:(k + 1) * local_size]) for rows in per_rank] for k in range(count)]


def rank_micro_batches(lengths: Sequence[int], micro_batch_size: int | None, use_dynamic_bsz: bool,
                       max_token_len: int) -> list[list[int]]:
    """This rank's micro-batches: consecutive rows by count, or verl's token-budget split:
    `ceil(tokens / max_token_len)` micro-batches (at most one per row), the largest count any
    rank needs (every rank runs as many forwards, which FSDP's collectives need), rows placed by
    :func:`balanced_partition`. A micro-batch may then hold a little more than the budget, as
    in verl."""
    if not use_dynamic_bsz:
        return micro_batch_rows(len(lengths), micro_batch_size)
    needed = min(len(lengths), -(-int(sum(lengths)) // max_token_len))
    count = min(all_reduce_max(needed), len(lengths))
    return balanced_partition(lengths, count) if count > 1 else [list(range(len(lengths)))]


# ----------------------------------------------------------------------------- full states


def _full_options(cpu_offload: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def full_model_state(model: torch.nn.Module, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state (gathered from the shards under FSDP; a collective).

    By default it lands on the CPU, and under FSDP only rank 0 receives it (enough for the HF
    export); `every_rank=True` gives every rank the full tensors on its device (weight sync).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict[str, Any] = get_model_state_dict(model, options=_full_options(cpu_offload=not every_rank))
    return state


def unique_state_names(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s state dict with tied duplicates left out (the output embedding
    tied to the input one appears once, under its first name), in state-dict order. The same on
    every rank: it follows the module tree, not the storage of this rank's shards."""
    unique = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return [name for name in model.state_dict() if name in unique]


def _whole(value: torch.Tensor) -> torch.Tensor:
    """`value` gathered whole when it is a DTensor shard (a collective), detached."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach()


@dataclass(frozen=True)
class StateEntry:
    """One tensor of a model's HF state: its name, global dtype and shape (known before
    gathering), and how to gather it whole (a collective under FSDP2)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    gather: Callable[[], torch.Tensor] = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def state_entries(model: torch.nn.Module, *, unique: bool = False) -> list[StateEntry]:
    """The entries of `model`'s state dict under their HF names, in state-dict order; with
    `unique` those of :func:`unique_state_names`. A LoRA (peft) model gives its base model's
    names, each adapted weight merged with its adapters when gathered
    (:func:`trainer.lora.merge`). The same list on every rank."""
    state = model.state_dict()
    names = unique_state_names(model) if unique else list(state)
    if not lora.is_lora(model):
        return [StateEntry(n, state[n].dtype, tuple(state[n].shape), partial(_whole, state[n])) for n in names]
    layers = lora.lora_layers(model)
    entries = []
    for name in names:
        if lora.is_adapter_name(name):
            continue
        value, layer = state[name], layers.get(name)
        gather = partial(_whole, value) if layer is None else partial(_merged_whole, value, layer)
        entries.append(StateEntry(lora.base_name(name), value.dtype, tuple(value.shape), gather))
    return entries


def _merged_whole(value: torch.Tensor, layer: Any) -> torch.Tensor:
    return lora.merge(_whole(value), layer)


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, whole tensor)` for each entry of :func:`state_entries` (`unique`), gathered one
    at a time (`DTensor.full_tensor()`, a collective: every rank must iterate to the end, in
    step)."""
    for entry in state_entries(model, unique=True):
        yield entry.name, entry.gather()


def weight_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every entry of `model`'s state dict (:func:`state_entries`: a LoRA model's merged base
    weights), gathered whole, in buckets of at most `bucket_bytes` (a tensor larger than that
    travels alone). Tied duplicates are sent under each of their names
    (vLLM's layer-wise reload expects the output embedding even when it is tied). Sizes are known before gathering (a DTensor's shape is the
    global one), so a tensor is gathered only once its bucket has room: a rank holds at most one
    bucket of gathered tensors. A bucket is emptied in place when the next one is asked for, so
    the consumer must copy what it keeps (the tensors may be views of sharded storage on one
    rank). A collective: every rank must iterate to the end, in step."""
    if bucket_bytes < 1:
        raise ValueError(f"`bucket_bytes` must be at least 1, received {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for entry in state_entries(model):
        if bucket and size + entry.nbytes > bucket_bytes:
            yield bucket
            bucket.clear()
            size = 0
        bucket.append((entry.name, entry.gather()))
        size += entry.nbytes
    if bucket:
        yield bucket
        bucket.clear()
