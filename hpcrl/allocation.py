"""What Slurm granted this job on this node, and the Ray resources that follow from it.

Ray sizes a node from the whole machine by default (`os.cpu_count()`, every GPU, the node's free
memory): a job given 16 of 128 cores, or 4 of 8 GPUs, would oversubscribe and collide with its
neighbours. Each node agent therefore computes an :class:`Allocation` and passes it to
`ray start` (`--num-cpus`, `--num-gpus`, `--memory`, `--object-store-memory`).

Every quantity is the smallest of what its sources say:

- CPUs: `SLURM_CPUS_ON_NODE`, the cgroup's cpuset (`cpuset.cpus.effective`), the cgroup's CPU
  quota (`cpu.max`; v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`, rounded down, at least 1), the
  node's CPU count.
- GPUs: the visible-device lists (`CUDA_VISIBLE_DEVICES`, `ROCR_VISIBLE_DEVICES`,
  `HIP_VISIBLE_DEVICES`; AMD nodes use ROCR/HIP), Slurm's ids (`SLURM_STEP_GPUS`, else
  `SLURM_JOB_GPUS`) and count (`SLURM_GPUS_ON_NODE`). The device ids are the shortest visible list
  (what Slurm set for the step, renumbered where it constrains devices), else Slurm's ids, else
  `0..n-1`; the lists are exported cut to the count with `CUDA_VISIBLE_DEVICES` and
  `HIP_VISIBLE_DEVICES` naming the same devices (`hpcrl.devices.node_visible_env`: Ray on AMD
  reads HIP's, vLLM on ROCm refuses two different lists; `ROCR_VISIBLE_DEVICES` stays the filter
  beneath). Inside a Slurm job without any of these the job has no GPU (0); outside Slurm the
  count is left to Ray (None).
- Memory: `SLURM_MEM_PER_NODE`, `SLURM_MEM_PER_CPU` x CPUs, `SLURM_MEM_PER_GPU` x GPUs (MiB), the
  cgroup's `memory.max` (v1 `memory.limit_in_bytes`; the smallest along the cgroup's ancestors),
  the node's available memory (`MemAvailable`).
- Object store: 30% of the memory (Ray's default share), at most 200 GB, at least 75 MiB, and no
  more than 10 GB unless `/dev/shm` holds more (Ray refuses a larger store on slow storage).
  Ray's `memory` resource (task and actor heap) is the memory less the object store, as Ray's own
  default is.

A profile's `ray.num_cpus`, `ray.num_gpus`, `ray.memory` and `ray.object_store_memory` replace
the derived value (null: derive it). All file reads go through :class:`CgroupFiles`, whose root
the tests point at a fake tree.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.devices import DEVICE_VARS, DeviceError, id_list, node_visible_env

OBJECT_STORE_SHARE = 0.3
"""Ray's default share of memory for the object store."""
OBJECT_STORE_MAX = 200 * 10**9
"""Ray's default cap of the object store."""
OBJECT_STORE_MIN = 75 * 1024**2
"""The smallest object store Ray starts with."""
SLOW_STORAGE_LIMIT = 10**10
"""Ray refuses an object store larger than this that does not fit in /dev/shm."""
MIB = 1024**2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNLIMITED_V1 = 2**62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything above this is no limit."""


class AllocationError(ValueError):
    """A variable, cgroup file or profile value that does not describe an allocation."""


def parse_size(value: Any, where: str) -> int:
    """`64G`, `512M`, `1.5T`, `1000000` (bytes) -> bytes; K/M/G/T are powers of 1024, as in
    Slurm's `--mem` (`GiB`, `GB` mean the same)."""
    if isinstance(value, bool):
        raise AllocationError(f"`{where}` is {value!r}, not a size; write e.g. `64G` or `512M`")
    m = _SIZE.match(str(value))
    if not m:
        raise AllocationError(
            f"`{where}` is {value!r}, not a size; write bytes or a number with K, M, G or T "
            "(powers of 1024), e.g. `64G`"
        )
    number, unit = float(m.group(1)), m.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def parse_cpu_list(text: str, where: str) -> list[int]:
    """`0-3,8,10-11` (cpuset and Slurm syntax) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise AllocationError(f"`{where}` is {text.strip()!r}, not a list like `0-3,8`")
        out.extend(range(int(lo), int(hi if sep else lo) + 1))
    return out


def _whole(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    # Slurm writes SLURM_CPUS_ON_NODE and friends as a plain number; SLURM_GPUS_ON_NODE too
    if not raw.isdigit():
        raise AllocationError(f"`{name}` is {raw!r}, expected a whole number of at least 0")
    return int(raw)


def _id_list(env: Mapping[str, str], name: str) -> list[str] | None:
    try:
        return id_list(env, name)
    except DeviceError as err:
        raise AllocationError(str(err)) from None


def _slurm_gpu_ids(env: Mapping[str, str], name: str) -> list[str] | None:
    """`SLURM_JOB_GPUS`/`SLURM_STEP_GPUS`: `0,1`, and in some versions ranges `0-3`."""
    raw = env.get(name)
    if raw is None:
        return None
    if not raw.strip():
        return []
    return [str(i) for i in parse_cpu_list(raw, name)]


@dataclass(frozen=True)
class RayOverrides:
    """The profile's `ray.num_cpus`, `ray.num_gpus`, `ray.memory`, `ray.object_store_memory`
    (bytes); None: derive from the allocation."""

    num_cpus: int | None = None
    num_gpus: int | None = None
    memory: int | None = None
    object_store_memory: int | None = None

    @classmethod
    def from_profile(cls, ray: Mapping[str, Any], where: str = "ray") -> RayOverrides:
        values: dict[str, int | None] = {}
        for key in ("num_cpus", "num_gpus"):
            raw = ray.get(key)
            if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 0):
                raise AllocationError(f"`{where}.{key}` is {raw!r}; expected a whole number "
                                      "of at least 0, or null to use what Slurm granted")
            values[key] = raw
        for key in ("memory", "object_store_memory"):
            raw = ray.get(key)
            values[key] = None if raw is None else parse_size(raw, f"{where}.{key}")
        store, memory = values["object_store_memory"], values["memory"]
        if store is not None and store < OBJECT_STORE_MIN:
            raise AllocationError(f"`{where}.object_store_memory` is {store} bytes; Ray needs at "
                                  f"least {OBJECT_STORE_MIN // MIB}M")
        if store is not None and memory is not None and store >= memory:
            raise AllocationError(f"`{where}.object_store_memory` ({store} bytes) must be less "
                                  f"than `{where}.memory` ({memory} bytes): the store is part of it")
        return cls(**values)


class CgroupFiles:
    """The one place the allocation reads files: this process's cgroup (v2, or v1 controllers),
    `/proc/meminfo` and `/dev/shm`, all under `root` (a fake tree in tests)."""

    def __init__(self, root: Path = Path("/"), proc_cgroup: str = "proc/self/cgroup") -> None:
        self.root = Path(root)
        self.proc_cgroup = proc_cgroup

    def _text(self, path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:  # missing, unreadable, or not a file: this source says nothing
            return None

    def _memberships(self) -> dict[str, str]:
        """controller (`""` for v2) -> this process's cgroup path."""
        text = self._text(self.root / self.proc_cgroup) or ""
        out: dict[str, str] = {}
        for line in text.splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                out[parts[1]] = parts[2]
        return out

    def _dirs(self, controller: str) -> list[Path]:
        """This process's cgroup directory for `controller` and its ancestors up to the mount,
        innermost first (empty when the controller is not mounted)."""
        members = self._memberships()
        base = self.root / "sys/fs/cgroup"
        if controller == "":  # v2: the unified mount, or its hybrid place
            mount = base if (base / "cgroup.controllers").exists() else base / "unified"
            rel = members.get("")
        else:
            key = next((k for k in members if controller in k.split(",")), None)
            mount = base / (key or controller)
            rel = members.get(key) if key else None
        if rel is None or not mount.is_dir():
            return []
        here = mount / rel.lstrip("/")
        if not here.is_dir():  # a cgroup namespace hides the path: the mount is our cgroup
            here = mount
        dirs = [here]
        while here != mount and mount in here.parents:
            here = here.parent
            dirs.append(here)
        return dirs

    def cpuset(self) -> tuple[str, str] | None:
        """(file, CPU list) this process may run on."""
        for controller, names in (("", ("cpuset.cpus.effective",)),
                                  ("cpuset", ("cpuset.effective_cpus", "cpuset.cpus"))):
            for d in self._dirs(controller)[:1]:
                for name in names:
                    text = self._text(d / name)
                    if text:
                        return str(d / name), text
        return None

    def cpu_quota(self) -> tuple[str, float] | None:
        """(file, CPUs) of the tightest CPU bandwidth limit, None without one."""
        best: tuple[str, float] | None = None
        for d in self._dirs(""):
            text = self._text(d / "cpu.max")
            if text and not text.startswith("max"):
                quota, _, period = text.partition(" ")
                best = _tighter(best, str(d / "cpu.max"),
                                _ratio(quota, period or "100000", str(d / "cpu.max")))
        for d in self._dirs("cpu"):
            v1_quota, v1_period = (self._text(d / "cpu.cfs_quota_us"),
                                   self._text(d / "cpu.cfs_period_us"))
            if v1_quota and v1_period and not v1_quota.startswith("-"):
                where = str(d / "cpu.cfs_quota_us")
                best = _tighter(best, where, _ratio(v1_quota, v1_period, where))
        return best

    def memory_limit(self) -> tuple[str, int] | None:
        """(file, bytes) of the tightest memory limit along the cgroup's ancestors."""
        best: tuple[str, float] | None = None
        for controller, name in (("", "memory.max"), ("memory", "memory.limit_in_bytes")):
            for d in self._dirs(controller):
                text = self._text(d / name)
                if not text or text == "max":
                    continue
                if not text.isdigit():
                    raise AllocationError(f"`{d / name}` holds {text!r}, not a number of bytes")
                if int(text) < _UNLIMITED_V1:
                    best = _tighter(best, str(d / name), int(text))
        return None if best is None else (best[0], int(best[1]))

    def mem_available(self) -> int | None:
        """The node's available memory (`MemAvailable`, else `MemTotal`), bytes."""
        text = self._text(self.root / "proc/meminfo") or ""
        found = dict(re.findall(r"^(MemAvailable|MemTotal):\s+(\d+)\s*kB", text, re.MULTILINE))
        kib = found.get("MemAvailable") or found.get("MemTotal")
        return int(kib) * 1024 if kib else None

    def shm_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.root / "dev/shm")
        except OSError:
            return None
        return st.f_blocks * st.f_frsize


def _ratio(quota: str, period: str, where: str) -> float:
    try:
        return max(1.0, math.floor(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        raise AllocationError(f"`{where}` holds quota {quota!r} / period {period!r}, not two "
                              "whole numbers") from None


def _tighter(best: tuple[str, float] | None, where: str, value: float) -> tuple[str, float]:
    return (where, value) if best is None or value < best[1] else best


@dataclass(frozen=True)
class Allocation:
    """What Ray gets on this node, and why (`sources`: quantity -> the source that set it)."""

    cpus: int
    gpus: int | None
    """None: outside Slurm with no device list; Ray counts the node's GPUs itself."""
    gpu_ids: tuple[str, ...]
    memory_bytes: int
    """Everything Ray may use on the node: its `memory` resource plus the object store."""
    object_store_bytes: int
    device_env: Mapping[str, str] = field(default_factory=dict)
    """Visible-device variables for Ray and the payload."""
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def heap_bytes(self) -> int:
        """Ray's `memory` resource: the memory less the object store."""
        return self.memory_bytes - self.object_store_bytes

    def ray_start_args(self) -> list[str]:
        args = [f"--num-cpus={self.cpus}"]
        if self.gpus is not None:
            args.append(f"--num-gpus={self.gpus}")
        return [*args, f"--memory={self.heap_bytes}",
                f"--object-store-memory={self.object_store_bytes}"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpus": self.cpus,
            "gpus": self.gpus,
            "gpu_ids": list(self.gpu_ids),
            "memory_bytes": self.memory_bytes,
            "object_store_bytes": self.object_store_bytes,
            "heap_bytes": self.heap_bytes,
            "sources": dict(self.sources),
        }

    def describe(self) -> str:
        gpus = "GPUs: Ray detects" if self.gpus is None else (
            f"{self.gpus} GPU(s)" + (f" [{','.join(self.gpu_ids)}]" if self.gpu_ids else ""))
        why = "; ".join(f"{k} from {v}" for k, v in self.sources.items())
        return (f"{self.cpus} CPU(s), {gpus}, memory {self.memory_bytes // MIB} MiB "
                f"(object store {self.object_store_bytes // MIB} MiB) [{why}]")


def _smallest(found: list[tuple[str, float]]) -> tuple[str, float]:
    return min(found, key=lambda item: item[1])


def _cpus(env: Mapping[str, str], files: CgroupFiles, node_cpus: int) -> tuple[str, int]:
    found: list[tuple[str, float]] = [("the node's CPU count", node_cpus)]
    on_node = _whole(env, "SLURM_CPUS_ON_NODE")
    if on_node is not None:
        found.append(("SLURM_CPUS_ON_NODE", on_node))
    cpuset = files.cpuset()
    if cpuset:
        found.append((cpuset[0], len(parse_cpu_list(cpuset[1], cpuset[0]))))
    quota = files.cpu_quota()
    if quota:
        found.append(quota)
    where, value = _smallest(found)
    if value < 1:
        raise AllocationError(f"{where} says this job has {value:g} CPUs on the node; Ray needs "
                              "at least 1 (set `ray.num_cpus` to override)")
    return where, int(value)


def _gpus(env: Mapping[str, str], in_slurm: bool
          ) -> tuple[str | None, int | None, list[str], dict[str, str]]:
    """(source, count, ids, device variables to export)."""
    visible = {name: ids for name in DEVICE_VARS if (ids := _id_list(env, name)) is not None}
    slurm_name = next((n for n in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS") if env.get(n) is not None),
                      None)
    slurm_ids = _slurm_gpu_ids(env, slurm_name) if slurm_name else None
    on_node = _whole(env, "SLURM_GPUS_ON_NODE")
    counts: list[tuple[str, float]] = [(n, len(ids)) for n, ids in visible.items()]
    if slurm_ids is not None and slurm_name:
        counts.append((slurm_name, len(slurm_ids)))
    if on_node is not None:
        counts.append(("SLURM_GPUS_ON_NODE", on_node))
    if not counts:
        return ("no GPU in the allocation", 0, [], {}) if in_slurm else (None, None, [], {})
    where, value = _smallest(counts)
    count = int(value)
    if visible:
        ids = min(visible.values(), key=len)
    elif slurm_ids is not None:
        ids = slurm_ids
    else:
        ids = [str(i) for i in range(count)]
    ids = ids[:count]
    try:
        export = node_visible_env({n: v[:count] for n, v in visible.items()}, ids)
    except DeviceError as err:
        raise AllocationError(str(err)) from None
    return where, count, ids, export


def _memory(env: Mapping[str, str], files: CgroupFiles, cpus: int, gpus: int | None
            ) -> tuple[str, int]:
    found: list[tuple[str, float]] = []
    per_node = _whole(env, "SLURM_MEM_PER_NODE")
    if per_node:  # 0 means "all of the node's memory"
        found.append(("SLURM_MEM_PER_NODE", per_node * MIB))
    per_cpu = _whole(env, "SLURM_MEM_PER_CPU")
    if per_cpu:
        slurm_cpus = _whole(env, "SLURM_CPUS_ON_NODE") or cpus
        found.append((f"SLURM_MEM_PER_CPU x {slurm_cpus} CPUs", per_cpu * MIB * slurm_cpus))
    per_gpu = _whole(env, "SLURM_MEM_PER_GPU")
    if per_gpu and gpus:
        found.append((f"SLURM_MEM_PER_GPU x {gpus} GPUs", per_gpu * MIB * gpus))
    limit = files.memory_limit()
    if limit:
        found.append(limit)
    available = files.mem_available()
    if available:
        found.append(("the node's available memory", available))
    if not found:
        raise AllocationError("cannot tell this node's memory: no Slurm memory variable, no "
                              "cgroup limit and no /proc/meminfo; set `ray.memory`")
    where, value = _smallest(found)
    return where, int(value)


def default_object_store(memory: int, shm: int | None) -> int:
    """Ray's default rule: 30% of the memory, at most 200 GB, at least 75 MiB, and at most 10 GB
    unless /dev/shm holds more."""
    cap = min(OBJECT_STORE_MAX, max(SLOW_STORAGE_LIMIT, int((shm or 0) * 0.95)))
    return max(OBJECT_STORE_MIN, min(int(memory * OBJECT_STORE_SHARE), cap))


def node_allocation(
    env: Mapping[str, str],
    overrides: RayOverrides = RayOverrides(),
    files: CgroupFiles | None = None,
    node_cpus: int | None = None,
) -> Allocation:
    """This job's allocation on this node, from Slurm's variables in `env`, the cgroup files
    (`files`) and the profile's `overrides`."""
    files = files or CgroupFiles()
    in_slurm = bool((env.get("SLURM_JOB_ID") or "").strip())
    sources: dict[str, str] = {}

    cpu_source, cpus = _cpus(env, files, node_cpus or os.cpu_count() or 1)
    sources["cpus"], derived_cpus = cpu_source, cpus
    if overrides.num_cpus is not None:
        cpus, sources["cpus"] = overrides.num_cpus, "profile ray.num_cpus"

    gpu_source, gpus, ids, device_env = _gpus(env, in_slurm)
    if gpu_source:
        sources["gpus"] = gpu_source
    if overrides.num_gpus is not None:
        gpus, sources["gpus"] = overrides.num_gpus, "profile ray.num_gpus"

    mem_source, memory = _memory(env, files, derived_cpus, gpus)
    sources["memory"] = mem_source
    if overrides.memory is not None:
        memory, sources["memory"] = overrides.memory, "profile ray.memory"

    if overrides.object_store_memory is not None:
        store, sources["object_store"] = (overrides.object_store_memory,
                                          "profile ray.object_store_memory")
    else:
        store = default_object_store(memory, files.shm_bytes())
        sources["object_store"] = f"{OBJECT_STORE_SHARE:.0%} of the memory"
    if store >= memory:
        raise AllocationError(
            f"the job's memory on this node ({memory // MIB} MiB, from {sources['memory']}) "
            f"leaves nothing beside a {store // MIB} MiB object store; ask Slurm for more "
            "(`--mem`) or set `ray.memory` / `ray.object_store_memory`"
        )
    return Allocation(cpus, gpus, tuple(ids), memory, store, device_env, sources)
