"""A call to the ranks that runs far past its usual time: stacks dumped, the ranks that did not
answer named with their process state, the run ended with the diagnosis.

From the first step on (not while the ranks join and load their models), every call the driver
makes to a Ray worker group (a phase of a step: `generate`, `compute_log_prob`, `update_actor`,
the weight sync, a checkpoint) is timed per phase, group and method (:func:`call_key`: the step's
phase as its timer names it, or `validate`, set by :func:`at`; a validation's rollout is not held
to the training rollout's durations). Its bound (:meth:`Bounds.bound`) is
`trainer.watchdog.multiple` times the median of that call's earlier durations in this run, at
least `trainer.watchdog.min_s`; until the call has `trainer.watchdog.warmup` durations,
`trainer.watchdog.floor_s` (the first steps compile, load and warm caches). Past it, :func:`diagnose`:

- dumps every rank's Python stacks into `<run_dir>/stacks/rank_<r>.txt` (the run directory is
  shared across nodes; a requeued run's ranks append after the earlier ones), on the rank's own
  node (from the driver, or a Ray task pinned to the node): with `py-spy dump` where py-spy is
  installed and may read the process (it reads a stopped or `D`-state rank's stack too, which no
  handler can), else by :data:`STACK_SIGNAL`, which each rank registered with `faulthandler` at
  start (:func:`register_stack_dump`); each rank's `stack_by` in the diagnosis says which;
- reads each rank's process state (`/proc/<pid>/stat`: `T` stopped, `D` in uninterruptible
  I/O, `Z` gone, `R`/`S` running or waiting);
- names the ranks that have not answered while the others have, with node, pid and state, a
  stopped (`T`) or `D`-state one first: the others may only be waiting on it in a collective.

The driver then ends the run with that diagnosis (a :class:`~trainer.workers.group.WorkerFailure`
of kind `hang`, kept in `diagnosis.jsonl` for `hpcrl status`). A rank stopped or in `D` state
points at its node: the diagnosis lists such nodes (`suspect_nodes`), and hpcrl's head agent
requeues the job without them, as after a node loss (:func:`hpcrl.diagnosis.blamed_nodes`); the
rerun resumes from the last checkpoint. Otherwise the run ends with the diagnosis.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STACK_SIGNAL", "Bounds", "Where", "at", "call_key", "diagnose", "inspect", "process_state",
           "register_stack_dump", "suspect_nodes", "where"]

STACK_SIGNAL = int(signal.SIGRTMIN) + 3
"""The signal a rank dumps its threads' stacks on (a real-time signal: nothing else sends it)."""

NAMED = 4
"""Running or waiting ranks named in a summary beyond the stopped and `D`-state ones (all in its details)."""

_STATES = {"R": "running", "S": "sleeping (waiting)", "D": "in uninterruptible I/O (D)", "T": "stopped (T)",
           "t": "stopped by a tracer (t)", "Z": "a zombie (gone)", "X": "dead"}


@dataclass(frozen=True)
class Where:
    """The driver's place in the run: the phase (`gen`, `update_actor`, ..., `validate`) and the step."""

    phase: str | None = None
    step: int | None = None


_WHERE: ContextVar[Where | None] = ContextVar("trainer_watchdog_where", default=None)


@contextmanager
def at(phase: str | None = None, step: int | None = None) -> Iterator[None]:
    """Calls to the ranks made inside are the phase `phase` of step `step` (each kept from the
    enclosing :func:`at` when None): the watchdog keys their durations and names them so."""
    outer = where()
    token = _WHERE.set(Where(phase or outer.phase, outer.step if step is None else step))
    try:
        yield
    finally:
        _WHERE.reset(token)


def where() -> Where:
    """The phase and step of this thread's calls (:func:`at`)."""
    return _WHERE.get() or Where()


def call_key(group: str, method: str) -> str:
    """The history a call's duration joins: `<phase>/<group>.<method>`, `<group>.<method>` outside a phase."""
    phase = where().phase
    return f"{phase}/{group}.{method}" if phase else f"{group}.{method}"


def register_stack_dump(path: Path) -> None:
    """Dump every thread's stack into `path` whenever :data:`STACK_SIGNAL` arrives. The file is
    appended to, after a line naming this process: the run directory outlives a run, and a
    requeued run's ranks must not erase the stacks of the hang that ended the run before. The file
    stays open for the process's life (faulthandler writes from the handler)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = path.open("a")
    out.write(f"# pid {os.getpid()} on {socket.gethostname()}, started "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    out.flush()
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)
    register_stack_dump.files.append(out)  # type: ignore[attr-defined]


register_stack_dump.files = []  # type: ignore[attr-defined]


@dataclass
class Bounds:
    """How long each call may take before the watchdog fires (see the module's docstring)."""

    floor_s: float = 600.0
    multiple: float = 5.0
    min_s: float = 60.0
    warmup: int = 3
    poll_s: float = 5.0
    history: dict[str, list[float]] = field(default_factory=dict)

    def bound(self, key: str) -> float:
        seen = self.history.get(key, [])
        if len(seen) < self.warmup:
            return self.floor_s
        return max(self.min_s, self.multiple * statistics.median(seen))

    def record(self, key: str, seconds: float) -> None:
        self.history.setdefault(key, []).append(seconds)

    def describe(self, key: str) -> str:
        seen = self.history.get(key, [])
        if len(seen) < self.warmup:
            return f"the first calls' floor, {self.floor_s:g} s (`trainer.watchdog.floor_s`)"
        return (f"{self.multiple:g} x the median of {len(seen)} earlier calls ({statistics.median(seen):.1f} s), "
                f"at least {self.min_s:g} s")


def process_state(pid: int) -> str | None:
    """The state letter of `pid` on this host (`/proc/<pid>/stat`), None when it is not here."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def py_spy_dump(pid: int, path: str) -> bool:
    """Append `pid`'s Python stacks to `path` with py-spy (`py-spy dump`, beside this interpreter or
    on PATH), which reads them from the process's memory: a stopped (`T`) or `D`-state process
    gives its stack too, which no signal handler can. False where py-spy is missing or may not
    read the process (another user's, a container without `CAP_SYS_PTRACE`): the caller falls
    back to the signal."""
    exe = Path(sys.executable).with_name("py-spy")
    found = str(exe) if exe.exists() else shutil.which("py-spy")
    if found is None:
        return False
    try:
        done = subprocess.run([found, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if done.returncode != 0 or not done.stdout.strip():
        return False
    with open(path, "a") as out:
        out.write(f"py-spy dump of pid {pid} on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M:%S')}:\n"
                  f"{done.stdout}\n")
    return True


def inspect(pids: list[int], dump: bool, stacks: list[str | None] | None = None) -> list[tuple[str | None, str | None]]:
    """On the node this runs on: each process's state (:func:`process_state`, None when it is not
    here), and with `dump` how its stacks were asked for: `py-spy` (read from its memory into its
    file of `stacks`, :func:`py_spy_dump`) where py-spy can, else `signal` (:data:`STACK_SIGNAL`:
    a stopped process writes when it runs again, the others now)."""
    out: list[tuple[str | None, str | None]] = []
    for pid, path in zip(pids, stacks or [None] * len(pids), strict=True):
        state, how = process_state(pid), None
        if dump and state is not None:
            if path is not None and py_spy_dump(pid, path):
                how = "py-spy"
            else:
                try:
                    os.kill(pid, STACK_SIGNAL)
                    how = "signal"
                except OSError:
                    pass
        out.append((state, how))
    return out


def _inspect_nodes(procs: dict[str, tuple[list[int], list[str | None]]], dump: bool, timeout: float = 30.0
                   ) -> dict[str, list[tuple[str | None, str | None]]]:
    """:func:`inspect` on each node (by address) of `procs` (pids and stack files), through one Ray
    task pinned to each, all at once; a node that is not in the cluster or does not answer within
    `timeout`: states unknown."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = {n.get("NodeManagerAddress"): n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    task = ray.remote(num_cpus=0)(inspect)
    refs = {ip: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[ip], soft=False)).remote(
                pids, dump, files) for ip, (pids, files) in procs.items() if ip in ids}
    deadline = time.monotonic() + timeout
    out: dict[str, list[tuple[str | None, str | None]]] = {ip: [(None, None)] * len(pids)
                                                            for ip, (pids, _) in procs.items()}
    for ip, ref in refs.items():
        try:
            out[ip] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a node that does not answer: its ranks' states stay unknown
            pass
    return out


def _states(nodes: list[dict[str, Any]], dump: bool, stacks: Path | None = None
            ) -> list[tuple[str | None, str | None]]:
    """Each rank's process state (`nodes`: the ranks' `node_info`), read here for the ranks on this
    host and on their own nodes for the others (:func:`_inspect_nodes`); with `dump`, each rank's
    stacks into `stacks/rank_<r>.txt`."""
    here = socket.gethostname()
    placed: dict[str, list[int]] = {}  # "" (this host) or a node's address: its ranks
    for rank, node in enumerate(nodes):
        if isinstance(node.get("pid"), int):
            placed.setdefault("" if node.get("hostname") == here else str(node.get("ip")), []).append(rank)
    procs = {ip: ([int(nodes[r]["pid"]) for r in ranks],
                  [str(stacks / f"rank_{r}.txt") if stacks is not None else None for r in ranks])
             for ip, ranks in placed.items()}
    remote = {ip: p for ip, p in procs.items() if ip}
    answers = _inspect_nodes(remote, dump) if remote else {}
    if "" in procs:
        answers[""] = inspect(procs[""][0], dump, procs[""][1])
    states: list[tuple[str | None, str | None]] = [(None, None)] * len(nodes)
    for ip, ranks in placed.items():
        for rank, state in zip(ranks, answers[ip], strict=True):
            states[rank] = state
    return states


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _await_stacks(ranks: list[dict[str, Any]], sizes: dict[int, int], timeout: float = 10.0) -> None:
    """Wait (at most `timeout` s) until each running or waiting rank has written its stack (its
    file has grown past its size before the signal, `sizes` by rank): the group is ended next, and
    a process killed before its handler ran writes nothing. A stopped or `D`-state rank writes only
    when it runs again; the shared file system may also lag."""
    waiting = [(Path(r["stack"]), sizes.get(r["rank"], 0)) for r in ranks
               if r.get("stack") and r.get("stack_by") == "signal" and r["state"] in ("R", "S")]
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        waiting = [(p, before) for p, before in waiting if _size(p) <= before]
        time.sleep(0.1)


def _name(r: dict[str, Any]) -> str:
    return (f"rank {r['rank']} on node `{r['node']}` (pid {r['pid']}, "
            f"{_STATES.get(r['state'] or '', 'state unknown')})")


def suspect_nodes(lagging: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The nodes to requeue without, from the ranks that did not answer (`node`, `state`), and the
    sentence that says why: a stopped process points at its node, so does one in uninterruptible
    I/O (`D`) on one node; `D` on several nodes points at a shared file system instead, and no
    node is blamed for it."""
    stopped = {str(r["node"]) for r in lagging if r["state"] in ("T", "t")}
    in_io = {str(r["node"]) for r in lagging if r["state"] == "D"}
    if len(in_io) > 1:
        return sorted(stopped), (f". Ranks in uninterruptible I/O (D) on {len(in_io)} nodes: a shared file system "
                                 "that stopped answering is likelier than a node, and none is blamed for it"
                                 + ("; a stopped process points at its node" if stopped else ""))
    suspects = sorted(stopped | in_io)
    return suspects, ". A stopped or D-state process points at its node" if suspects else ""


def diagnose(nodes: list[dict[str, Any]], stuck: list[int], group: str, method: str, elapsed: float,
             bounds: Bounds, stacks: Path | None) -> tuple[str, dict[str, Any]]:
    """The summary and details of a call past its bound: each rank's state (stacks dumped into
    `stacks`), the ranks that did not answer first, a stopped or `D`-state one before them.
    `elapsed`: seconds since the call began (the hang began then or later)."""
    key = call_key(group, method)
    bound = bounds.describe(key)
    dump = stacks is not None  # only ranks that registered the handler: the signal ends the others
    sizes = {rank: _size(stacks / f"rank_{rank}.txt") for rank in range(len(nodes))} if stacks else {}
    ranks = [{"rank": rank, "node": node.get("hostname"), "pid": node.get("pid"), "state": state,
              "answered": rank not in stuck,
              **({"stack": str(stacks / f"rank_{rank}.txt"), "stack_offset": sizes[rank], "stack_by": how}
                 if stacks else {})}
             for rank, (node, (state, how)) in enumerate(zip(nodes, _states(nodes, dump, stacks), strict=True))]
    _await_stacks(ranks, sizes)
    lagging = [r for r in ranks if not r["answered"]]
    first = [r for r in lagging if r["state"] in ("T", "t", "D")]
    others = [r for r in lagging if r not in first]
    named = "; ".join(_name(r) for r in first + others[:NAMED])
    if len(others) > NAMED:
        named += f" and {len(others) - NAMED} more (every rank in `diagnosis.jsonl`)"
    if first and others:
        named += f" (the other {len(others)} may only be waiting on the first in a collective)"
    suspects, why = suspect_nodes(lagging)
    at_ = where()
    during = "".join([f" in phase `{at_.phase}`" if at_.phase else "",
                      f" of step {at_.step}" if at_.step is not None else ""])
    summary = (f"worker group `{group}`: `{method}`{during} has run {elapsed:.0f} s, past its bound ({bound}); "
               f"{len(lagging)} of {len(nodes)} rank(s) have not answered: {named}"
               + why
               + (f". Stacks: {stacks}/rank_<r>.txt" if stacks else ""))
    return summary, {"group": group, "method": method, "phase": at_.phase, "step": at_.step,
                     "elapsed_s": round(elapsed, 1), "bound_s": round(bounds.bound(key), 1),
                     "bound": bound, "ranks": ranks,
                     "suspect_nodes": suspects}
