"""A rank killed for memory, named: which process, on which node, holding how much, against
which limit, and what to change.

Two killers end a rank for memory without the rank saying anything:

- **Ray's memory monitor** kills a worker when its node's memory use passes
  `RAY_memory_usage_threshold` (0.95 by default) and the task's caller gets
  `ray.exceptions.OutOfMemoryError`, whose text names the node's use and limit and the process
  killed (`pid=..., actual memory used=...GB`). :func:`parse_ray_oom` reads it.
- **The kernel's OOM killer** (the job's cgroup past `memory.max`, Slurm's `--mem`, or the node
  out of memory) sends SIGKILL: Ray sees only a dead actor. The cgroup's `memory.events` counts
  it (`oom_kill`), and the kernel log names the process (`Killed process <pid> (<name>) ...
  anon-rss:<kB>`), where it can be read. :func:`oom_kills` and :func:`parse_kernel_kill` read them.

:func:`describe` turns either into one sentence with the fix. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryDeath", "cgroup_dir", "describe", "kernel_death", "memory_limit_gb", "oom_kills", "parse_kernel_kill",
           "parse_ray_oom"]

GB = 1e9  # Ray prints decimal gigabytes


@dataclass(frozen=True)
class MemoryDeath:
    """What is known of one kill for memory."""

    killer: str
    """`Ray's memory monitor` or `the kernel's OOM killer`."""
    pid: int | None = None
    process: str | None = None
    resident_gb: float | None = None
    """The process's memory when it was killed (Ray: `actual memory used`; kernel: anon-rss)."""
    node: str | None = None
    node_used_gb: float | None = None
    node_limit_gb: float | None = None
    threshold: str | None = None
    """Ray's kill threshold, as it says it (`25.0% of 25276502016B limit`)."""


_RAY_NODE = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [0-9a-f]+\) was ([\d.]+)GB used / ([\d.]+)GB limit")
_RAY_REASON = re.compile(r"exceeded threshold of \d+B \(([^)]*)\)")
_RAY_KILLED = re.compile(r"Selected to kill: \(.*?task name=([^,]+),.*?pid=(\d+), actual memory used=([\d.]+)GB")
_KERNEL = re.compile(r"Killed process (\d+) \(([^)]*)\).*?anon-rss:(\d+)kB")
_KERNEL_WHY = re.compile(r"oom-kill:constraint=(\w+),.*?oom_memcg=([^,]*),.*?pid=(\d+)")


def parse_ray_oom(text: str) -> MemoryDeath | None:
    """The kill Ray's memory monitor describes in `text` (an `OutOfMemoryError`'s message, or an
    actor's death cause that carries it); None when `text` is no such message."""
    node = _RAY_NODE.search(text)
    if node is None:
        return None
    killed = _RAY_KILLED.search(text)
    reason = _RAY_REASON.search(text)
    pid = int(killed.group(2)) if killed else None
    process = killed.group(1).strip() if killed else None
    if pid is not None:  # the top memory users' table names what the process ran (`ray::Actor.method`)
        row = re.search(rf"^{pid}\t[\d.]+\t(.+)$", text, re.MULTILINE)
        process = row.group(1).strip() if row else process
    return MemoryDeath(
        killer="Ray's memory monitor", node=node.group(1), node_used_gb=float(node.group(2)),
        node_limit_gb=float(node.group(3)), threshold=reason.group(1) if reason else None,
        pid=pid, process=process, resident_gb=float(killed.group(3)) if killed else None)


def parse_kernel_kill(log: str, pid: int) -> MemoryDeath | None:
    """The kernel log's line for the OOM kill of `pid` (`Killed process <pid> (<name>) ...
    anon-rss:<kB>kB ...`), the newest one; None when there is none."""
    found = [m for m in _KERNEL.finditer(log) if int(m.group(1)) == pid]
    if not found:
        return None
    m = found[-1]
    why = [w for w in _KERNEL_WHY.finditer(log) if int(w.group(3)) == pid]
    memcg = why[-1].group(2) if why and why[-1].group(1) == "CONSTRAINT_MEMCG" else None
    return MemoryDeath(killer="the kernel's OOM killer", pid=pid, process=m.group(2),
                       resident_gb=int(m.group(3)) * 1024 / GB, threshold=f"cgroup {memcg}" if memcg else None)


def kernel_death(pid: int, host: str) -> MemoryDeath | None:
    """The kernel's OOM kill of process `pid`, when it ran on this host and the kernel log is
    readable here (`dmesg`: root or CAP_SYSLOG); None otherwise."""
    import socket
    import subprocess

    if host != socket.gethostname():
        return None
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    death = parse_kernel_kill(log, pid)
    if death is None:
        return None
    # the limit the kernel enforced: the cgroup it names (a job's `--mem`), else the node's memory
    memcg = death.threshold[len("cgroup "):] if death.threshold else None
    limit = memory_limit_gb(memcg_path(memcg)) if memcg else memory_limit_gb(None)
    return MemoryDeath(death.killer, death.pid, death.process, death.resident_gb, node=host, node_limit_gb=limit,
                       threshold=death.threshold)


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


def memory_limit_gb(cgroup: Path | None) -> float | None:
    """The memory limit a process there lives under: its cgroup's (v2 `memory.max`, v1
    `memory.limit_in_bytes`), else the node's `MemTotal`."""
    try:
        total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:"))
    except (OSError, ValueError, IndexError, StopIteration):
        total = None
    if cgroup is not None:
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                raw = (cgroup / name).read_text().strip()
            except OSError:
                continue
            if raw.isdigit() and (total is None or int(raw) < total):  # v1 writes "no limit" as a huge number
                return int(raw) / GB
    return total / GB if total is not None else None


FIX = ("lower the memory a rank holds (`actor_rollout_ref.actor.fsdp_config.param_offload=false` keeps "
       "the weights off the host; fewer rollout rows or a shorter `data.max_response_length` per rank; "
       "`reward_model` or a critic on a node of its own), or give the job more (`slurm.mem` in the site "
       "profile); `python -m trainer --plan-memory <overrides>` shows the host figure per node")


def describe(death: MemoryDeath) -> str:
    """One sentence: who killed which process where, holding how much against which limit; and
    the fix."""
    proc = f"process {death.pid}" + (f" ({death.process})" if death.process else "") if death.pid else "its process"
    held = f" holding {death.resident_gb:.2f} GB" if death.resident_gb is not None else ""
    node = ""
    if death.node_used_gb is not None and death.node_limit_gb is not None:
        node = (f"; node {death.node} used {death.node_used_gb:.2f} GB of {death.node_limit_gb:.2f} GB"
                + (f" (kill threshold {death.threshold})" if death.threshold else ""))
    elif death.node_limit_gb is not None:
        where = f"its {death.threshold}" if death.threshold else f"node {death.node}" if death.node else "the node"
        node = f"; the limit of {where} is {death.node_limit_gb:.2f} GB"
    return f"was killed for memory by {death.killer}: {proc}{held}{node}. Fix: {FIX}"
