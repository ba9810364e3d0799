"""The Ray backend of the worker-group interface (:mod:`trainer.workers.group`): connecting,
placing worker groups, calling them.

- :func:`connect` joins the cluster named by ``RAY_ADDRESS`` (set by the node agent; never
  ``auto``, which may find another job's cluster) or, without it, starts a private local one.
- :func:`make_placement_group` reserves one bundle per GPU (per CPU slot on a cluster without
  GPUs): ``trainer.nnodes`` nodes, found with a ``STRICT_SPREAD`` reservation of whole nodes, each
  then holding one placement group of ``n_gpus_per_node`` one-GPU bundles pinned to it. Rank r
  lives in bundle ``r % n_gpus_per_node`` of node ``r // n_gpus_per_node``, so the consecutive
  ranks of a tensor-parallel engine share a node (on GPUs its size must divide
  ``n_gpus_per_node``; a CPU cluster's gloo engine may span nodes).
- :func:`start_colocated` starts one process per rank hosting every role (actor + reference +
  rollout, and the critic when there is one: verl's colocated worker), asking Ray for a whole
  GPU: no two processes share a GPU, as fractions would make them. Each role is seen as its own
  :class:`RayWorkerGroup`.
- :class:`RayWorkerGroup` runs a method of one role on every rank. A rank
  that raises or whose process dies ends the call at once with :class:`WorkerFailure`, naming
  the group, rank, node and process; a rank killed for memory is named so, with its figures
  (:mod:`trainer.workers.memory_death`, from each rank's own samples:
  :mod:`trainer.workers.memory_samples`).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import flight_recorder as FR
from trainer.config import Config, ConfigError
from trainer.config.trainer import run_dir_of
from trainer.watchdog import Bounds, call_key, diagnose, register_stack_dump
from trainer.watchdog import where as where_now
from trainer.workers import gpu_oom
from trainer.workers.group import WorkerFailure, WorkerGroup
from trainer.workers.memory_death import death_details, describe, find_death, last_seen
from trainer.workers.memory_samples import MEMORY_DIR, RssSampler, write_plan
from trainer.workers.on_node import run_on_nodes

__all__ = ["ColocatedWorker", "RayWorkerGroup", "WorkerSlot", "connect", "make_placement_group", "make_pools",
           "start_colocated"]

PLACEMENT_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class WorkerSlot:
    """Where the ranks live."""

    placement_groups: tuple[Any, ...]
    """One Ray placement group per node, each of `per_node` bundles of one GPU (or one CPU)."""
    per_node: int
    """Ranks per node (`trainer.n_gpus_per_node`)."""
    use_gpu: bool
    """Each rank gets a whole GPU (else one CPU)."""

    def place(self, rank: int) -> tuple[Any, int]:
        """(placement group, bundle index) of `rank`."""
        return self.placement_groups[rank // self.per_node], rank % self.per_node


def connect(world_size: int) -> str:
    """Connect to `RAY_ADDRESS`, or start a private local cluster when it is not set."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address == "auto":
        raise ConnectionError(
            "`RAY_ADDRESS=auto` may attach to another job's Ray cluster; set it to the head's "
            "`host:port` (`hpcrl submit` does), or unset it to start a private local cluster")
    if address:
        with _sigterm_kept():
            ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
        return address
    # Workers of the local cluster import this checkout's `trainer` package.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    private_token_auth()
    with _sigterm_kept():
        ray.init(address="local", num_cpus=max(2, world_size), include_dashboard=False,
                 log_to_driver=True, logging_level=logging.WARNING)
    return "local"


@contextmanager
def _sigterm_kept() -> Iterator[None]:
    """`ray.init` replaces the process's SIGTERM handler (with one that exits at once; its core
    worker's crash handler aborts with status 134): put back the one installed before
    (`trainer.stop`: a SIGTERM asks for a checkpoint and a stop). Slurm sends SIGTERM to every
    process of the job when it is cancelled, requeued or preempted."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


def private_token_auth() -> None:
    """Token auth for a private local cluster, with a token of its own in a private temporary
    file. Left to itself, Ray (>= 2.60) writes `~/.ray/auth_token` for a new local cluster, and
    from then on every `ray start --head` of that user with `RAY_AUTH_MODE` unset turns token auth
    on: one local run would change how the user's other Ray clusters behave. A mode the user set
    (`RAY_AUTH_MODE`) is kept as it is."""
    global _private_token
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if _private_token is None:  # one per process: Ray's token loader caches what it read first
        folder = Path(tempfile.mkdtemp(prefix="hpcrl-ray-auth-"))  # mode 0700
        _private_token = folder / "token"
        _private_token.write_text(secrets.token_hex(32))
        _private_token.chmod(0o600)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(_private_token)
    try:  # Ray caches its configuration and token when imported: make it read them again
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # a Ray without token auth: nothing cached
        pass


_private_token: Path | None = None


def make_placement_group(nnodes: int, per_node: int, tp: int = 1) -> WorkerSlot:
    """`nnodes` distinct nodes, each with one placement group of `per_node` one-GPU bundles
    (one-CPU bundles when the cluster has no GPU). On GPUs `tp` (the rollout's tensor-parallel
    size) must divide `per_node`, so that no engine spans two nodes."""
    return make_pools([(nnodes, per_node)], tp)[0]


def make_pools(pools: Sequence[tuple[int, int]], tp: int = 1) -> list[WorkerSlot]:
    """One :class:`WorkerSlot` per pool of `(nnodes, per_node)`, in order (the trainer's first,
    then the rollout pool's: verl's `trainer_pool` and `rollout_pool`). Where the job has a node
    for each pool's each node (`HPCRL_NUM_NODES`, else the cluster's live nodes), every pool gets
    nodes of its own: one reservation of whole nodes for all pools at once (`STRICT_SPREAD`: no
    two on one node), split among them. With fewer (one machine with 8 GPUs: 4 to train, 4 to
    generate) each pool is reserved apart and pools may share a node, as verl's resource pools
    may. `tp` applies to the first pool (the colocated engines)."""
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    per_node0 = pools[0][1]
    if use_gpu and per_node0 % tp:  # a CPU cluster's gloo engine may span nodes (the lab's seeds)
        raise ConfigError(
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` does not divide "
            f"`trainer.n_gpus_per_node={per_node0}`: a tensor-parallel engine would span two nodes. "
            "Fix: make the tensor-parallel size a divisor of the GPUs per node")
    unit = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    total = sum(nnodes for nnodes, _ in pools)
    known = os.environ.get("HPCRL_NUM_NODES", "").strip()
    have = int(known) if known.isdigit() else sum(1 for n in ray.nodes() if n.get("Alive"))
    apart = [list(pools)] if total <= have or len(pools) == 1 else [[p] for p in pools]
    nodes: list[str] = []
    for part in apart:  # each reservation: whole nodes, one per bundle
        wholes = [{k: v * per_node for k, v in unit.items()} for nnodes, per_node in part for _ in range(nnodes)]
        strategy = "STRICT_SPREAD" if len(wholes) > 1 else "PACK"
        reserve = placement_group([dict(w) for w in wholes], strategy=strategy)
        shapes = " + ".join(f"{nnodes} x {per_node}" for nnodes, per_node in part)
        _wait_placed(reserve, f"{len(wholes)} node bundle(s) ({shapes} {'GPUs' if use_gpu else 'CPUs'}; {strategy}: "
                     "one per node)")
        nodes += [placement_group_table(reserve)["bundles_to_node_id"][i] for i in range(len(wholes))]
        remove_placement_group(reserve)
    slots, first = [], 0
    for nnodes, per_node in pools:
        groups = tuple(placement_group([dict(unit) for _ in range(per_node)], strategy="STRICT_PACK",
                                       bundle_label_selector=[{"ray.io/node-id": node}] * per_node)
                       for node in nodes[first:first + nnodes])
        for node, pg in zip(nodes[first:first + nnodes], groups, strict=True):
            _wait_placed(pg, f"{per_node} bundle(s) of {unit} on node {node[:12]}")
        slots.append(WorkerSlot(placement_groups=groups, per_node=per_node, use_gpu=use_gpu))
        first += nnodes
    return slots


def _wait_placed(pg: Any, what: str) -> None:
    import ray

    ready = pg.ready()
    # started by hpcrl with the head alone, the nodes may still be joining: the agent's own
    # join timeout (naming the missing nodes) ends the job before this one does
    timeout = max(PLACEMENT_TIMEOUT_S, float(os.environ.get("HPCRL_JOIN_TIMEOUT_S") or 0) + 30)
    done, _ = ray.wait([ready], timeout=timeout)
    if not done:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        have = [f"{n.get('NodeManagerHostname')}: {n.get('Resources', {})}" for n in alive]
        raise WorkerFailure(
            f"could not place {what} within {timeout:.0f} s; the cluster has {len(alive)} "
            f"node(s): {'; '.join(have)}. Fix: make `trainer.nnodes` at most the number of nodes "
            "and `trainer.n_gpus_per_node` at most the GPUs (or CPUs) of each node")


def ignore_sigterm() -> bool:
    """In a Ray actor's process: ignore SIGTERM from now on. Slurm sends it to every process of a
    job it cancels, requeues or preempts, and Ray's worker exits on it; the agent starts Ray with
    SIGTERM blocked, but a library thread that unblocks it (seen with vLLM's CPU engine) would
    take it. The driver asks for the checkpoint; the actor ends with the job (SIGKILL). False
    where it cannot (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return True


class ColocatedWorker:
    """One process per rank hosting one worker of each role (verl's colocated worker): the
    roles share the process, its GPU and its torch.distributed group, and run one call at a
    time."""

    def __init__(self, roles: dict[str, type], cfg: Config, rank: int, world_size: int,
                 total_steps: int, stacks: str | None = None, samples: str | None = None,
                 traces: str | None = None) -> None:
        self.ignores_sigterm = ignore_sigterm()  # before any role starts a thread
        if samples:  # its memory, for the driver to read should it die (`trainer.workers.memory_samples`)
            RssSampler(Path(samples), rank).start()
        if stacks:  # the watchdog's stack dumps (`trainer.watchdog`)
            register_stack_dump(Path(stacks) / f"rank_{rank}.txt")
        if traces:  # the flight recorder, before any group is made; variables a site sets are kept
            for key, value in FR.recorder_env(Path(traces)).items():
                os.environ.setdefault(key, value)
            FR.start_listener(Path(traces), rank)
        self.workers = {name: cls(cfg, rank, world_size, total_steps) for name, cls in roles.items()}

    def call(self, role: str, method: str, *args: Any) -> Any:
        return getattr(self.workers[role], method)(*args)


class ControlledWorker(ColocatedWorker):
    """A :class:`ColocatedWorker` that also answers short calls beside the one it is running,
    one at a time, on a thread of their own (:meth:`control`: a partial rollout's abort). Its
    calls then run on a thread of Ray's, not the process's main thread."""

    def control(self, role: str, method: str, *args: Any) -> Any:
        return getattr(self.workers[role], method)(*args)


def _controlled() -> Any:
    """:class:`ControlledWorker` as a Ray actor class, `control` in a concurrency group of its own."""
    import ray

    class Controlled(ControlledWorker):
        @ray.method(concurrency_group="control")  # type: ignore[misc]
        def control(self, role: str, method: str, *args: Any) -> Any:
            return super().control(role, method, *args)

    Controlled.__name__ = Controlled.__qualname__ = "ControlledWorker"
    return ray.remote(concurrency_groups={"control": 1})(Controlled)  # type: ignore[call-overload]


def start_colocated(roles: dict[str, type], cfg: Config, total_steps: int, *, slot: WorkerSlot,
                    world_size: int, stacks: Path | None = None, samples: Path | None = None,
                    traces: Path | None = None, control: bool = False) -> dict[str, RayWorkerGroup]:
    """One :class:`ColocatedWorker` per rank in its bundle (a whole GPU, or one CPU), and one
    worker group per role over them. `samples`: the folder of the ranks' memory samples
    (:mod:`trainer.workers.memory_samples`); by default `memory/` in the run directory, with the
    memory plan's host figure written there first. `stacks` and `traces`: the folders of the
    watchdog's stack dumps and flight-recorder dumps (:mod:`trainer.watchdog`). `control`: the
    ranks answer :meth:`RayWorkerGroup.signal_rank` (a :class:`ControlledWorker` each)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if samples is None and cfg is not None:
        samples = run_dir_of(cfg) / MEMORY_DIR
        write_plan(samples, cfg, slot.use_gpu)

    remote: Any = _controlled() if control else ray.remote(ColocatedWorker)
    actors = []
    for rank in range(world_size):
        pg, bundle = slot.place(rank)
        actors.append(remote.options(
            num_cpus=0 if slot.use_gpu else 1, num_gpus=1 if slot.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            max_restarts=0, max_task_retries=0,
        ).remote(roles, cfg, rank, world_size, total_steps, str(stacks) if stacks else None,
                 str(samples) if samples else None, str(traces) if traces else None))
    return {name: RayWorkerGroup(name, actors, stacks, samples, traces) for name in roles}


def _rank_failure(where: str, err: BaseException, node: Mapping[str, Any], samples: Path | None,
                  after: str, device_plan: Callable[[float], Any] | None = None) -> WorkerFailure:
    """The run's error for rank `node` (its `node_info()`) failing with `err`: killed for memory
    (Ray's memory monitor, the kernel's OOM killer: :func:`~trainer.workers.memory_death.find_death`)
    or any other failure; a rank that died also with its last memory sample. `where`: the rank
    in words; `after`: the rest of the sentence."""
    import ray

    line = gpu_oom.oom_line(str(err)) if isinstance(err, ray.exceptions.RayTaskError) else None
    if line is not None:
        phase = where_now().phase
        return WorkerFailure(f"{where} {gpu_oom.describe(line, phase, _planned_phase(device_plan, line, phase))} "
                             f"{after}", kind="gpu_oom", details={"phase": phase, "error": line})
    died = isinstance(err, ray.exceptions.RayActorError) and not getattr(err, "actor_init_failed", False)
    death = (find_death(str(err), died, node, samples, remote=_on_rank_node)
             if isinstance(err, ray.exceptions.RayError) else None)
    if death is not None:
        return WorkerFailure(f"{where} {describe(death, time.time())} {after}", kind="oom",
                             details=death_details(death, node))
    seen = f"; {last_seen(node, samples, time.time())}" if died else ""
    return WorkerFailure(f"{where} {_describe_error(err)}{seen} {after}")


def _planned_phase(device_plan: Callable[[float], Any] | None, line: str, phase: str | None) -> Any:
    """The memory plan's phase for `phase` on the device torch's sentence `line` names, made now;
    or why there is none."""
    gib = gpu_oom.capacity_gib(line)
    if device_plan is None or gib is None:
        return "no plan for this run" if device_plan is None else "torch named no device size"
    try:
        return gpu_oom.plan_phase(device_plan(gib), phase)
    except Exception as err:  # noqa: BLE001 - the failure is reported whatever the plan does
        return f"it could not be made: {type(err).__name__}: {err}"


def _on_rank_node(ip: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the node at `ip` (a rank's), None when that node does not answer within 30 s."""
    return run_on_nodes(fn, {ip: args}, timeout=30.0).get(ip)


def _describe_error(err: BaseException) -> str:
    """What happened to a rank, in words."""
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.as_instanceof_cause()
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        return "raised " + (lines[-1] if lines else type(cause).__name__)
    if isinstance(err, ray.exceptions.RayActorError) and getattr(err, "actor_init_failed", False):
        # the worker's constructor raised (Ray keeps the cause's text in `error_msg`)
        lines = [line for line in str(getattr(err, "error_msg", "")).strip().splitlines() if line.strip()]
        return "failed to start: " + (lines[-1].strip() if lines else type(err).__name__)
    if isinstance(err, ray.exceptions.RayActorError):
        return f"died ({type(err).__name__}: the worker process or its node is gone)"
    return f"failed ({type(err).__name__}: {err})"


KILL_WAIT_S = 30.0
"""How long :meth:`RayWorkerGroup.kill` waits for Ray to refuse calls to each killed rank."""


def _refused(actor: Any, wait_s: float) -> bool:
    """Whether Ray refuses a call to `actor` (it is dead) within `wait_s`; False when the actor
    answered, or did not answer in time (a rank still blocked). Any error of Ray's is a refusal:
    a rank its memory monitor killed refuses with `OutOfMemoryError`, not `RayActorError`."""
    import ray

    probe = actor.__ray_ready__.remote()
    done, _ = ray.wait([probe], timeout=max(wait_s, 0.0))
    if not done:
        return False
    try:
        ray.get(probe)
    except ray.exceptions.RayError:
        return True
    return False


def _dead_peer(pending: list[Any], rank_of: dict[Any, int], wait_s: float = 5.0
               ) -> tuple[int, BaseException] | None:
    """The first rank among `pending` whose actor died, looking for up to `wait_s` seconds."""
    import ray

    if not pending:
        return None
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            return rank_of[ref], err
        except (ray.exceptions.RayError, OSError):
            continue
    return None


class RayWorkerGroup(WorkerGroup):
    """One role (`name`) of the colocated workers, one Ray actor per rank."""

    def __init__(self, name: str, actors: list[Any], stacks: Path | None = None,
                 samples: Path | None = None, traces: Path | None = None) -> None:
        self.name, self.world_size, self.actors = name, len(actors), actors
        self.stacks, self.samples, self.traces = stacks, samples, traces
        self.started = time.time()
        """The ranks' start: the watchdog reads the nodes' kernel logs from then on."""
        self.watchdog: Bounds | None = None
        """Set by the driver (`trainer.watchdog`): each call is timed and bounded."""
        self.device_plan: Callable[[float], Any] | None = None
        """Set by the driver: the memory plan for a device of so many GiB, made when a rank runs out."""
        self.nodes: list[dict[str, Any]] = [{"rank": r} for r in range(self.world_size)]
        self.nodes = self.run("node_info")

    def run_each(self, method: str, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        """`method(*per_rank[r])` on rank r."""
        refs = [a.call.remote(self.name, method, *args) for a, args in zip(self.actors, per_rank, strict=True)]
        return self._gather(method, refs)

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        """`method(*args)` on rank `rank` alone."""
        ref = self.actors[rank].call.remote(self.name, method, *args)
        return self._gather(method, [ref], ranks=[rank])[0]

    def signal_rank(self, rank: int, method: str, *args: Any) -> Any:
        """`method(*args)` on rank `rank` beside its running call, on its control channel (ranks
        started with `start_colocated(..., control=True)`)."""
        actor = self.actors[rank]
        if not hasattr(actor, "control"):
            raise RuntimeError(f"{self.where(rank)} has no control channel for `{method}`: start its group "
                               "with `start_colocated(..., control=True)`")
        return self._gather(method, [actor.control.remote(self.name, method, *args)], ranks=[rank])[0]

    def _gather(self, method: str, refs: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """Wait for all `refs`; the first failure raises at once, and every rank of the group is
        killed first: the others may be blocked in a collective the failed rank will never join
        (vLLM's data-parallel engines all-reduce at every engine step; a tensor-parallel engine's
        ranks, FSDP's gathers), and would otherwise hold their GPUs and host memory until the
        group's timeout (`actor_rollout_ref.nccl_timeout`, 600 s: NCCL's watchdog aborts a
        blocked collective only then). A failure ends the run (`WorkerFailure`), so no group
        outlives it; Ray's kill is a signal, which a process blocked in NCCL or gloo receives."""
        import ray

        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: r for ref, r in zip(refs, ranks, strict=True)}
        pending, results = list(refs), {}
        began, key = time.monotonic(), call_key(self.name, method)
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=self.watchdog.poll_s if self.watchdog else None)
            if not done:  # only with a watchdog: has the call run past its bound?
                self._check_progress(method, key, began, [rank_of[r] for r in pending])
                continue
            ref = done[0]
            try:
                results[ref] = ray.get(ref)
            except (ray.exceptions.RayError, OSError) as err:
                rank, cause = rank_of[ref], err
                dead = None if isinstance(err, ray.exceptions.RayActorError) else _dead_peer(pending, rank_of)
                self.kill()  # the peers may be blocked in a collective the failed rank left
                if dead is None:
                    raise _rank_failure(self.where(rank), err, self.nodes[rank], self.samples,
                                        f"during `{method}`", self.device_plan) from err
                # a peer's death makes the survivors' collectives fail: report the death first
                dead_rank, cause = dead
                raise _rank_failure(self.where(dead_rank), cause, self.nodes[dead_rank], self.samples,
                                    f"during `{method}` (then rank {rank} {_describe_error(err)})") from cause
        if self.watchdog is not None:
            self.watchdog.record(key, time.monotonic() - began)
        return [results[r] for r in refs]

    def _check_progress(self, method: str, key: str, began: float, stuck: list[int]) -> None:
        """Past the call's bound: dump every rank's stack, name the ranks that did not answer
        (:func:`trainer.watchdog.diagnose`), end the group and the run."""
        assert self.watchdog is not None
        elapsed = time.monotonic() - began
        if elapsed <= self.watchdog.bound(key):
            return
        summary, details = diagnose(self.nodes, stuck, self.name, method, elapsed, self.watchdog, self.stacks,
                                    self.traces, self.started)
        print(f"trainer: watchdog: {summary}", flush=True)
        self.kill()  # its ranks may hold GPUs in a collective that never ends
        raise WorkerFailure(summary, kind="hang", details=details)

    def kill(self, wait_s: float = KILL_WAIT_S) -> None:
        """Kill every rank and wait, up to `wait_s`, until Ray refuses calls to each: `ray.kill`
        only asks, and a rank whose blocked collective its peer's death just ended would
        otherwise still answer the next call (and hold its GPU) for a moment. A rank still
        not refused at `wait_s` (answering, or blocked) is named on stdout, not waited for: the
        run is ending."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + wait_s
        for rank, actor in enumerate(self.actors):
            while not _refused(actor, deadline - time.monotonic()):
                if time.monotonic() >= deadline:
                    print(f"trainer: {self.where(rank)} was still not refused by Ray {wait_s:.0f} s after it was "
                          "killed (answering, or blocked)", flush=True)
                    break
                time.sleep(0.1)

