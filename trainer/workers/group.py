"""One worker-group interface, two backends.

A :class:`WorkerGroup` runs one instance of a worker class per rank and calls a method on every
rank (:meth:`~WorkerGroup.run`, :meth:`~WorkerGroup.run_each`) or on one
(:meth:`~WorkerGroup.run_rank`); the driver sees nothing else. Backends:

- :class:`LocalWorkerGroup`: one rank in the driver's own process, a direct call (the embedded
  default: `trainer.distributed=false`, or one rank);
- :class:`~trainer.workers.ray_group.RayWorkerGroup`: one Ray actor per rank across the nodes.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any

from trainer.config import Config

__all__ = ["LocalWorkerGroup", "RankView", "WorkerFailure", "WorkerGroup", "in_background", "while_alive"]

WATCH_S = 5.0
"""How often :func:`while_alive` pings the idle groups: a dead rank is noticed within this and
Ray's own notice of it (its health checks: 10-15 s for a whole node on the lab)."""


class WorkerFailure(RuntimeError):
    """A worker raised or died, or stopped answering; the message names the group, rank, node and
    process. `kind`: `worker`, `oom` (killed for memory), `gpu_oom` (out of GPU memory) or `hang` (the watchdog's); `details`:
    what the diagnosis records beside the message."""

    def __init__(self, message: str, kind: str = "worker", details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.kind, self.details = kind, details or {}


class WorkerGroup:
    """The ranks of one worker class; a backend implements :meth:`run_each` and :meth:`run_rank`."""

    name: str
    world_size: int
    nodes: list[dict[str, Any]]
    """`node_info()` of each rank (host name, address, pid): where a failure happened."""

    def run(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank; the results in rank order."""
        return self.run_each(method, [args] * self.world_size)

    def run_each(self, method: str, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        """`method(*per_rank[r])` on rank r; the results in rank order."""
        raise NotImplementedError

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        """`method(*args)` on rank `rank` alone."""
        raise NotImplementedError

    def signal_rank(self, rank: int, method: str, *args: Any) -> Any:
        """`method(*args)` on rank `rank` beside the call it is running (a short call that must not
        wait for it: a partial rollout's abort). A backend whose ranks run one call at a time
        answers it on a control channel of its own."""
        raise NotImplementedError(f"worker group `{self.name}` takes no call beside a running one")

    def init_dist(self) -> list[dict[str, Any]]:
        """Let the ranks form their process group (at rank 0's node address and a free port
        there) and build their models; one rank forms none."""
        if self.world_size == 1:
            return self.run("init_dist", None, None)
        master = str(self.nodes[0]["ip"])
        port = self.run_rank(0, "free_port")
        return self.run("init_dist", master, port)

    def where(self, rank: int) -> str:
        node = self.nodes[rank]
        host, ip, pid = node.get("hostname", "?"), node.get("ip", "?"), node.get("pid", "?")
        return f"worker group `{self.name}` rank {rank} on node `{host}` ({ip}, pid {pid})"


class LocalWorkerGroup(WorkerGroup):
    """One rank in this process: a method call is a plain call, a failure the worker's own
    exception."""

    def __init__(self, name: str, cls: type, cfg: Config, total_steps: int) -> None:
        self.name, self.world_size = name, 1
        self.workers: list[Any] = [cls(cfg, 0, 1, total_steps)]
        self.nodes = self.run("node_info")

    def run_each(self, method: str, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        return [getattr(w, method)(*args) for w, args in zip(self.workers, per_rank, strict=True)]

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[rank], method)(*args)

    def signal_rank(self, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[rank], method)(*args)  # from another thread: a plain call too


class RankView(WorkerGroup):
    """Rank `rank` of `group` seen as a group of one: a caller that works group by group (the
    rollout stage) drives one rank alone, while other threads drive the group's other ranks (the
    fully-async rollouter streams to each pool rank on its own). Calls go through `group`, so
    its watchdog and failure handling hold."""

    def __init__(self, group: WorkerGroup, rank: int) -> None:
        self.group, self.rank = group, rank
        self.name, self.world_size = group.name, 1
        self.nodes = [group.nodes[rank]]

    def run_each(self, method: str, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        (args,) = per_rank
        return [self.group.run_rank(self.rank, method, *args)]

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        if rank != 0:
            raise IndexError(f"a view of one rank has rank 0 only, not {rank}")
        return self.group.run_rank(self.rank, method, *args)

    def signal_rank(self, rank: int, method: str, *args: Any) -> Any:
        if rank != 0:
            raise IndexError(f"a view of one rank has rank 0 only, not {rank}")
        return self.group.signal_rank(self.rank, method, *args)

    def where(self, rank: int) -> str:
        return self.group.where(self.rank)


def in_background(name: str, fn: Any, *args: Any) -> Future[Any]:
    """`fn(*args)` in a daemon thread called `name`: a call still in flight when the run stops (a
    generation ahead, at a checkpoint and a requeue; a broadcast whose peer failed) must not keep
    the process from exiting.

    The thread runs in a copy of the caller's context, so that its calls to the ranks keep the
    caller's phase and step (:func:`trainer.watchdog.at`: the watchdog keys and names them by it)."""
    future: Future[Any] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(fn, *args))
        except BaseException as err:  # handed to the caller, which raises it
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future


def while_alive(groups: Sequence[WorkerGroup], fn: Callable[..., Any], *args: Any, every_s: float = WATCH_S) -> Any:
    """`fn(*args)`, a call on other groups (a validation on the rollout pool), while `groups` sit
    idle: each of their ranks is pinged every `every_s` seconds meanwhile, so that one that dies
    ends the run at once, with its group's own failure naming it (:class:`WorkerFailure`), rather
    than minutes later when its group is next called. A group with no ranks elsewhere (one rank in
    this process) is not pinged. On a failure `fn`'s thread is left running: the run is ending."""
    remote = [g for g in groups if not isinstance(g, LocalWorkerGroup)]
    if not remote:
        return fn(*args)
    future = in_background(f"{threading.current_thread().name}-watched", fn, *args)
    while not wait([future], timeout=every_s).done:
        for group in remote:
            group.run("ping")
    return future.result()
