"""A function run on given nodes of the Ray cluster, by the node's address: what only a rank's
own node can read (its processes' states, its kernel log, its cgroups' counters)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["run_on_nodes"]


def run_on_nodes(fn: Callable[..., Any], calls: Mapping[str, tuple[Any, ...]], timeout: float) -> dict[str, Any]:
    """`fn(*args)` on each node (by its address, Ray's `NodeManagerAddress`) of `calls`, as Ray
    tasks pinned to them (no CPU asked: the node's slots may all be taken by the run's ranks), all
    at once. The result by address; a node not alive in the cluster, or that raises or does not
    answer within `timeout` seconds, is left out."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = {n.get("NodeManagerAddress"): n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    task = ray.remote(num_cpus=0)(fn)
    refs = {ip: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[ip], soft=False)).remote(*args)
            for ip, args in calls.items() if ip in ids}
    deadline = time.monotonic() + timeout
    out: dict[str, Any] = {}
    for ip, ref in refs.items():
        try:
            out[ip] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a node that raises or does not answer: left out
            pass
    return out
