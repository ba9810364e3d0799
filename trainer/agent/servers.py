"""Token servers for the agent loops (:class:`trainer.agent.base.TokenServer`).

- :class:`BatchedServer`: turns of concurrent trajectories sent as one batch to an in-process,
  synchronous engine (:meth:`VLLMRolloutEngine.generate_tokens`,
  :meth:`HFRolloutEngine.generate_tokens`) once every live trajectory waits for a turn.
- :class:`ServerPool`: verl's `AsyncLLMServerManager` (`verl/experimental/agent_loop/
  agent_loop.py:57-122`) over several servers (e.g. server-mode vLLM replicas,
  :class:`trainer.rollout.vllm_server.VLLMServer`): least-loaded choice of a server for a new
  trajectory, and every later turn of that trajectory on the same server (its prefix cache holds
  the conversation so far).
- :class:`EngineLeader` and :func:`follow_leader`: an in-process engine whose ranks compute
  together (tensor parallelism): the first rank runs the agent loops and sends each engine call
  to the others, which make the same call.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainer.agent.base import TokenOutput, TokenServer

if TYPE_CHECKING:
    from trainer.rollout.base import SamplingParams

__all__ = ["BatchedServer", "EngineLeader", "ServerPool", "TokenEngine", "follow_leader"]


class TokenEngine(Protocol):
    """An in-process engine that samples one response per prompt in one synchronous call."""

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int]
                        ) -> list[TokenOutput]: ...


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    future: asyncio.Future[TokenOutput]


@dataclass
class BatchStats:
    """What a :class:`BatchedServer` did: engine calls, requests, and the requests per call."""

    flushes: int = 0
    engine_calls: int = 0
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)


class BatchedServer:
    """A :class:`TokenServer` over an in-process engine, batched turn by turn.

    Each trajectory is bracketed by :meth:`open` / :meth:`close` (or ``with server.trajectory():``).
    A turn's request waits until every open trajectory waits for a turn (or has closed); then all
    waiting requests go to the engine together, one `generate_tokens` call per distinct
    :class:`SamplingParams` (each request keeps its own `max_tokens`). A trajectory busy with a
    tool call therefore holds the batch back: the batch of every turn is as large as it can be,
    which is what a synchronous engine needs, at the price of waiting for the slowest tool.
    A manager that starts its trajectories one by one should :meth:`open` them all before the
    first one runs, so that the first batch holds every trajectory.

    The engine runs on the event loop's thread, blocking it while it generates: every open
    trajectory is waiting then, and the engines it wraps (vLLM's `LLM`, transformers) are not
    thread-safe. An engine error fails every request of that engine call, and only those.
    """

    def __init__(self, engine: TokenEngine) -> None:
        self.engine = engine
        self.live = 0
        self.pending: list[_Pending] = []
        self.stats = BatchStats()
        self._scheduled = False

    # ------------------------------------------------------------------ trajectories

    def open(self) -> None:
        """A trajectory starts: flushes now wait for its turn too."""
        self.live += 1

    def close(self) -> None:
        """A trajectory ended (finished or failed): the others no longer wait for it."""
        if self.live == 0:
            raise RuntimeError("BatchedServer.close() without a matching open(): every trajectory "
                               "must call open() once before its first turn and close() once after its last")
        self.live -= 1
        self._maybe_flush()

    @contextmanager
    def trajectory(self) -> Iterator[BatchedServer]:
        """``with server.trajectory():`` around one trajectory's run (opens, and always closes)."""
        self.open()
        try:
            yield self
        finally:
            self.close()

    # ------------------------------------------------------------------ TokenServer

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        if self.live == 0:
            raise RuntimeError(f"request `{request_id}`: no trajectory is open on this BatchedServer. Fix: run "
                               "each trajectory inside `with server.trajectory():` (or open()/close())")
        if max_tokens < 1 or not prompt_ids:
            raise ValueError(f"request `{request_id}`: needs a non-empty prompt and `max_tokens` >= 1, "
                             f"received {len(prompt_ids)} prompt tokens and max_tokens={max_tokens}")
        entry = _Pending(list(prompt_ids), params, int(max_tokens), asyncio.get_running_loop().create_future())
        self.pending.append(entry)
        self._maybe_flush()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry in self.pending:  # cancelled before its batch ran: it leaves the batch
                self.pending.remove(entry)
            raise

    def _maybe_flush(self) -> None:
        """Schedule a flush when every open trajectory waits. It runs on the next turn of the
        event loop and checks again: trajectories started together (`asyncio.gather`) each open
        on their task's first step, which the loop runs before the flush."""
        if self.pending and len(self.pending) >= self.live and not self._scheduled:
            self._scheduled = True
            self.pending[0].future.get_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        self.stats.flushes += 1
        self.stats.requests += len(batch)
        self.stats.batch_sizes.append(len(batch))
        groups: dict[SamplingParams, list[_Pending]] = {}
        for entry in batch:
            groups.setdefault(entry.params, []).append(entry)
        for params, entries in groups.items():
            self._run(params, entries)

    def _run(self, params: SamplingParams, entries: list[_Pending]) -> None:
        """One engine call for `entries`; its outputs (or its error) go to their futures."""
        self.stats.engine_calls += 1
        try:
            outputs = self.engine.generate_tokens([e.prompt_ids for e in entries], params,
                                                  [e.max_tokens for e in entries])
            if len(outputs) != len(entries):
                raise RuntimeError(f"the engine returned {len(outputs)} outputs for {len(entries)} prompts")
        except Exception as err:  # every request of this call fails with the engine's error
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(err)
            return
        for entry, out in zip(entries, outputs, strict=True):
            if not entry.future.done():
                entry.future.set_result(out)


def _broadcast(group: Any, message: Any = None) -> Any:
    """`message` from the first rank of `group` (a gloo group, :func:`trainer.parallel.consecutive_cpu_group`)
    to its other ranks; what the first rank sent, on every rank."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


class EngineLeader:
    """The :class:`TokenEngine` of the first rank of an engine whose ranks compute together: vLLM
    over `tensor_model_parallel_size` ranks (its external launcher), or the HF engine's
    tensor-parallel copy. Every rank of such an engine must make the same calls with the same
    requests, or the engine's collectives hang.

    So only this rank runs the agent loops, their tools and interactions, and each of its engine
    calls goes first to the group's other ranks, which make the same call
    (:func:`follow_leader`); their outputs equal this rank's (one engine) and are dropped. The
    requests of every rank are then the same by construction, whatever a tool does (a timeout,
    a sandboxed program that ends otherwise on another node), and a tool with effects runs once.
    verl's agent loops likewise send each request once, to a server that is the whole
    tensor-parallel group. :meth:`release` (at the end of the rollout, also after an error) lets
    the followers go."""

    def __init__(self, engine: TokenEngine, group: Any) -> None:
        self.engine, self.group = engine, group

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int]
                        ) -> list[TokenOutput]:
        _broadcast(self.group, ("generate", prompts, params, max_tokens))
        return self.engine.generate_tokens(prompts, params, max_tokens)

    def release(self) -> None:
        _broadcast(self.group, ("release",))

    @contextmanager
    def leading(self) -> Iterator[EngineLeader]:
        """``with leader.leading():`` around a rollout: the followers are released at its end."""
        try:
            yield self
        finally:
            self.release()


def follow_leader(engine: TokenEngine, group: Any) -> int:
    """A later rank of an engine led by :class:`EngineLeader`: make each engine call the first
    rank makes, until it releases the group; the number of tokens generated. An engine error is
    raised after the release: leaving before it would leave the first rank's broadcast waiting."""
    tokens, error = 0, None
    while True:
        message = _broadcast(group)
        if message[0] == "release":
            break
        _, prompts, params, max_tokens = message
        try:
            tokens += sum(len(o.token_ids) for o in engine.generate_tokens(prompts, params, max_tokens))
        except Exception as err:
            error = error or err
    if error is not None:
        raise error
    return tokens


class _LRU(OrderedDict[str, int]):
    """request id -> server index, at most `size` entries, the least recently used dropped."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def lookup(self, key: str) -> int | None:
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def put(self, key: str, value: int) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class ServerPool:
    """verl's `AsyncLLMServerManager` (`agent_loop.py:57-122`): a :class:`TokenServer` over
    several servers with least-requests load balancing and sticky sessions.

    - A new request id (a trajectory) goes to the server with the fewest requests in flight (a
      heap of `[in flight, index]`, the lowest index on a tie); verl's heap top, `_choose_server`
      at `agent_loop.py:83-92`.
    - Every later turn with that id goes to the same server (an LRU map of at most
      `max_cache_size` ids, verl's `LRUCache(maxsize=10000)` at `agent_loop.py:81`); an id
      dropped from the map is treated as new.
    - Unlike verl, the count is of requests *in flight*: it rises when a turn is sent and falls
      when it returns (or fails). verl adds 1 per new id at `agent_loop.py:89` and never takes
      it back, so its heap balances the number of trajectories ever assigned, not the load.
    - verl sends each turn under a fresh `uuid4` (`agent_loop.py:116`); here the trajectory's id
      goes through, so a server can abort one trajectory by its id (vLLM >= 0.11 maps one
      external id to each of its requests, `vllm/v1/engine/output_processor.py:552-583`).

    :meth:`metrics` gives the per-server counts.
    """

    def __init__(self, servers: Sequence[TokenServer], max_cache_size: int = 10000) -> None:
        if not servers:
            raise ValueError("ServerPool needs at least one server")
        if max_cache_size < 1:
            raise ValueError(f"ServerPool: `max_cache_size` must be >= 1, received {max_cache_size}")
        self.servers = list(servers)
        self.heap: list[list[int]] = [[0, i] for i in range(len(self.servers))]
        self.sessions = _LRU(max_cache_size)
        self.in_flight = [0] * len(self.servers)
        self.requests = [0] * len(self.servers)
        self.trajectories = [0] * len(self.servers)

    def choose(self, request_id: str) -> int:
        """The index of the server for `request_id` (sticky, else the least loaded)."""
        index = self.sessions.lookup(request_id)
        if index is None:
            index = self.heap[0][1]
            self.sessions.put(request_id, index)
            self.trajectories[index] += 1
        return index

    def _add(self, index: int, delta: int) -> None:
        self.in_flight[index] += delta
        for entry in self.heap:
            if entry[1] == index:
                entry[0] = self.in_flight[index]
        heapq.heapify(self.heap)  # a few servers: re-heaping costs less than tracking positions

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        index = self.choose(request_id)
        self._add(index, +1)
        self.requests[index] += 1
        try:
            return await self.servers[index].generate(request_id, prompt_ids, params, max_tokens)
        finally:
            self._add(index, -1)

    def metrics(self) -> dict[str, float]:
        """Per server `i`: `server_pool/in_flight/i`, `server_pool/requests/i` (turns sent) and
        `server_pool/trajectories/i` (request ids assigned)."""
        out: dict[str, float] = {}
        for name, counts in (("in_flight", self.in_flight), ("requests", self.requests),
                             ("trajectories", self.trajectories)):
            out.update({f"server_pool/{name}/{i}": float(c) for i, c in enumerate(counts)})
        return out
