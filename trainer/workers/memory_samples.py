"""Each rank's own memory, kept where the driver reads it after the rank is dead.

A process killed for memory says nothing: SIGKILL leaves no last words, and Ray reports only a
dead actor. So each Ray rank samples itself from a daemon thread (:class:`RssSampler`, started by
:class:`~trainer.workers.ray_group.ColocatedWorker`) and keeps the newest sample in
``<trainer run dir>/memory/rank_<r>.json``:

- every ``INTERVAL_S`` (1 s) it reads ``/proc/self/status`` (``VmRSS``, the resident set now, and
  ``VmHWM``, its peak since the process started), ``/proc/self/cgroup`` and that memory cgroup's
  limit and ``oom_kill`` count: a handful of reads of small kernel files, well under a
  millisecond a second;
- it writes the file (a temporary name, then a rename: a reader never sees half a sample) only
  when the resident set has moved by ``WRITE_STEP`` (64 MiB or 2 %, the larger) since the last
  write, when the cgroup's ``oom_kill`` count or the cgroup changed, or ``HEARTBEAT_S`` (30 s)
  after the last write: a rank that holds still writes twice a minute to the shared run
  directory, one that grows writes as it grows.

The figure is the rank process's own resident set, not its children's (a vLLM engine core or a
reward worker in a process of its own is sampled by none). The driver also writes the memory
plan's host figure beside the samples (:func:`write_plan`, ``plan.json``), so the description
of a death (:mod:`trainer.workers.memory_death`) can set the two side by side. Standard library
only, torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.memplan import GIB, HOST_DRIVER, PlanError, host_plan

__all__ = ["HEARTBEAT_S", "INTERVAL_S", "MEMORY_DIR", "PLAN_FILE", "RssSampler", "Sample", "read_plan",
           "read_sample", "read_status", "take_sample", "write_plan"]

MEMORY_DIR = "memory"
"""The samples' folder in the trainer's run directory."""
PLAN_FILE = "plan.json"
INTERVAL_S = 1.0
HEARTBEAT_S = 30.0
WRITE_STEP = (64 << 20, 0.02)
"""A sample is written when the resident set moved by the larger of these (bytes, fraction)."""


@dataclass(frozen=True)
class Sample:
    """One rank's memory at one moment."""

    rank: int
    pid: int
    process: str
    """The process's title (`ray::ColocatedWorker.call`)."""
    host: str
    time: float
    """Epoch seconds of the sample."""
    rss_bytes: int
    hwm_bytes: int
    """Peak resident set since the process started (`VmHWM`)."""
    limit_bytes: int | None
    """The memory the process may hold: its memory cgroup's limit, else the node's `MemTotal`."""
    cgroup: str | None
    """Its memory cgroup's directory."""
    oom_kills: int | None
    """That cgroup's `oom_kill` count."""


def read_status(text: str) -> tuple[int, int]:
    """`(VmRSS, VmHWM)` in bytes from the text of `/proc/<pid>/status`."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, _, unit = value.strip().partition(" ")
            if unit != "kB" or not number.isdigit():
                raise ValueError(f"`{line}`: expected `{key}: <number> kB` in /proc/<pid>/status")
            found[key] = int(number) * 1024
    if len(found) < 2:
        raise ValueError("no `VmRSS` and `VmHWM` lines: not the text of /proc/<pid>/status")
    return found["VmRSS"], found["VmHWM"]


GB = 1e9  # Ray prints decimal gigabytes


def memcg_path(path: str) -> Path | None:
    """The directory of the memory cgroup the kernel names (`oom_memcg=/...`): v1's memory
    controller or v2's hierarchy, whichever has it."""
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        candidate = root / path.lstrip("/")
        if candidate.is_dir():
            return candidate
    return None


def cgroup_dir(pid: int | str = "self") -> Path | None:
    """The memory cgroup directory of process `pid`: cgroup v2's (`0::` in `/proc/<pid>/cgroup`),
    else v1's memory controller's (`N:memory:`)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def oom_kills(cgroup: Path | None) -> int | None:
    """The OOM kills counted in a memory cgroup: v2's `memory.events`, v1's `memory.oom_control`
    (`oom_kill N`); None when neither is readable."""
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def memory_limit_bytes(cgroup: Path | None) -> int | None:
    """The memory limit a process there lives under: the lowest of its cgroup's and its
    ancestors' (v2 `memory.max`, v1 `memory.limit_in_bytes`: Slurm sets the job's, above the
    step's and the task's), else the node's `MemTotal`."""
    try:
        total: int | None = next(int(line.split()[1]) * 1024 for line in
                                 Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    except (OSError, ValueError, IndexError, StopIteration):
        total = None
    limits = [total] if total is not None else []
    for folder in [cgroup, *cgroup.parents] if cgroup is not None else []:
        if folder in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory"), Path("/")):
            break
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                raw = (folder / name).read_text().strip()
            except OSError:
                continue
            if raw.isdigit():  # v2 writes no limit as `max`, v1 as a huge number (the minimum drops it)
                limits.append(int(raw))
    return min(limits) if limits else None


def memory_limit_gb(cgroup: Path | None) -> float | None:
    """:func:`memory_limit_bytes` in (decimal) GB."""
    limit = memory_limit_bytes(cgroup)
    return limit / GB if limit is not None else None


def _title() -> str:
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.split(b"\0")[0].decode(errors="replace").strip() or "?"


def take_sample(rank: int) -> Sample:
    """This process's memory now."""
    rss, hwm = read_status(Path("/proc/self/status").read_text())
    cgroup = cgroup_dir()
    return Sample(rank=rank, pid=os.getpid(), process=_title(), host=socket.gethostname(), time=time.time(),
                  rss_bytes=rss, hwm_bytes=hwm, limit_bytes=memory_limit_bytes(cgroup),
                  cgroup=str(cgroup) if cgroup else None, oom_kills=oom_kills(cgroup))


def sample_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}.json"


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_sample(folder: Path | None, rank: int) -> Sample | None:
    """The newest sample rank `rank` wrote into `folder`; None when there is none (or it cannot
    be read)."""
    if folder is None:
        return None
    try:
        return Sample(**json.loads(sample_path(folder, rank).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class RssSampler(threading.Thread):
    """The sampling thread of one rank (see the module's note); a daemon, so it never holds the
    process up."""

    def __init__(self, folder: Path, rank: int, interval_s: float = INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        super().__init__(name=f"hpcrl-rss-rank{rank}", daemon=True)
        self.folder, self.rank = folder, rank
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.stopped = threading.Event()
        self.written: Sample | None = None

    def due(self, now: Sample) -> bool:
        """Whether `now` differs enough from the last written sample to be written."""
        last = self.written
        if last is None:
            return True
        step = max(WRITE_STEP[0], WRITE_STEP[1] * last.rss_bytes)
        return (abs(now.rss_bytes - last.rss_bytes) >= step or now.oom_kills != last.oom_kills
                or now.cgroup != last.cgroup or now.time - last.time >= self.heartbeat_s)

    def sample_once(self) -> None:
        now = take_sample(self.rank)
        if self.due(now):
            _write_json(sample_path(self.folder, self.rank), asdict(now))
            self.written = now

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.sample_once()
            except (OSError, ValueError):  # a run directory gone or full: the rank goes on
                pass
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()


def write_plan(folder: Path, cfg: Any, use_gpu: bool) -> dict[str, Any]:
    """The memory plan's host figure per node (:func:`trainer.memplan.host_plan`, the host phase
    `python -m trainer --plan-memory` and `hpcrl submit` check against `slurm.mem`), written to
    `folder/plan.json` for the description of a death; or why there is none (`none`)."""
    record: dict[str, Any]
    if not use_gpu:
        record = {"none": "the memory plan is made for GPU jobs, and this run has no GPU"}
    else:
        try:
            phase = host_plan(cfg)
        except (PlanError, OSError, ValueError, KeyError) as err:
            record = {"none": f"it could not be made: {err}"}
        else:
            head = sum(b for _, b in phase.terms)
            record = {"head": socket.gethostname(), "head_gib": round(head / GIB, 2),
                      "node_gib": round((head - HOST_DRIVER) / GIB, 2)}
    _write_json(folder / PLAN_FILE, record)
    return record


def read_plan(folder: Path | None) -> dict[str, Any] | None:
    """What :func:`write_plan` wrote; None when nothing was."""
    if folder is None:
        return None
    try:
        record = json.loads((folder / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
