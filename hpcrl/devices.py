"""Which GPUs a node and a worker process see: the visible-device variables of NVIDIA and AMD,
and Ray's accelerator ids. Pure functions over the variables (no torch, no ray).

The runtimes read:

- NVIDIA: `CUDA_VISIBLE_DEVICES`.
- AMD (ROCm): `ROCR_VISIBLE_DEVICES` first, a filter over the node's devices, which renumbers
  what it leaves from 0; then `HIP_VISIBLE_DEVICES` (or `CUDA_VISIBLE_DEVICES`, which HIP honours
  too) indexes into what ROCR left.
- Ray (>= 2.45) reads the node's list from, and writes each actor's ids into,
  `CUDA_VISIBLE_DEVICES` on NVIDIA and `HIP_VISIBLE_DEVICES` on AMD (it refuses
  `ROCR_VISIBLE_DEVICES` without `HIP_VISIBLE_DEVICES`), unless
  `RAY_EXPERIMENTAL_NOSET_<VAR>=1`; its ids are entries of the node's list (physical indexes
  when the node has none).
- vLLM on ROCm refuses `HIP_VISIBLE_DEVICES` different from `CUDA_VISIBLE_DEVICES`.

Hence one rule for both vendors: `CUDA_VISIBLE_DEVICES` and `HIP_VISIBLE_DEVICES` always name
the same list, and `ROCR_VISIBLE_DEVICES`, when set, stays the filter beneath them.
:func:`node_visible_env` applies it to what Slurm set on a node (the node agent exports it before
`ray start`); :func:`worker_device` applies it in each worker process to Ray's id and picks the
torch device index (also `LOCAL_RANK`, which vLLM's `external_launcher` reads): never an
inherited `LOCAL_RANK`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DEVICE_VARS", "NOSET_VARS", "RAY_DEVICE_VARS", "DeviceError", "WorkerDevice",
           "id_list", "node_visible_env", "worker_device"]

CUDA, HIP, ROCR = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"
DEVICE_VARS = (CUDA, ROCR, HIP)
"""The variables naming the GPUs a process may use (NVIDIA; AMD's ROCm runtime and HIP)."""
Vendor = Literal["nvidia", "amd"]
RAY_DEVICE_VARS: dict[str, str] = {"nvidia": CUDA, "amd": HIP}
"""The variable Ray reads on a node and sets per actor, by GPU vendor."""
NOSET_VARS: dict[str, str] = {"nvidia": "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
                              "amd": "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"}
"""The variable that stops Ray from setting the vendor's list per actor."""


class DeviceError(ValueError):
    """Device variables or Ray ids that do not name one usable GPU."""


def id_list(environ: Mapping[str, str], name: str) -> list[str] | None:
    """The device list in `environ[name]` such as `0,1,3` (None when unset). `NoDevFiles`
    (Slurm's word for none) and an empty value mean no device."""
    raw = environ.get(name)
    if raw is None:
        return None
    raw = raw.strip()
    if raw in ("", "NoDevFiles"):
        return []
    ids = [p.strip() for p in raw.split(",")]
    if any(not p or not re.fullmatch(r"[A-Za-z0-9_:.-]+", p) for p in ids):
        raise DeviceError(f"`{name}` is {raw!r}; expected device ids separated by commas, e.g. `0,1,3`")
    return ids


def node_visible_env(visible: Mapping[str, list[str]], ids: Sequence[str]) -> dict[str, str]:
    """The visible-device variables a node exports, from the lists set on it (`visible`, each
    already cut to the granted count) or, with none set, the granted device `ids`.

    `CUDA_VISIBLE_DEVICES` = `HIP_VISIBLE_DEVICES`; with `ROCR_VISIBLE_DEVICES` (kept) that list
    numbers the devices ROCR leaves (HIP's own list, else `0..n-1`: a `CUDA_VISIBLE_DEVICES` set
    beside ROCR names devices in the other numbering and is replaced)."""
    rocr, hip, cuda = visible.get(ROCR), visible.get(HIP), visible.get(CUDA)
    if rocr is not None:
        listed = hip if hip is not None else [str(i) for i in range(len(rocr))]
        return {ROCR: ",".join(rocr), CUDA: ",".join(listed), HIP: ",".join(listed)}
    if hip is not None and cuda is not None and hip != cuda:
        raise DeviceError(
            f"`{HIP}={','.join(hip)}` and `{CUDA}={','.join(cuda)}` name different devices; AMD's "
            f"runtime and vLLM need one list. Fix: set only one of them (or the same list in both)")
    listed = hip if hip is not None else cuda if cuda is not None else list(ids)
    return {CUDA: ",".join(listed), HIP: ",".join(listed)} if listed or visible else {}


def _on(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class WorkerDevice:
    """The GPU of one worker process."""

    ray_id: str
    """Ray's accelerator id (an entry of the node's list, or a physical index)."""
    index: int
    """The torch device index in this process (`cuda:<index>`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables to set before CUDA/HIP starts: the lists (CUDA = HIP) and `LOCAL_RANK`."""


def worker_device(environ: Mapping[str, str], ray_ids: Sequence[str], vendor: Vendor) -> WorkerDevice:
    """The device of a worker process given Ray's GPU ids for it (`get_accelerator_ids()`).

    Ray sets the vendor's variable to the ids (`RAY_DEVICE_VARS`): the process sees its GPU
    alone, index 0. With `NOSET_VARS[vendor]` on, the process keeps the node's list (on AMD,
    HIP's, else CUDA's), and the index is the id's position in it (the id itself without a
    list)."""
    if vendor not in RAY_DEVICE_VARS:
        raise DeviceError(f"unknown GPU vendor {vendor!r}; known: {', '.join(RAY_DEVICE_VARS)}")
    if len(ray_ids) != 1:
        raise DeviceError(
            f"Ray gave this worker {len(ray_ids)} GPU ids ({', '.join(ray_ids) or 'none'}); a "
            "worker uses exactly one GPU. Fix: place each worker in a bundle of one GPU and ask "
            "it for `num_gpus=1`")
    ray_id = ray_ids[0]
    var, noset = RAY_DEVICE_VARS[vendor], NOSET_VARS[vendor]
    if not _on(environ, noset):
        listed: list[str] | None = [ray_id]
    else:
        listed = id_list(environ, var)
        if listed is None and vendor == "amd":
            listed = id_list(environ, CUDA)
    if listed is None:
        if not ray_id.isdigit():
            raise DeviceError(f"Ray's GPU id {ray_id!r} is not an index and `{var}` is unset; "
                              f"Fix: unset `{noset}` or set `{var}` on the node")
        index = int(ray_id)
    elif ray_id in listed:
        index = listed.index(ray_id)
    else:
        raise DeviceError(
            f"Ray gave this worker GPU {ray_id}, which `{var}={','.join(listed)}` (`{noset}=1`) "
            f"does not list. Fix: leave `{var}` of the Ray workers as the node set it, or unset "
            f"`{noset}` so that Ray sets it per worker")
    env = {"LOCAL_RANK": str(index)}
    if listed is not None:
        env[CUDA] = env[HIP] = ",".join(listed)
    return WorkerDevice(ray_id=ray_id, index=index, env=env)
