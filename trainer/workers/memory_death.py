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

Both are read on the rank's own node (its kernel log, its cgroup), by a Ray task there when the
rank ran on another node than the driver's. Where neither names the kill (the kernel log
unreadable: not root), the rank's own samples (:mod:`trainer.workers.memory_samples`) still tell: a rise of its cgroup's
`oom_kill` count after its last sample is the kernel's kill (:func:`counter_death`), and its last
resident set, peak and limit are said of any death. :func:`find_death` looks in that order;
:func:`describe` turns a kill into one sentence with the figures, the memory plan's host figure
for the node (or that the run has no plan) and the fix. Standard library only.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.workers.memory_samples import (
    GB,
    Sample,
    cgroup_dir,
    memcg_path,
    memory_limit_bytes,
    memory_limit_gb,
    oom_kills,
    read_plan,
    read_sample,
)

__all__ = ["MemoryDeath", "cgroup_dir", "counter_death", "death_details", "describe", "find_death", "kernel_death", "kernel_log", "last_seen", "local_death",
           "memory_limit_bytes", "memory_limit_gb", "oom_kills", "parse_kernel_kill", "parse_ray_oom"]



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
    """Ray's kill threshold, as it says it (`25.0% of 25276502016B limit`); for the kernel, the
    cgroup whose limit it enforced (`cgroup /slurm/...`)."""
    evidence: str | None = None
    """How the kill was known, when not from the killer's own words."""
    sample: Sample | None = None
    """The rank's last memory sample."""
    plan: Mapping[str, Any] | None = None
    """The memory plan's host figures (`memory_samples.write_plan`); None: no plan was written."""


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
    if host != socket.gethostname():
        return None
    log = kernel_log()
    death = parse_kernel_kill(log, pid) if log else None
    if death is None:
        return None
    # the limit the kernel enforced: the cgroup it names (a job's `--mem`), else the node's memory
    memcg = death.threshold[len("cgroup "):] if death.threshold else None
    limit = memory_limit_gb(memcg_path(memcg)) if memcg else memory_limit_gb(None)
    return MemoryDeath(death.killer, death.pid, death.process, death.resident_gb, node=host, node_limit_gb=limit,
                       threshold=death.threshold)


def kernel_log() -> str | None:
    """The kernel's log (`dmesg`); None where it cannot be read (no `dmesg`, not root without
    CAP_SYSLOG: `dmesg` then prints nothing to stdout)."""
    import subprocess

    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=False).stdout or None
    except (OSError, subprocess.SubprocessError):
        return None


def counter_death(sample: Sample | None) -> MemoryDeath | None:
    """The kernel's OOM kill of the sampled process, known from its cgroup's `oom_kill` count
    having risen since the rank's last sample (readable only on the rank's node); None when it
    did not rise or cannot be read here. The count is the cgroup's: a kill of another process
    of that cgroup after the sample counts too."""
    if sample is None or sample.cgroup is None or sample.oom_kills is None or sample.host != socket.gethostname():
        return None
    now = oom_kills(Path(sample.cgroup))
    if now is None or now <= sample.oom_kills:
        return None
    return MemoryDeath(killer="the kernel's OOM killer", pid=sample.pid, process=sample.process, node=sample.host,
                       evidence=f"the `oom_kill` count of its cgroup `{sample.cgroup}` rose from "
                       f"{sample.oom_kills} to {now} after its last sample")


def local_death(pid: Any, host: str, sample: Sample | None) -> MemoryDeath | None:
    """The kernel's kill of rank process `pid` on `host`, as this host can tell it: from its
    kernel log (:func:`kernel_death`), else from the rank's cgroup count (:func:`counter_death`);
    None unless this is `host`."""
    death = kernel_death(pid, host) if isinstance(pid, int) and host else None
    return death or counter_death(sample)


def find_death(text: str, actor_died: bool, node: Mapping[str, Any], samples: Path | None,
               remote: Callable[..., MemoryDeath | None] | None = None) -> MemoryDeath | None:
    """The kill for memory of the rank `node` describes (its `node_info()`: rank, hostname,
    ip, pid), from what its caller was told (`text`) and, when its actor died (`actor_died`), from
    the kernel's log and its cgroup's count, read on the rank's own node (`remote(ip, fn, *args)`
    runs :func:`local_death` there; without it only a rank on this host is read); with its last
    sample and the memory plan's figures from `samples` (the ranks' sample folder). None when
    nothing says it was killed for memory."""
    death = parse_ray_oom(text)
    sample = read_sample(samples, int(node.get("rank", -1)))
    if death is None and actor_died:
        pid, host = node.get("pid"), node.get("hostname")
        if host and host != socket.gethostname() and remote is not None:  # read where the rank ran
            death = remote(str(node.get("ip")), local_death, pid, str(host), sample)
        else:
            death = local_death(pid, str(host), sample)
    if death is None:
        return None
    limit = death.node_limit_gb
    if limit is None and sample is not None and sample.limit_bytes is not None:
        limit = sample.limit_bytes / GB
    return replace(death, node=death.node or (str(node["hostname"]) if node.get("hostname") else None),
                   node_limit_gb=limit, sample=sample, plan=read_plan(samples) if samples else None)


def _sampled(sample: Sample | None, ended: float | None = None) -> str:
    if sample is None:
        return "no memory sample of it"
    ago = f" ({ended - sample.time:.0f} s before it was found dead)" if ended is not None else ""
    limit = f" under a limit of {sample.limit_bytes / GB:.2f} GB" if sample.limit_bytes is not None else ""
    return (f"its last memory sample{ago}: {sample.rss_bytes / GB:.2f} GB resident, peak "
            f"{sample.hwm_bytes / GB:.2f} GB,{limit}").rstrip(",")


def _planned(plan: Mapping[str, Any] | None, host: str | None) -> str:
    if plan is None or "none" in plan:
        return "no memory plan for this run" + (f" ({plan['none']})" if plan else "")
    on_head = host is not None and host == plan.get("head")
    figure = plan["head_gib"] if on_head else plan["node_gib"]
    return (f"the memory plan's host figure for {'the head ' if on_head else ''}node"
            f"{f' `{host}`' if host else ''}: {figure:.2f} GiB"
            + (" (with the driver)" if on_head else f" ({plan['head_gib']:.2f} GiB on the head, with the driver)"))


def last_seen(node: Mapping[str, Any], samples: Path | None, ended: float | None = None) -> str:
    """What is known of a rank's memory before it died (any death): its last sample and the
    memory plan's host figure for its node."""
    sample = read_sample(samples, int(node.get("rank", -1)))
    host = sample.host if sample else (str(node["hostname"]) if node.get("hostname") else None)
    return f"{_sampled(sample, ended)}; {_planned(read_plan(samples) if samples else None, host)}"


NO_REQUEUE = ("A requeue would not help (the same plan on the same nodes dies the same way): the job is "
              "not requeued.")
FIX = ("lower the memory a rank holds (`actor_rollout_ref.actor.fsdp_config.param_offload=false` keeps "
       "the weights off the host; fewer rollout rows or a shorter `data.max_response_length` per rank; "
       "`reward_model` or a critic on a node of its own), or give the job more (`slurm.mem` in the site "
       "profile); `python -m trainer --plan-memory <overrides>` shows the host figure per node")


def describe(death: MemoryDeath, ended: float | None = None) -> str:
    """One sentence: who killed which process where, holding how much against which limit, the
    rank's last sample, the memory plan's host figure for the node; and the fix. `ended`: when
    the death was found (epoch seconds), to say how old the sample is."""
    proc = f"process {death.pid}" + (f" ({death.process})" if death.process else "") if death.pid else "its process"
    held = f" holding {death.resident_gb:.2f} GB" if death.resident_gb is not None else ""
    if death.evidence:
        held += f" ({death.evidence})"
    node = ""
    if death.node_used_gb is not None and death.node_limit_gb is not None:
        node = (f"; node {death.node} used {death.node_used_gb:.2f} GB of {death.node_limit_gb:.2f} GB"
                + (f" (kill threshold {death.threshold})" if death.threshold else ""))
    elif death.node_limit_gb is not None and death.threshold:
        node = f"; the limit of its {death.threshold} is {death.node_limit_gb:.2f} GB"
    elif death.node_limit_gb is not None:  # its sample's: the lowest of its cgroups' and the node's memory
        on = f" on node {death.node}" if death.node else ""
        node = f"; it lived under a limit of {death.node_limit_gb:.2f} GB{on} (its memory cgroup's, or the node's memory)"
    host = death.sample.host if death.sample else death.node
    return (f"was killed for memory by {death.killer}: {proc}{held}{node}; {_sampled(death.sample, ended)}; "
            f"{_planned(death.plan, host)}. {NO_REQUEUE} Fix: {FIX}")


def death_details(death: MemoryDeath, node: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a kill for the run's diagnosis (`diagnosis.jsonl`, kind `oom`)."""
    sample, plan = death.sample, death.plan or {}
    host = sample.host if sample else death.node
    planned = None if "none" in plan or not plan else plan["head_gib" if host == plan.get("head") else "node_gib"]
    return {"rank": node.get("rank"), "node": node.get("hostname") or death.node, "pid": death.pid,
            "process": death.process, "killer": death.killer, "resident_gb": death.resident_gb,
            "limit_gb": death.node_limit_gb, "evidence": death.evidence,
            "sampled_rss_gb": round(sample.rss_bytes / GB, 3) if sample else None,
            "sampled_peak_gb": round(sample.hwm_bytes / GB, 3) if sample else None,
            "sampled_at": sample.time if sample else None,
            "plan_host_gib": planned, "no_plan": plan.get("none") if planned is None else None}
