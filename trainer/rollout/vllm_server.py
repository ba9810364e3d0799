"""A server-mode vLLM replica: one vLLM `AsyncLLM` (V1 engine) whose engine core runs in its own
process, serving token-in/token-out turns to the agent loops
(:class:`trainer.agent.base.TokenServer`), as verl's `vLLMHttpServer`
(`verl/workers/rollout/vllm_rollout/vllm_async_server.py`) does behind Ray; several replicas go
behind :class:`trainer.agent.servers.ServerPool`.

Requests are served as they come (vLLM's continuous batching), not turn by turn: a trajectory
in a tool call holds no one back, unlike :class:`trainer.agent.servers.BatchedServer`.

The engine has the in-process engine's knobs (:func:`trainer.rollout.vllm.engine_args`,
:func:`~trainer.rollout.vllm.rollout_knobs`) and the same weight-sync contract: the buckets are
streamed one at a time through the three worker calls of the layer-wise reload
(:func:`trainer.rollout.vllm.reload_calls`), here as `AsyncLLM.collective_rpc` utility calls
into the engine-core process. What crosses that boundary is vLLM's msgpack
(`vllm/v1/serial_utils.py`): a function only as cloudpickle under
`VLLM_ALLOW_INSECURE_SERIALIZATION=1` (`serial_utils.py:220-230`), and a tensor inside the
untyped arguments of a utility call arrives as a plain list (`[dtype, shape, buffer index]`, the
engine core's generic decoder, `vllm/v1/engine/core.py:1843`, has no type to rebuild it from).
So each bucket travels as `(name, dtype, shape, bytes)` and :func:`_load_packed` rebuilds the
tensors on the worker before the in-process engine's :func:`~trainer.rollout.vllm._load_bucket`
loads them; one bucket is in flight at a time. On GPUs this stages every bucket through host
memory (verl ships CUDA IPC handles over ZMQ instead, `vllm_rollout/utils.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from hpcrl.devices import CUDA, HIP
from trainer.agent.base import TokenOutput
from trainer.config.rollout import server_mode
from trainer.rollout.base import SamplingParams, WeightBucket
from trainer.rollout.vllm import (
    SLEEP_LEVEL,
    SLEEP_TAGS,
    _end_reload,
    _load_bucket,
    engine_args,
    engine_env,
    reload_calls,
    rollout_knobs,
    sampling_params,
    token_output,
    vllm_import_error,
)

if TYPE_CHECKING:
    from hpcrl.devices import WorkerDevice
    from trainer.config import Config

__all__ = ["ReplicaMember", "ServerEngine", "VLLMServer", "close_open_engines", "replica_devices", "server_env",
           "server_mode"]

PackedBucket = list[tuple[str, str, list[int], bytes]]


def server_env() -> dict[str, str]:
    """The environment of a replica: :func:`engine_env`'s defaults, the bucket-loading functions
    allowed through vLLM's serializer, and the engine core's multiprocessing on (see
    :meth:`VLLMServer.__init__` for why that one is set only while the engine starts)."""
    env = engine_env()
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    return env


@contextmanager
def _replica_env(devices: Sequence[str] | None = None) -> Iterator[None]:
    """Set :func:`server_env` while the engine starts; restore `VLLM_ENABLE_V1_MULTIPROCESSING`
    after. An in-process engine (:class:`~trainer.rollout.vllm.VLLMRolloutEngine`) sets it to 0
    for the whole process, and the engine core caches vLLM's environment once started
    (`enable_envs_cache`, `vllm/v1/engine/core.py:258`).

    `devices` (a replica over several GPUs, :func:`replica_devices`): the visible-device lists
    (`CUDA_VISIBLE_DEVICES` = `HIP_VISIBLE_DEVICES`, :mod:`hpcrl.devices`'s rule; a
    `ROCR_VISIBLE_DEVICES` filter stays beneath them) name those GPUs while the engine core and
    its workers start, and this process's own list comes back after. Worker `i` takes `cuda:i`
    (vLLM's multiprocessing executor), so the first rank's GPU is the replica's first. The engine
    core is a spawned process, as vLLM spawns where CUDA is already initialised
    (`vllm/utils/system_utils.py`, `_maybe_force_spawn`): it reads the lists afresh."""
    env = server_env()
    lists = {} if devices is None else {var: ",".join(devices) for var in (CUDA, HIP)}
    previous = {key: os.environ.get(key) for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", *lists)}
    for key, value in env.items():
        if key != "VLLM_ENABLE_V1_MULTIPROCESSING":
            os.environ.setdefault(key, value)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", **lists)
    from vllm import envs

    envs.disable_envs_cache()  # an in-process engine built earlier cached the old values
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def replica_devices(group: Any, gpu: WorkerDevice | None) -> list[str] | None:
    """The GPUs of a server-mode replica over the ranks of `group` (the consecutive ranks of a
    tensor-parallel engine, :func:`trainer.parallel.consecutive_cpu_group`): each rank's own GPU
    (`gpu`, Ray's id for it: an entry of the node's visible list), in rank order. None on the CPU
    or without a group. A collective over `group`: every rank of it calls this.

    verl runs such a replica's workers inside the trainer processes themselves (its
    `ExternalZeroMQDistributedExecutor`, the weights handed over by CUDA IPC); here vLLM's own
    multiprocessing executor starts them beside the ranks, one on each rank's GPU, which
    therefore holds two processes' CUDA contexts."""
    import torch.distributed as dist

    if group is None or gpu is None or not torch.cuda.is_available():
        return None
    devices: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(devices, gpu.ray_id, group=group)
    return [str(d) for d in devices]


def _pack(bucket: WeightBucket) -> PackedBucket:
    """A bucket as plain data for vLLM's msgpack: `(name, dtype, shape, raw bytes)`."""
    packed = []
    for name, tensor in bucket:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        packed.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
    return packed


def _load_packed(worker: Any, packed: PackedBucket) -> None:
    """On a vLLM worker: rebuild a packed bucket's tensors and load them (:func:`_load_bucket`)."""
    weights = [(name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape))
               for name, dtype, shape, raw in packed]
    _load_bucket(worker, weights)


class VLLMServer:
    """One server-mode vLLM replica (:class:`TokenServer`); its methods run on one event loop
    (vLLM's output handler is a task of the loop of the first request)."""

    def __init__(self, model_path: str | Path, *, eos_token_ids: list[int], calculate_log_probs: bool = False,
                 pad_token_id: int | None = None, devices: Sequence[str] | None = None, **engine: Any) -> None:
        """`engine`: the knobs of :func:`engine_args`; `pad_token_id` is accepted for
        :func:`rollout_knobs` and unused (turns carry no padding). With `tensor_parallel_size`
        > 1 the replica's workers are vLLM's own processes (its multiprocessing executor), on
        `devices` when given (:func:`replica_devices`)."""
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as err:
            raise vllm_import_error(err) from None
        del pad_token_id
        args = engine_args(model_path, **engine)
        self.eos_token_ids = list(eos_token_ids)
        self.log_probs = calculate_log_probs
        self.max_model_len = int(args["max_model_len"])
        self.tp = int(args["tensor_parallel_size"])
        self.gpu = torch.cuda.is_available()
        self.free_cache = engine.get("free_cache_engine", True)
        self.sleeping: set[str] = set()
        self.weights_discarded = False
        self.in_flight: Counter[str] = Counter()
        if devices is not None and len(devices) != self.tp:
            raise ValueError(f"a replica of tensor_parallel_size={self.tp} was given {len(devices)} GPUs ({devices})")
        if self.tp > 1:  # inside a Ray actor vLLM would pick its Ray executor, which places workers itself
            args["distributed_executor_backend"] = "mp"
        with _replica_env(devices):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any, eos_token_ids: list[int], seed: int = 0,
                    devices: Sequence[str] | None = None) -> VLLMServer:
        """A replica with the in-process engine's knobs for `cfg` (:func:`rollout_knobs`)."""
        return cls(**rollout_knobs(cfg, tokenizer, eos_token_ids, seed), devices=devices)

    @property
    def needs_sync(self) -> bool:
        return self.weights_discarded

    # ------------------------------------------------------------------ TokenServer

    def _request_params(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> Any:
        """vLLM's parameters of one turn; `max_tokens` cut to the room left in the context, as
        verl does (`vllm_async_server.py:457-475`), a prompt with no room refused."""
        from vllm.sampling_params import RequestOutputKind

        if self.weights_discarded:
            raise RuntimeError("the vLLM replica slept at level 2 (its weights were discarded) and no weight "
                               "sync followed; call `sync_weights` before `generate`")
        room = self.max_model_len - len(prompt_ids)
        if room < 1 or max_tokens < 1:
            raise ValueError(
                f"request `{request_id}`: a {len(prompt_ids)}-token prompt leaves {room} of the {self.max_model_len} "
                f"tokens of `max_model_len`, and max_tokens={max_tokens}; both must be >= 1. Fix: raise "
                "`actor_rollout_ref.rollout.max_model_len` or end the trajectory before its context is full")
        sampling = sampling_params(params, min(max_tokens, room), self.eos_token_ids, self.log_probs)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one output per turn, not one per token
        return sampling

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        """One turn. `request_id` may repeat across turns: vLLM keys its requests internally and
        maps this id to each of them (so :meth:`abort` by id reaches them all)."""
        from vllm.inputs import TokensPrompt

        sampling = self._request_params(request_id, prompt_ids, params, max_tokens)
        final = await self._run(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), sampling)
        return token_output(final.outputs[0], self.eos_token_ids, self.log_probs)

    async def _run(self, request_id: str, prompt: Any, sampling: Any) -> Any:
        """vLLM's `AsyncLLM.generate` loop (`async_llm.py:743-823`), with the request counted in
        flight only once vLLM has it (`add_request` returned): an :meth:`abort` then always
        reaches it (counted earlier, an abort could pass before the request and miss it)."""
        from vllm.outputs import STREAM_FINISHED

        queue = await self.engine.add_request(request_id, prompt, sampling)
        self.in_flight[request_id] += 1
        final = None
        try:
            while final is None or not final.finished:
                out = queue.get_nowait() or await queue.get()
                if out is STREAM_FINISHED:
                    break
                final = out
        except asyncio.CancelledError:  # the caller gave up: vLLM stops the request, as in its loop
            await self.engine.abort(queue.request_id, internal=True)
            raise
        finally:
            self.in_flight[request_id] -= 1
            if not self.in_flight[request_id]:
                del self.in_flight[request_id]
            queue.close()
        if final is None:
            raise RuntimeError(f"request `{request_id}`: vLLM ended it without an output")
        return final

    # ------------------------------------------------------------------ control

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort the requests of `request_ids` (all in flight by default): each ends with
        `finish_reason="abort"` and the tokens it had (vLLM's `AsyncLLM.abort` with external
        ids produces the final abort output, `output_processor.py:552-600`). Returns the ids.
        A request whose `generate` has not reached vLLM yet is not among them: :meth:`pause`
        stops those too."""
        ids = sorted(self.in_flight) if request_ids is None else [i for i in request_ids if i in self.in_flight]
        if ids:
            await self.engine.abort(ids)
        return ids

    async def pause(self, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling: new requests wait until :meth:`resume`. `mode` says what becomes of
        those in flight (vLLM's `AsyncLLM.pause_generation`, `async_llm.py:952`): aborted, run
        to their end first, or frozen and resumed later."""
        await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def is_paused(self) -> bool:
        return await self.engine.is_paused()

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def sleep(self, level: int = SLEEP_LEVEL) -> None:
        """Free the KV cache, and at level 2 discard the weights, between rollouts when
        `rollout.free_cache_engine` asks for it (vLLM sleeps only on GPUs)."""
        if sleeps(self.gpu, self.free_cache) and not self.sleeping:
            await self.engine.sleep(level=level)
            self.sleeping = set(SLEEP_TAGS)
            self.weights_discarded = level >= 2

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        wanted = [t for t in (tags or SLEEP_TAGS) if t in self.sleeping]
        if wanted:
            await self.engine.wake_up(tags=wanted)
            self.sleeping -= set(wanted)

    async def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Stream the actor's weights (HF names) into the replica bucket by bucket, then drop
        the prefix cache computed with the old ones. Pause first (:meth:`pause`) when requests
        may be running: the reload swaps the layers' tensors under them."""
        try:
            for fn, args in reload_calls(buckets, _load_packed, _pack):
                await self.engine.collective_rpc(fn, args=args)
        finally:
            await self.engine.collective_rpc(_end_reload)
        self.weights_discarded = False
        await self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine core (and its workers) down now. Call it from the replica's event
        loop, or with that loop stopped (not from another thread while it runs): vLLM closes its
        sockets by a callback on that loop when called from outside it
        (`vllm/v1/engine/core_client.py:541-545`), which is run here; a loop that never runs
        again would leave them open, and their ZMQ context then blocks the process when it is
        garbage-collected."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        handler = getattr(engine, "output_handler", None)
        loop = handler.get_loop() if handler is not None else None
        engine.shutdown()  # vLLM's executor removes its workers' shared memory (none is left on the CPU)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(asyncio.sleep(0))


def sleeps(gpu: bool, free_cache: bool) -> bool:
    """Whether a replica sleeps between rollouts: vLLM sleeps only on GPUs, and only when
    `rollout.free_cache_engine` asks for it."""
    return gpu and free_cache


class ReplicaMember:
    """A later rank of a server-mode replica over `tensor_model_parallel_size` ranks. The
    replica's worker on this rank's GPU is vLLM's process, started and driven by the first rank
    (its :class:`ServerEngine`, which runs every trajectory of the engine's prompts), so this
    rank runs no loops. It takes part in the weight sync, whose gathers are collectives of every
    rank, and drops the buckets; and it mirrors the first rank's sleep, so that both see a
    replica whose weights were discarded and sync at the same points."""

    collective = False
    """Its first rank's replica is the engine; this rank makes no engine calls."""

    def __init__(self, free_cache: bool) -> None:
        self.free_cache = free_cache
        self.gpu = torch.cuda.is_available()
        self.weights_discarded = False

    @property
    def needs_sync(self) -> bool:
        return self.weights_discarded

    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        for _ in buckets:  # each bucket is gathered on every rank; the first rank's replica loads it
            pass
        self.weights_discarded = False

    def sleep(self) -> None:
        """As the first rank's :meth:`VLLMServer.sleep` at level :data:`SLEEP_LEVEL`."""
        if sleeps(self.gpu, self.free_cache):
            self.weights_discarded = self.weights_discarded or SLEEP_LEVEL >= 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        del tags


class ServerEngine:
    """A :class:`VLLMServer` behind the worker's synchronous engine calls (`rollout.mode=async`):
    one event loop of its own, kept for the replica's life, runs every call (vLLM's output
    handler stays a task of that loop), and the agent loops run on it too (:meth:`run`). Every
    row then goes through its agent loop, served as it comes (no turn-synchronous batches).

    Sampling draws from the engine core's generator, seeded once when the replica starts (verl
    sends no seed per request either): a resumed run samples other tokens than an unbroken one
    would, from the same distribution."""

    collective = False
    """A replica is one engine of its own: no other rank joins its calls."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        # a replica left open blocks the interpreter's exit (its ZMQ context waits on sockets that
        # only its loop closes, see `VLLMServer.close`): held here and closed at exit
        # (`close_open_engines`) if nothing did before
        _open_engines.add(self)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any, eos_token_ids: list[int], seed: int = 0,
                    devices: Sequence[str] | None = None) -> ServerEngine:
        return cls(VLLMServer.from_config(cfg, tokenizer, eos_token_ids, seed, devices))

    def run(self, work: Any) -> Any:
        """Run the coroutine `work` on the replica's loop and return its result."""
        return self.loop.run_until_complete(work)

    @property
    def needs_sync(self) -> bool:
        return self.server.needs_sync

    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        self.run(self.server.sync_weights(buckets))

    def sleep(self) -> None:
        self.run(self.server.sleep())

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.run(self.server.wake_up(tags))

    def close(self) -> None:
        """Shut the replica down (idempotent)."""
        if not self.loop.is_closed():
            self.server.close()
            self.loop.close()
        _open_engines.discard(self)


_open_engines: set[ServerEngine] = set()
"""The replicas of this process not closed yet (held, so that none is collected unclosed)."""


def close_open_engines() -> int:
    """Close every replica of this process that is still open, as the exit would; return how many.
    The tests call it after each test: a replica a test left open (a driver it kept) would
    otherwise hold its engine core's process and memory to the session's end, and close at exit,
    when vLLM's shutdown logging finds pytest's output streams closed."""
    engines = list(_open_engines)
    for engine in engines:
        engine.close()
    return len(engines)


atexit.register(close_open_engines)
