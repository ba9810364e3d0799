"""A call to the ranks that runs far past its usual time: stacks dumped, the ranks that did not
answer named with their process state, the run ended with the diagnosis.

From the first step on (not while the ranks join and load their models), every call the driver
makes to a Ray worker group (a phase of a step: `generate`, `compute_log_prob`, `update_actor`,
the weight sync, a checkpoint) is timed per phase, group and method (:func:`call_key`: the step's
phase as its timer names it, or `validate`, set by :func:`at`; a validation's rollout is not held
to the training rollout's durations). Its bound (:meth:`Bounds.bound`) is
`trainer.watchdog.multiple` times the median of that call's earlier durations in this run, at
least `trainer.watchdog.min_s`; until the call has `trainer.watchdog.warmup` durations,
`trainer.watchdog.floor_s` (the first steps compile, load and warm caches). A requeued run starts
from the durations its earlier runs kept in the run directory (`watchdog/<group>.json`,
:meth:`Bounds.load`): its first call of each kind still gets the floor (the start-up's compile
and cold caches), the next ones the multiple of the median over the earlier runs' durations and
its own. Past it, :func:`diagnose`:

- dumps every rank's Python stacks into `<run_dir>/stacks/rank_<r>.txt` (the run directory is
  shared across nodes; a requeued run's ranks append after the earlier ones), on the rank's own
  node (from the driver, or a Ray task pinned to the node): with `py-spy dump` where py-spy is
  installed and may read the process (it reads a stopped or `D`-state rank's stack too, which no
  handler can), else by :data:`STACK_SIGNAL`, which each rank registered with `faulthandler` at
  start (:func:`register_stack_dump`); each rank's `stack_by` in the diagnosis says which;
- reads each rank's process state (`/proc/<pid>/stat`: `T` stopped, `D` in uninterruptible
  I/O, `Z` gone, `R`/`S` running or waiting);
- asks each rank to dump its flight recorder into `<run_dir>/nccl_trace/rank_<r>`
  (:mod:`trainer.flight_recorder`: NCCL's on GPUs, gloo's on CPUs; the collective each rank
  waits in, its sequence number), and gives per rank `nccl_trace` (the file) and
  `nccl_trace_note` (the recorder and the collective pending, or why there is no dump);
- reads each node's GPU evidence since the ranks started (:mod:`hpcrl.gpu_evidence`:
  `nvidia-smi`/`amd-smi` ECC counters, the kernel log's Xids and amdgpu errors), `gpu` by node;
- names the ranks that have not answered while the others have, with node, pid and state, a
  stopped (`T`) or `D`-state one first: the others may only be waiting on it in a collective.

The driver then ends the run with that diagnosis (a :class:`~trainer.workers.group.WorkerFailure`
of kind `hang`, kept in `diagnosis.jsonl` for `hpcrl status`). A rank stopped or in `D` state
points at its node, and so do GPU errors on it: the diagnosis lists such nodes (`suspect_nodes`),
and hpcrl's head agent requeues the job without them, as after a node loss
(:func:`hpcrl.diagnosis.blamed_nodes`); the rerun resumes from the last checkpoint. Otherwise the
run ends with the diagnosis. A node without GPU tools gives no evidence and is never blamed for it.
"""

from __future__ import annotations

import faulthandler
import json
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

from hpcrl.gpu_evidence import node_evidence
from trainer import flight_recorder as FR
from trainer.workers.on_node import run_on_nodes

__all__ = ["STACK_SIGNAL", "WATCHDOG_DIR", "Bounds", "Where", "at", "behind_in_collectives", "call_key", "diagnose", "inspect",
           "process_state", "register_stack_dump", "suspect_nodes", "where"]

STACK_SIGNAL = int(signal.SIGRTMIN) + 3
"""The signal a rank dumps its threads' stacks on (a real-time signal: nothing else sends it)."""

WATCHDOG_DIR = "watchdog"
"""The run directory's folder of the calls' durations, a file per worker group, kept for a requeued run."""

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
    earlier: dict[str, list[float]] = field(default_factory=dict)
    """Durations the run's earlier runs (before a requeue) kept, by call."""
    path: Path | None = None
    """Where the durations are kept for a later run (:meth:`load`), rewritten after each call."""

    #: Durations kept per call for a later run: the latest ones.
    KEPT = 50

    @classmethod
    def load(cls, path: Path, **knobs: Any) -> Bounds:
        """Bounds that keep their durations in `path` and start from those an earlier run kept
        there (none when the file is missing or unreadable: the floor then, as in a first run)."""
        try:
            earlier = {str(k): [float(x) for x in v] for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            earlier = {}
        return cls(**knobs, earlier=earlier, path=path)

    def _seen(self, key: str) -> list[float]:
        """The durations the bound is learned from: this run's once it has `warmup` of them;
        before that, once this run has made the call once (past its start-up), the earlier
        runs' with this run's, where the earlier runs had `warmup`; else none (the floor)."""
        seen = self.history.get(key, [])
        if len(seen) >= self.warmup:
            return seen
        prior = self.earlier.get(key, [])
        if seen and len(prior) >= self.warmup:
            return prior + seen
        return []

    def bound(self, key: str) -> float:
        seen = self._seen(key)
        if not seen:
            return self.floor_s
        return max(self.min_s, self.multiple * statistics.median(seen))

    def record(self, key: str, seconds: float) -> None:
        self.history.setdefault(key, []).append(seconds)
        if self.path is not None:
            self._keep()

    def _keep(self) -> None:
        """The latest durations of every call, earlier runs' first, written for a later run; a run
        directory that cannot be written costs the later run its head start, not this run."""
        kept = {k: (self.earlier.get(k, []) + self.history.get(k, []))[-self.KEPT:]
                for k in {*self.earlier, *self.history}}
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(kept))
            tmp.replace(self.path)
        except OSError:
            pass

    def describe(self, key: str) -> str:
        seen = self._seen(key)
        if not seen:
            return f"the first calls' floor, {self.floor_s:g} s (`trainer.watchdog.floor_s`)"
        mine = len(self.history.get(key, []))
        calls = (f"{len(seen)} earlier calls" if len(seen) == mine else
                 f"{len(seen)} earlier calls ({len(seen) - mine} of the runs before the requeue)")
        return f"{self.multiple:g} x the median of {calls} ({statistics.median(seen):.1f} s), at least {self.min_s:g} s"


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
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # a rank that registered no handler made none
    with open(path, "a") as out:
        out.write(f"py-spy dump of pid {pid} on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M:%S')}:\n"
                  f"{done.stdout}\n")
    return True


def inspect(pids: list[int], dump: bool, stacks: list[str | None] | None = None, traces: bool = False,
            since: float | None = None) -> dict[str, Any]:
    """On the node this runs on: `ranks`, for each process its state (:func:`process_state`, None
    when it is not here), with `dump` how its stacks were asked for (`py-spy`: read from its
    memory into its file of `stacks`, :func:`py_spy_dump`, where py-spy can; else `signal`:
    :data:`STACK_SIGNAL`, which a stopped process answers when it runs again, the others now),
    and with `traces` why its flight recorder was not asked to dump (None: asked,
    :func:`trainer.flight_recorder.request_dump`); with `since`, `gpu`: the node's GPU evidence
    since then (:func:`hpcrl.gpu_evidence.node_evidence`)."""
    out: list[tuple[str | None, str | None, str | None]] = []
    for pid, path in zip(pids, stacks or [None] * len(pids), strict=True):
        state, how, why = process_state(pid), None, None
        if dump and state is not None:
            if path is not None and py_spy_dump(pid, path):
                how = "py-spy"
            else:
                try:
                    os.kill(pid, STACK_SIGNAL)
                    how = "signal"
                except OSError:
                    pass
        if traces:
            why = ("the rank is not on this node" if state is None
                   else f"the rank is {_STATES[state]}: none of its threads runs" if state in ("T", "t", "Z", "X")
                   else FR.request_dump(pid))
        out.append((state, how, why))
    return {"ranks": out, "gpu": None if since is None else node_evidence(since)}


def _inspect_nodes(procs: dict[str, tuple[list[int], list[str | None]]], dump: bool, traces: bool,
                   since: float | None, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """:func:`inspect` on each node (by address) of `procs` (pids and stack files), through one Ray
    task pinned to each, all at once; a node that is not in the cluster or does not answer within
    `timeout`: states unknown, no GPU evidence."""
    found = run_on_nodes(inspect, {ip: (pids, dump, files, traces, since) for ip, (pids, files) in procs.items()},
                         timeout)
    return {ip: found.get(ip, {"ranks": [(None, None, "its node did not answer")] * len(pids), "gpu": None})
            for ip, (pids, _) in procs.items()}


def _states(nodes: list[dict[str, Any]], dump: bool, stacks: Path | None = None, traces: bool = False,
            since: float | None = None) -> tuple[list[tuple[str | None, str | None, str | None]], dict[str, Any]]:
    """Each rank's process state, how its stacks were asked for and why its flight recorder was
    not asked (`nodes`: the ranks' `node_info`), read here for the ranks on this host and on their
    own nodes for the others (:func:`_inspect_nodes`); with `dump`, each rank's stacks into
    `stacks/rank_<r>.txt`. And each node's GPU evidence (by host name) with `since`."""
    here = socket.gethostname()
    placed: dict[str, list[int]] = {}  # "" (this host) or a node's address: its ranks
    for rank, node in enumerate(nodes):
        if isinstance(node.get("pid"), int):
            placed.setdefault("" if node.get("hostname") == here else str(node.get("ip")), []).append(rank)
    procs = {ip: ([int(nodes[r]["pid"]) for r in ranks],
                  [str(stacks / f"rank_{r}.txt") if stacks is not None else None for r in ranks])
             for ip, ranks in placed.items()}
    remote = {ip: p for ip, p in procs.items() if ip}
    answers = _inspect_nodes(remote, dump, traces, since) if remote else {}
    if "" in procs:
        answers[""] = inspect(procs[""][0], dump, procs[""][1], traces, since)
    states: list[tuple[str | None, str | None, str | None]] = [(None, None, "its node is unknown")] * len(nodes)
    gpus: dict[str, Any] = {}
    for ip, ranks in placed.items():
        for rank, state in zip(ranks, answers[ip]["ranks"], strict=True):
            states[rank] = tuple(state)  # type: ignore[assignment]
        if answers[ip].get("gpu") is not None:
            gpus[str(nodes[ranks[0]].get("hostname"))] = answers[ip]["gpu"]
    return states, gpus


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


def _await_traces(ranks: list[dict[str, Any]], traces: Path, before: dict[int, float | None],
                  timeout: float = 30.0) -> None:
    """Wait (at most `timeout` s) for the note of each rank asked to dump its flight recorder
    (its time changed from `before`, by rank), and set the rank's `nccl_trace` (the file, or
    None) and `nccl_trace_note` (the recorder it came from, or why there is none). A dump
    symbolises each entry's Python stack: seconds on a busy node."""
    asked = {r["rank"]: r for r in ranks if r.get("nccl_trace_note") is None}
    deadline = time.monotonic() + timeout
    while asked:
        for rank in [k for k in asked if FR.note_time(traces, k) != before.get(k)]:
            note = FR.read_note(traces, rank) or {}
            r = asked.pop(rank)
            r["nccl_trace"] = note.get("file")
            pending = f"waiting in {note['pending']}" if note.get("pending") else "none pending"
            recorder, _, build = str(note.get("recorder")).partition(" ")
            r["nccl_trace_note"] = (f"{recorder}'s flight recorder{' ' + build if build else ''}: "
                                    f"{note.get('entries')} entries, {pending}" if note.get("file") else note.get("why"))
            r["nccl_trace_groups"] = note.get("groups")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for r in asked.values():
        r["nccl_trace"], r["nccl_trace_note"] = None, f"asked, but no dump within {timeout:g} s"


def behind_in_collectives(ranks: list[dict[str, Any]]) -> str:
    """The ranks the flight recorders put behind the others (their `nccl_trace_groups`: the last
    collective each process group enqueued): in the default group (`0`), a rank that enqueued
    fewer collectives than the others has not come to the one they wait in. Empty when fewer than
    two ranks dumped or all are at the same collective."""
    enqueued = {r["rank"]: ((r.get("nccl_trace_groups") or {}).get("0") or {}).get("last_enqueued") for r in ranks}
    seen: dict[int, int] = {rank: n for rank, n in enqueued.items() if isinstance(n, int)}
    if len(seen) < 2 or len(set(seen.values())) == 1:
        return ""
    top, node = max(seen.values()), {r["rank"]: r.get("node") for r in ranks}
    late = "; ".join(f"rank {rank} on node `{node[rank]}` (#{n})" for rank, n in sorted(seen.items()) if n < top)
    return f". By the flight recorders, the others enqueued collective #{top} and these ranks did not: {late}"


def _gpu_clause(gpus: dict[str, Any]) -> str:
    """The GPU evidence in the summary: the nodes it blames and why, or the nodes without tools."""
    blamed = [f"`{node}`: {'; '.join(e['suspect'])}" for node, e in sorted(gpus.items()) if e.get("suspect")]
    if blamed:
        return ". GPU errors point at node(s) " + ", ".join(blamed)
    bare = sorted(node for node, e in gpus.items() if any(n.startswith("no GPU tools") for n in e.get("notes", [])))
    return f". No GPU evidence (no GPU tools on {', '.join(bare)})" if bare else ""


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
             bounds: Bounds, stacks: Path | None, traces: Path | None = None, since: float | None = None
             ) -> tuple[str, dict[str, Any]]:
    """The summary and details of a call past its bound: each rank's state (stacks dumped into
    `stacks`, flight recorders into `traces`: :mod:`trainer.flight_recorder`), the ranks that did
    not answer first, a stopped or `D`-state one before them; each node's GPU evidence since
    `since` (epoch seconds, the ranks' start: :mod:`hpcrl.gpu_evidence`). `elapsed`: seconds
    since the call began (the hang began then or later)."""
    key = call_key(group, method)
    bound = bounds.describe(key)
    dump = stacks is not None  # only ranks that registered the handler: the signal ends the others
    sizes = {rank: _size(stacks / f"rank_{rank}.txt") for rank in range(len(nodes))} if stacks else {}
    noted = {rank: FR.note_time(traces, rank) for rank in range(len(nodes))} if traces else {}
    states, gpus = _states(nodes, dump, stacks, traces is not None, since)
    ranks = [{"rank": rank, "node": node.get("hostname"), "pid": node.get("pid"), "state": state,
              "answered": rank not in stuck,
              **({"stack": str(stacks / f"rank_{rank}.txt"), "stack_offset": sizes[rank], "stack_by": how}
                 if stacks else {}),
              **({"nccl_trace": None, "nccl_trace_note": why} if traces else {})}
             for rank, (node, (state, how, why)) in enumerate(zip(nodes, states, strict=True))]
    _await_stacks(ranks, sizes)
    if traces is not None:
        _await_traces(ranks, traces, noted)
    lagging = [r for r in ranks if not r["answered"]]
    first = [r for r in lagging if r["state"] in ("T", "t", "D")]
    others = [r for r in lagging if r not in first]
    named = "; ".join(_name(r) for r in first + others[:NAMED])
    if len(others) > NAMED:
        named += f" and {len(others) - NAMED} more (every rank in `diagnosis.jsonl`)"
    if first and others:
        named += f" (the other {len(others)} may only be waiting on the first in a collective)"
    suspects, why = suspect_nodes(lagging)
    gpu_suspects = sorted(node for node, e in gpus.items() if e.get("suspect"))
    at_ = where()
    during = "".join([f" in phase `{at_.phase}`" if at_.phase else "",
                      f" of step {at_.step}" if at_.step is not None else ""])
    dumped = [r for r in ranks if r.get("nccl_trace")]
    summary = (f"worker group `{group}`: `{method}`{during} has run {elapsed:.0f} s, past its bound ({bound}); "
               f"{len(lagging)} of {len(nodes)} rank(s) have not answered: {named}"
               + why
               + behind_in_collectives(ranks)
               + _gpu_clause(gpus)
               + (f". Stacks: {stacks}/rank_<r>.txt" if stacks else "")
               + (f". Flight recorder: {traces}/rank_<r> ({len(dumped)} of {len(ranks)} rank(s))" if traces else ""))
    return summary, {"group": group, "method": method, "phase": at_.phase, "step": at_.step,
                     "elapsed_s": round(elapsed, 1), "bound_s": round(bounds.bound(key), 1),
                     "bound": bound, "ranks": ranks, "gpu": gpus,
                     "suspect_nodes": sorted(set(suspects) | set(gpu_suspects))}
