"""Load of the control plane on the shared run directory, by simulation: N node agents without
Ray on this machine, against a real run directory on local disk.

Each simulated node runs the agent's own code: its `Heartbeat` (writer threads call `beat` every
tick, as the agents' loops do), the head's `GcsWatch.lost_nodes` and `stop_requested` every tick
with its own beat, and one worker running `watch_worker` (the stop file, `lost_head`, its beat)
as the sample of what every worker does. Every file operation on the run directory is counted where Python hands
it to the kernel (the `os` functions and `io.open` the agent calls), by thread. Printed per N:

- metadata operations per second on the run directory (open, close, create, rename, link,
  unlink, stat, readdir, fsync: on Lustre each is an RPC to the metadata server, fsync an
  MDS_SYNC; reads and writes of an open file go to the object servers), split into the
  heartbeat writers, the head's watch, and the workers' watch (the sample worker's count
  times N-1), and one-off bring-up operations per node (first node file, state line,
  rendezvous);
- the head's CPU per heartbeat interval (2 s; its thread's CPU clock);
- the time from a node going silent to the head naming it (its monotonic clock), and any node
  named dead that was not (a writer that fell behind).

`--baseline REV` runs the same simulation against another commit's hpcrl (`git archive`), in the
same run: ratios are meaningful only there.

    python -m bench.control_plane [--nodes 64 256 1024] [--baseline e143ca6] [--window 10]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TICK_S = 0.1
BEAT_S = 2.0
WARMUP_S = 5.0
TIMEOUT_S = 15.0  # the profile's default `heartbeat_timeout_s`
WRITER_THREADS = 16
METADATA = ("open", "close", "rename", "link", "unlink", "stat", "readdir", "fsync", "mkdir")
DATA = ("read", "write")


# ----------------------------------------------------------------------------- counting


class Counter:
    """File operations on the run directory, per thread (merged when a figure is taken)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fds: set[int] = set()
        self.local = threading.local()
        self.all: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        counts = getattr(self.local, "counts", None)
        if counts is None:
            role = threading.current_thread().name.split("-")[0]
            counts = dict.fromkeys(METADATA + DATA, 0)
            with self.lock:
                self.all[f"{role}@{threading.get_ident()}"] = counts
            self.local.counts = counts
        return counts

    def mine(self, path: Any) -> bool:
        if isinstance(path, int):
            return path in self.fds
        return os.fspath(path).startswith(self.root) if isinstance(path, str | os.PathLike) \
            else False

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Counts by role (the thread name's first part)."""
        out: dict[str, dict[str, int]] = {}
        with self.lock:
            items = list(self.all.items())
        for key, counts in items:
            role = key.split("@")[0]
            mine = out.setdefault(role, dict.fromkeys(METADATA + DATA, 0))
            for op, n in dict(counts).items():
                mine[op] += n
        return out

    def install(self) -> None:
        """Wrap the `os` functions and `io.open` the agent's code calls."""
        count = self

        def by_path(op: str, real: Callable[..., Any], extra: tuple[str, ...] = ()) -> Any:
            def wrapper(path: Any, *a: Any, **k: Any) -> Any:
                if op == "open" and extra and isinstance(path, int):  # `os.fdopen`: a file
                    if path in count.fds:  # object over an open descriptor, closed with it
                        count.counts()["close"] += 1  # (not by `os.close`)
                    return real(path, *a, **k)
                if count.mine(path):  # a failed look-up costs the server as much
                    c = count.counts()
                    c[op] += 1
                    result = real(path, *a, **k)
                    for more in extra:
                        c[more] += 1
                    if op == "open" and isinstance(result, int):
                        count.fds.add(result)
                    return result
                return real(path, *a, **k)
            return wrapper

        def by_fd(op: str, real: Callable[..., Any]) -> Any:
            def wrapper(fd: int, *a: Any, **k: Any) -> Any:
                if fd in count.fds:
                    count.counts()[op] += 1
                    if op == "close":
                        count.fds.discard(fd)
                return real(fd, *a, **k)
            return wrapper

        os.open = by_path("open", os.open)  # type: ignore[assignment]
        io.open = by_path("open", io.open, ("close", "read"))  # a whole read, then closed
        for name, op in (("stat", "stat"), ("lstat", "stat"), ("listdir", "readdir"),
                         ("scandir", "readdir"), ("mkdir", "mkdir"), ("unlink", "unlink"),
                         ("link", "link"), ("replace", "rename"), ("rename", "rename")):
            setattr(os, name, by_path(op, getattr(os, name)))
        for name, op in (("close", "close"), ("fsync", "fsync"), ("fdatasync", "fsync"),
                         ("fstat", "stat"), ("read", "read"), ("pread", "read"),
                         ("write", "write"), ("pwrite", "write")):
            setattr(os, name, by_fd(op, getattr(os, name)))


def metadata(counts: dict[str, int]) -> int:
    return sum(counts[op] for op in METADATA)


# ----------------------------------------------------------------------------- one simulation


def simulate(n: int, window_s: float) -> dict[str, Any]:
    """N simulated nodes (this process, threads) against a fresh run directory."""
    import hpcrl
    from hpcrl.agent import rendezvous as rdv
    from hpcrl.agent.jobfile import parse_job
    from hpcrl.agent.node import Heartbeat, Node
    from hpcrl.agent.stop import SignalInbox
    from hpcrl.agent.watch import GcsWatch, stop_requested, watch_worker
    from hpcrl.rundir import RunPaths
    from hpcrl.runstate import AGENT_STARTED, StateWriter
    from hpcrl.slurm_env import job_context

    root = Path(tempfile.mkdtemp(prefix="hpcrl-ctl-"))
    run = root / "run"
    run.mkdir(mode=0o700)
    counter = Counter(str(run))
    counter.install()
    paths = RunPaths(run, 0)
    envs = [{"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": f"sim[0000-{n - 1:04d}]",
             "SLURM_JOB_NUM_NODES": str(n), "SLURM_NODEID": str(r)} for r in range(n)]
    ctxs = [job_context(e) for e in envs]
    job = parse_job({"payload": ["x"], "nodes": n, "max_requeues": 0,
                     "profile": {"agent": {"heartbeat_timeout_s": TIMEOUT_S}}})
    log = __import__("logging").getLogger("control-plane-sim")
    log.propagate = False

    def node(rank: int) -> Node:
        return Node(run, envs[rank], ctxs[rank], paths, job, log, lambda *a: ([], {}), {})

    beats = [Heartbeat(paths, c) for c in ctxs]
    for r, hb in enumerate(beats):
        hb.info = {"address": f"10.{r // 250}.{r % 250}.1", "node_manager_port": 7000}

    def bring_up() -> None:  # each node's first words, and the head's rendezvous
        rdv.create_run_dirs(paths, ctxs[0].hostname)
        rdv.publish(paths, {"head": ctxs[0].hostname, "gcs_address": "10.0.0.1:6379"})
        for r, hb in enumerate(beats):
            StateWriter(run, 0, r, ctxs[r].hostname).append(AGENT_STARTED, pid=1, nodes=n)
            hb.write("starting")
        rdv.atomic_write_text(paths.head_alive, "0\n")
        for hb in beats:
            hb.write("running")

    t = threading.Thread(target=bring_up, name="bringup")
    t.start()
    t.join()

    for hb in beats:  # agents start at different moments
        hb.last = time.monotonic() - random.uniform(0, BEAT_S)
    head, worker = node(0), node(1)
    watch = GcsWatch(head, queue.Queue())
    watch.lines.put(json.dumps({"alive": [f"{b.info['address']}:7000" for b in beats]}))
    watch.refresh()
    watch.seen, watch.complete = set(range(n)), True
    victim = 2
    stop, killed = threading.Event(), threading.Event()
    state: dict[str, Any] = {"false_dead": [], "detected": None, "kill_at": None, "beats": 0,
                             "worker_ended": [], "head_ticks": 0}
    lock = threading.Lock()

    def head_loop() -> None:
        while not stop.is_set():
            now = time.monotonic()
            state["head_ticks"] += 1
            failed = stop_requested(paths) or watch.lost_nodes()
            if failed is not None:
                if killed.is_set() and f"(rank {victim})" in failed.cause:
                    state["detected"] = now
                    return
                state["false_dead"].append(failed.cause)
            beats[0].beat("running")
            time.sleep(TICK_S)

    class Ray:  # the worker's Ray: up until the simulation ends
        pid, log_path = 0, "-"

        @staticmethod
        def poll() -> int | None:
            return 0 if stop.is_set() else None

    def worker_loop() -> None:  # the agent's own loop; an end before the simulation's is wrong
        while not stop.is_set():
            ended = watch_worker(worker, Ray, beats[1], SignalInbox())  # type: ignore[arg-type]
            if not stop.is_set():
                state["worker_ended"].append(ended.cause)

    def writer_loop(mine: list[int]) -> None:
        while not stop.is_set():
            done = 0
            for r in mine:
                if r == victim and killed.is_set():
                    continue
                before = beats[r].last
                beats[r].beat("running")
                done += beats[r].last != before
            with lock:
                state["beats"] += done
            time.sleep(TICK_S)

    writers = list(range(2, n))
    threads = [threading.Thread(target=head_loop, name="head"),
               threading.Thread(target=worker_loop, name="worker")]
    threads += [threading.Thread(target=writer_loop, args=(writers[i::WRITER_THREADS],),
                                 name=f"beats-{i}") for i in range(WRITER_THREADS)]
    start = time.monotonic()
    for th in threads:
        th.daemon = True
        th.start()
    clocks = {th.name: time.pthread_getcpuclockid(th.ident or 0) for th in threads[:2]}
    try:
        time.sleep(WARMUP_S)
        cpu0 = {k: time.clock_gettime(c) for k, c in clocks.items()}
        before, beats_before, t0 = counter.snapshot(), state["beats"], time.monotonic()
        ticks0 = state["head_ticks"]
        time.sleep(window_s)
        after, beats_after, t1 = counter.snapshot(), state["beats"], time.monotonic()
        ticks = (state["head_ticks"] - ticks0) / (t1 - t0)
        cpu = {k: (time.clock_gettime(c) - cpu0[k]) / ((t1 - t0) / BEAT_S)
               for k, c in clocks.items()}
        killed.set()
        state["kill_at"] = time.monotonic()
        while state["detected"] is None and time.monotonic() - state["kill_at"] < TIMEOUT_S + 15:
            time.sleep(0.05)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=30)
        shutil.rmtree(root, ignore_errors=True)

    def rate(role: str, op_set: tuple[str, ...] = METADATA) -> float:
        a, b = after.get(role, {}), before.get(role, {})
        return sum(a.get(op, 0) - b.get(op, 0) for op in op_set) / (t1 - t0)

    by_op = {op: (after.get("beats", {}).get(op, 0) - before.get("beats", {}).get(op, 0))
             / (t1 - t0) for op in METADATA + DATA}
    return {
        "tree": str(Path(hpcrl.__file__).parents[1]),
        "nodes": n,
        "window_s": round(t1 - t0, 2),
        "beats_per_s": (beats_after - beats_before) / (t1 - t0),
        "nominal_beats_per_s": len(writers) / BEAT_S,
        "writers_md_per_s": rate("beats"),
        "writers_by_op": {k: round(v, 1) for k, v in by_op.items() if v},
        "writers_md_per_node_10s": rate("beats") / len(writers) * 10,
        "head_md_per_s": rate("head"),
        "head_data_per_s": rate("head", DATA),
        "worker_md_per_s": rate("worker"),
        "workers_md_per_s": rate("worker") * (n - 1),
        "bringup_md_per_node": metadata(after.get("bringup", dict.fromkeys(METADATA, 0))) / n,
        "head_cpu_per_beat_s": cpu["head"],
        "head_loops_per_s": ticks,
        "worker_cpu_per_beat_s": cpu["worker"],
        "notice_s": (state["detected"] - state["kill_at"]) if state["detected"] else None,
        "false_dead": len(state["false_dead"]),
        "first_false_dead": state["false_dead"][:1],
        "worker_ended_early": state["worker_ended"][:3],
        "elapsed_s": round(time.monotonic() - start, 1),
    }


# ----------------------------------------------------------------------------- the comparison


def run_tree(tree: Path, n: int, window_s: float) -> dict[str, Any]:
    """One simulation in a fresh interpreter importing hpcrl from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1",
           "SLURM_CONF": "/nonexistent/slurm.conf",  # a worker that takes the head for dead
           "PATH": str(Path(sys.executable).parent)}  # would requeue: no `scontrol` here
    out = subprocess.run([sys.executable, __file__, "--simulate", str(n), "--window",
                          str(window_s)], env=env, cwd=tree, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"simulation of {n} nodes in `{tree}` failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["tree"]).resolve() != tree.resolve():
        raise SystemExit(f"the simulation imported hpcrl from `{result['tree']}`, not `{tree}`")
    return result


def baseline_tree(rev: str, into: Path) -> Path:
    tree = into / f"hpcrl-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "hpcrl", "trainer"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def row(label: str, r: dict[str, Any]) -> str:
    notice = f"{r['notice_s']:.1f}" if r["notice_s"] is not None else "never"
    return (f"| {r['nodes']} | {label} | {r['writers_md_per_s']:.0f} | "
            f"{r['writers_md_per_node_10s']:.2f} | {r['head_md_per_s']:.0f} | "
            f"{r['workers_md_per_s']:.0f} | {r['bringup_md_per_node']:.1f} | "
            f"{r['head_cpu_per_beat_s'] * 1000:.0f} | {r['head_loops_per_s']:.1f} | {notice} | {r['false_dead']} | "
            f"{r['beats_per_s'] / r['nominal_beats_per_s']:.2f} | {len(r['worker_ended_early'])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds of steady state counted (after a 5 s warm-up)")
    parser.add_argument("--baseline", default=None,
                        help="a commit whose hpcrl runs the same simulation, as `before`")
    parser.add_argument("--simulate", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="also print every result as JSON")
    args = parser.parse_args()
    if args.simulate is not None:
        print(json.dumps(simulate(args.simulate, args.window)))
        return 0
    with tempfile.TemporaryDirectory(prefix="hpcrl-ctl-trees-") as d:
        trees = {"after": REPO}
        if args.baseline:
            trees = {"before": baseline_tree(args.baseline, Path(d)), **trees}
        results: list[tuple[str, dict[str, Any]]] = []
        for n in args.nodes:
            for label, tree in trees.items():
                results.append((label, run_tree(tree, n, args.window)))
                print(f"N={n} {label}: {results[-1][1]['elapsed_s']} s", file=sys.stderr,
                      flush=True)
    print("| N | code | heartbeat writers md op/s | md op per node per 10 s | head watch "
          "md op/s | workers' watch md op/s (N-1 x one) | bring-up md op per node | head CPU "
          "ms per 2 s | head loops/s (10 due) | dead node named after s | nodes wrongly named dead | beats done / due | "
          "head wrongly taken for dead by the worker |")
    print("| --- |" * 1 + " --- |" * 12)
    for label, r in results:
        print(row(label, r))
    if args.baseline:
        print("\nratios before / after, same run:")
        for n in args.nodes:
            b = next(r for lab, r in results if lab == "before" and r["nodes"] == n)
            a = next(r for lab, r in results if lab == "after" and r["nodes"] == n)
            parts = []
            for key, name in (("writers_md_per_s", "heartbeat md ops"),
                              ("head_md_per_s", "head watch md ops"),
                              ("workers_md_per_s", "workers' watch md ops"),
                              ("head_cpu_per_beat_s", "head CPU")):
                parts.append(f"{name} {b[key] / a[key]:.1f}x" if a[key] else f"{name} "
                             f"{b[key]:.0f} -> 0")
            print(f"  N={n}: " + ", ".join(parts))
    print("\nheartbeat writers' operations per second by kind:")
    for label, r in results:
        print(f"  N={r['nodes']} {label}: {r['writers_by_op']}")
    if args.json:
        for _, r in results:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
