"""Sharded model and optimizer state of one worker group, with `torch.distributed.checkpoint`.

Every rank of a group calls :func:`save_group_state` (a collective): DCP's planner lets each rank
write only the shards it owns (an FSDP2 rank its slice of each parameter and of its Adam
moments; ranks that keep replicas write each replicated tensor once, deduplicated by the
planner) into ``<checkpoint>/<group>/`` as ``__<rank>_0.distcp`` files, and the coordinator
writes DCP's ``.metadata`` last. Loading (:func:`load_group_state`) asks for the tensors of the
*current* layout and DCP reads the overlapping saved chunks, so a checkpoint written on W ranks
loads on any W' (torchtitan's resharding). No rank gathers the full model or optimizer state.

The directory around it (temporary name, manifest last, atomic rename, latest marker) is
:mod:`trainer.checkpoint.full_state`'s; a failed write raises on every rank, so the driver
removes the temporary directory and the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DCP_METADATA",
    "CheckpointFormatError",
    "CheckpointWriteError",
    "has_group_state",
    "load_group_state",
    "out_of_space_error",
    "read_group_state",
    "require_group_state",
    "save_group_state",
    "state_bytes",
]

DCP_METADATA = ".metadata"
#: Storage errors that mean "no room here": disk full, quota, read-only, file size limit.
OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for lack of room (or write permission)."""


class CheckpointFormatError(RuntimeError):
    """A checkpoint written in a format this trainer no longer reads."""


def _storage_writer(path: Path) -> Any:
    """The storage seam of every sharded write (tests replace it with a failing writer)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, sync_files=True)


def _no_dist() -> bool:
    """One rank without a process group (DCP would otherwise warn that it assumes so)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _group_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """`{"model": ..., "optim": ...}` as this rank holds them: DTensor shards under FSDP2, plain
    tensors for a replica; optimizer state keyed by parameter name, so any layout maps onto it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optim)
    return {"model": model_state, "optim": optim_state}


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def state_bytes(state: Any) -> int:
    """Bytes of the whole (global) tensors in `state`: what its checkpoint needs on disk."""
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def save_group_state(path: str | Path, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Write this rank's shards of `model` and `optim` into the DCP directory `path` (a
    collective over the group's ranks; it raises on every rank if any rank fails). Returns the
    bytes of the group's whole state."""
    import torch.distributed.checkpoint as dcp

    target = Path(path)
    state = _group_state(model, optim)
    needed = state_bytes(state)
    try:
        dcp.save(state, storage_writer=_storage_writer(target), no_dist=_no_dist())
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        error = out_of_space_error(exc, target, needed)
        if error is not None:
            raise error from exc
        raise
    return needed


def has_group_state(path: str | Path, name: str) -> bool:
    """True when checkpoint `path` holds group `name` in the sharded (DCP) format."""
    return (Path(path) / name / DCP_METADATA).is_file()


def require_group_state(path: str | Path, name: str) -> None:
    """Raise unless checkpoint `path` holds group `name` sharded; name the fix for old formats."""
    path = Path(path)
    if has_group_state(path, name):
        return
    if (path / f"{name}.pt").is_file():
        raise CheckpointFormatError(
            f"checkpoint `{path}` holds `{name}` as a gathered full state (`{name}.pt`, written "
            "before checkpoints were sharded); this trainer reads only sharded checkpoints "
            f"(`{name}/{DCP_METADATA}`). Fix: finish or resume that run with the hpcrl version "
            "that wrote it, or start afresh with `trainer.resume_mode=disable` (its "
            "`huggingface/` export can seed a new run through `actor_rollout_ref.model.path`)")
    raise FileNotFoundError(
        f"checkpoint `{path}` has no `{name}/{DCP_METADATA}`: it holds no `{name}` state. Fix: "
        "resume with the worker groups the run was written with, or `trainer.resume_mode=disable`")


def load_group_state(path: str | Path, name: str, model: torch.nn.Module,
                     optim: torch.optim.Optimizer) -> None:
    """Load group `name` of checkpoint `path` into this rank's `model` and `optim`, whatever the
    world size it was written with (a collective): each rank reads the saved chunks that overlap
    its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    p = Path(path)
    require_group_state(p, name)
    state = _group_state(model, optim)
    _require_same_model(p, name, state["model"])
    dcp.load(state, checkpoint_id=p / name, no_dist=_no_dist())
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _require_same_model(path: Path, name: str, model_state: dict[str, Any]) -> None:
    """Raise, naming the likely setting, when the checkpoint's model entries are not this
    model's (DCP would fail on the first missing key)."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = {k.removeprefix("model.") for k in FileSystemReader(path / name).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    missing, unexpected = sorted(set(model_state) - saved), sorted(saved - set(model_state))
    if not missing and not unexpected:
        return
    shown = ", ".join(f"`{k}`" for k in (missing or unexpected)[:3])
    lora = [".lora_" in k for k in (missing or unexpected)]
    hint = ("LoRA adapters are in one and not the other: resume with the "
            "`actor_rollout_ref.model.lora_rank` (and `target_modules`) the run was written with"
            if any(lora) else "resume with the model settings the run was written with")
    raise CheckpointFormatError(
        f"checkpoint `{path}` holds a different `{name}` model: {len(missing)} of this model's "
        f"entries are missing from it and {len(unexpected)} of its entries are not in this model "
        f"(e.g. {shown}). Fix: {hint}, or start afresh with `trainer.resume_mode=disable` (its "
        "`huggingface/` export can seed a new run through `actor_rollout_ref.model.path`)")


def read_group_state(path: str | Path, name: str) -> dict[str, Any]:
    """The whole state of group `name` (`{"model": ..., "optim": ...}`) in this one process,
    for offline inspection and tests (it holds everything in memory: not for training)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    p = Path(path)
    require_group_state(p, name)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(p / name, out)
        state: dict[str, Any] = torch.load(out, weights_only=True)
    return state


# ----------------------------------------------------------------------------- out of space


def _os_errors(exc: BaseException | None, seen: set[int] | None = None) -> Iterator[OSError]:
    """The OSErrors in `exc`, its causes and (for DCP's CheckpointException) every rank's failure."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    if isinstance(exc, OSError):
        yield exc
    for wrapped in getattr(exc, "failures", {}).values():
        yield from _os_errors(wrapped[0] if isinstance(wrapped, tuple) else wrapped, seen)
    yield from _os_errors(exc.__cause__, seen)
    yield from _os_errors(exc.__context__, seen)


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def out_of_space_error(exc: BaseException, path: str | Path, needed: int | None) -> CheckpointWriteError | None:
    """A clear error when `exc` comes from a full disk, an exhausted quota, a read-only file
    system or a file-size limit while writing checkpoint directory `path`; None otherwise.

    `needed`: the bytes the checkpoint needs (None when unknown)."""
    cause = next((e for e in _os_errors(exc) if e.errno in OUT_OF_SPACE), None)
    if cause is None:
        return None
    p = Path(path)
    free = _free_bytes(p)
    need = "an unknown amount" if needed is None else f"about {_gib(needed)}"
    have = "unknown" if free is None else _gib(free)
    return CheckpointWriteError(
        cause.errno,
        f"writing the checkpoint to `{p}` failed: {os.strerror(cause.errno)} "
        f"({errno.errorcode.get(cause.errno, cause.errno)}). The checkpoint needs {need}; free "
        f"space there now: {have}. The previous complete checkpoint stays the newest and this "
        "partial one is removed. Fix: free space or raise the quota, keep fewer checkpoints "
        "(`trainer.max_actor_ckpt_to_keep`), or point `trainer.default_local_dir` at a writable "
        "file system with room")
