"""Checkpoints as self-describing directories ``<root>/global_step_N/``.

A checkpoint is written under a temporary sibling name (``.tmp-global_step_N-...``): each
worker group's ranks write their shards into ``<group>/`` (:mod:`trainer.checkpoint.sharded`),
small named states (trainer state, LR schedulers) go to ``<name>.pt`` (``torch.save``), optional
text/bytes files and an HF export of the actor (``huggingface/``) follow, then ``manifest.json`` listing every file and its size
is written last. All files and directories are fsynced, the directory is renamed to
``global_step_N``, and only then is the marker ``latest_checkpointed_iteration.txt`` (verl's
name) replaced atomically. A directory without a valid manifest, or whose files do not match
it, is never picked for resume: a writer killed at any point leaves at worst a temporary
directory that the next save of the same run removes.

Which run a checkpoint belongs to, and what that run may prune, resume and clean up, is the
rule of :mod:`trainer.checkpoint.layout` (its docstring): each manifest records the writing
run's id and commit counter; a save never replaces or deletes another run's entries, and the
checkpoint it just committed is never pruned. States load with ``torch.load(weights_only=True)``
and only from roots and checkpoints that no one but their owner can write.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoint.layout import (
    MANIFEST,
    TMP_PREFIX,
    CheckpointOwnerError,
    CheckpointPermissionError,
    RunIdentity,
    describe_others,
    describe_owner,
    find_latest_checkpoint,
    is_complete,
    latest_run_checkpoint,
    list_checkpoints,
    next_seq,
    others_checkpoints,
    owner_of,
    read_manifest,
    require_private,
    run_checkpoints,
    run_identity,
    step_dir,
    step_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "HF_DIR",
    "CheckpointOwnerError",
    "CheckpointPermissionError",
    "RunIdentity",
    "begin_checkpoint",
    "commit_checkpoint",
    "LATEST_MARKER",
    "MANIFEST",
    "TMP_PREFIX",
    "capture_rng_state",
    "find_latest_checkpoint",
    "is_complete",
    "latest_run_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state",
    "others_checkpoints",
    "describe_others",
    "prune_checkpoints",
    "read_latest_marker",
    "resolve_resume",
    "restore_rng_state",
    "run_checkpoints",
    "run_identity",
    "save_checkpoint",
    "step_dir",
    "step_of",
    "write_states",
]

LATEST_MARKER = "latest_checkpointed_iteration.txt"
HF_DIR = "huggingface"
FORMAT_VERSION = 1
RESUME_MODES = ("auto", "disable", "resume_path")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


# --------------------------------------------------------------------------- durability


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, under ``root``; none is left writable
    by group or world (whatever umask the ranks that wrote them had)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _drop_others_write(Path(dirpath) / name)
            _fsync_path(Path(dirpath) / name)
        _drop_others_write(Path(dirpath))
        _fsync_path(Path(dirpath))


def _write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _drop_others_write(path: Path) -> None:
    """Clear the group and world write bits of `path` (the umask may have set them)."""
    mode = path.lstat().st_mode
    if mode & 0o022 and not os.path.islink(path):
        os.chmod(path, mode & ~0o022)


def _open_root(root: str | Path) -> Path:
    """The checkpoint root, created without group/world write when absent; an existing root
    that others can write is refused (`require_private`)."""
    r = Path(root)
    if not r.exists():
        r.mkdir(parents=True, exist_ok=True)
        _drop_others_write(r)
    require_private(r)
    return r


def _replace_atomically(path: Path, data: bytes, run: RunIdentity) -> None:
    """Write ``data`` to a temporary sibling, fsync it, rename it over ``path``, fsync the dir."""
    tmp = path.with_name(f"{run.tmp_prefix}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _write_bytes_durably(tmp, data)
    _drop_others_write(tmp)
    os.replace(tmp, path)
    _fsync_path(path.parent)


# --------------------------------------------------------------------------- names and scans


def read_latest_marker(root: str | Path) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt``, or None if absent/unreadable."""
    try:
        return int((Path(root) / LATEST_MARKER).read_text().strip())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- save


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name) or ".." in name.split("/") or name in (MANIFEST, HF_DIR):
        raise ValueError(
            f"Invalid checkpoint entry name `{name}`: names are relative paths of letters, "
            f"digits, `_`, `-`, `.` and `/`, without `..`, and not `{MANIFEST}` or `{HF_DIR}`. "
            "Fix: rename the entry, e.g. `actor_optim`."
        )


def _write_contents(
    tmp: Path,
    states: Mapping[str, Any],
    files: Mapping[str, str | bytes],
    hf_model: PreTrainedModel | None,
    hf_tokenizer: PreTrainedTokenizerBase | None,
    hf_state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    for name, state in states.items():
        target = tmp / f"{name}.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, target)
    for name, content in files.items():
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
    if hf_model is not None:
        hf_model.save_pretrained(tmp / HF_DIR, state_dict=dict(hf_state_dict) if hf_state_dict else None)
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(tmp / HF_DIR)


def _write_manifest(tmp: Path, step: int, metadata: Mapping[str, Any], run: RunIdentity, seq: int) -> None:
    sizes = {
        str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
    }
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "created_unix": time.time(),
        "files": sizes,
        "metadata": dict(metadata),
        "run": {"id": run.run_id, "dir": run.run_dir},
        "seq": seq,
    }
    _write_bytes_durably(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _drop_others_write(tmp / MANIFEST)


def save_checkpoint(
    root: str | Path,
    step: int,
    states: Mapping[str, Any],
    *,
    files: Mapping[str, str | bytes] | None = None,
    hf_model: PreTrainedModel | None = None,
    hf_tokenizer: PreTrainedTokenizerBase | None = None,
    metadata: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    run: RunIdentity | None = None,
) -> Path:
    """Write ``<root>/global_step_<step>/`` atomically and return its path.

    ``states`` maps names (``actor``, ``actor_optim``, ``trainer_state``, ``critic/model``...)
    to objects for ``torch.save``; ``files`` maps names to text or bytes written as-is (e.g.
    ``config.yaml``); ``hf_model``/``hf_tokenizer`` are exported to ``huggingface/`` with
    ``save_pretrained``. ``metadata`` (JSON-serialisable) goes into the manifest. With
    ``keep_last``, this run's older checkpoints beyond its newest ``keep_last`` are removed.
    ``run``: the writing run (default: the run whose run directory is ``root``).
    """
    run = run or run_identity(_open_root(root))
    tmp = begin_checkpoint(root, step, run=run)
    try:
        write_states(tmp, states, hf_model=hf_model, hf_tokenizer=hf_tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_checkpoint(root, step, tmp, files=files, metadata=metadata, keep_last=keep_last,
                             run=run)


def begin_checkpoint(root: str | Path, step: int, *, run: RunIdentity | None = None) -> Path:
    """Create and return the temporary directory that step ``step``'s checkpoint is written to.

    Several writers (e.g. the rank 0 of each worker group) may fill it with :func:`write_states`
    before one of them calls :func:`commit_checkpoint` with the same ``run``.
    """
    if step < 0:
        raise ValueError(f"Checkpoint `step` must be >= 0, received {step}.")
    r = _open_root(root)
    run = run or run_identity(r)
    tmp = r / f"{run.tmp_prefix}{step_dir(r, step).name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    _drop_others_write(tmp)
    return tmp


def write_states(
    tmp: str | Path,
    states: Mapping[str, Any],
    *,
    hf_model: PreTrainedModel | None = None,
    hf_tokenizer: PreTrainedTokenizerBase | None = None,
    hf_state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write named states (and an HF export) into a directory from :func:`begin_checkpoint`.

    ``hf_state_dict`` replaces the model's own weights in the export (a gathered full state
    when the live model is sharded).
    """
    for name in states:
        _check_name(name)
    _write_contents(Path(tmp), states, {}, hf_model, hf_tokenizer, hf_state_dict)


def commit_checkpoint(
    root: str | Path,
    step: int,
    tmp: str | Path,
    *,
    files: Mapping[str, str | bytes] | None = None,
    metadata: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    run: RunIdentity | None = None,
) -> Path:
    """Add ``files``, write the manifest, rename ``tmp`` to ``global_step_<step>`` and move the
    marker: the checkpoint becomes visible complete or not at all. A ``global_step_<step>`` of
    another run is never replaced (`CheckpointOwnerError`, nothing changed)."""
    r, tmp = Path(root), Path(tmp)
    run = run or run_identity(r)
    for name in files or {}:
        _check_name(name)
    final = step_dir(r, step)
    try:
        _require_replaceable(final, run)
        _write_contents(tmp, {}, files or {}, None, None)
        _fsync_tree(tmp)
        _write_manifest(tmp, step, metadata or {}, run, next_seq(r, run))
        _fsync_path(tmp)
        if final.exists():  # re-saving a step: move the old one aside first
            os.rename(final, r / f"{run.tmp_prefix}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(tmp, final)
        _fsync_path(r)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_atomically(r / LATEST_MARKER, f"{step}\n".encode(), run)
    _remove_stale_temporaries(r, run)
    if keep_last is not None:
        prune_checkpoints(r, keep_last, run=run)
    return final


def _require_replaceable(final: Path, run: RunIdentity) -> None:
    """A step directory may be replaced only by the run that wrote it."""
    if not final.exists():
        return
    owner = owner_of(read_manifest(final))
    if owner is None or owner.run_id != run.run_id:
        raise CheckpointOwnerError(
            f"`{final}` belongs to {describe_owner(owner)}, not to this run `{run.run_id}` (run "
            f"directory `{run.run_dir}`): a run never replaces another run's checkpoint. Fix: "
            "give this run its own `trainer.default_local_dir`, or move that checkpoint away.")


def _remove_stale_temporaries(root: Path, run: RunIdentity) -> None:
    """Remove leftovers of this run's interrupted writes (one writer per run at a time);
    another run's temporaries, and those of unknown writers, are left alone."""
    for p in root.iterdir():
        if p.name.startswith(run.tmp_prefix):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def prune_checkpoints(root: str | Path, keep_last: int, *, run: RunIdentity | None = None) -> list[Path]:
    """Delete all but this run's ``keep_last`` newest checkpoints (by commit, ``seq``); return
    the removed paths. Other runs' checkpoints are never considered, and the newest commit (the
    one just written) is always kept.

    ``keep_last`` <= 0 keeps everything (verl's ``max_actor_ckpt_to_keep=None`` behaviour).
    """
    if keep_last <= 0:
        return []
    old = run_checkpoints(root, run or run_identity(root))[:-keep_last]
    for p in old:
        shutil.rmtree(p)
    return old


# --------------------------------------------------------------------------- load


def _require_complete(path: Path) -> None:
    require_private(path.parent)
    require_private(path, tree=True)
    if not is_complete(path):
        raise FileNotFoundError(
            f"`{path}` is not a complete checkpoint (missing or mismatching `{MANIFEST}`; it "
            "may have been cut short while being written). Fix: pass a `global_step_N` "
            "directory listed by `list_checkpoints`, or resume with `resume_mode=auto`."
        )


def load_state(path: str | Path, name: str, map_location: str | torch.device = "cpu") -> Any:
    """One named state of a checkpoint (tensors and plain containers: ``weights_only``)."""
    p = Path(path)
    _require_complete(p)
    target = p / f"{name}.pt"
    if not target.is_file():
        names = sorted(str(f.relative_to(p))[:-3] for f in p.rglob("*.pt"))
        raise KeyError(
            f"Checkpoint `{p}` has no state named `{name}`. Available: {', '.join(names)}."
        )
    return torch.load(target, map_location=map_location, weights_only=True)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Every named state of a complete checkpoint: ``{name: object}``."""
    p = Path(path)
    _require_complete(p)
    names = sorted(
        str(f.relative_to(p))[:-3] for f in p.rglob("*.pt") if f.relative_to(p).parts[0] != HF_DIR
    )
    return {name: load_state(p, name, map_location) for name in names}


def resolve_resume(
    root: str | Path, resume_mode: str, resume_path: str | Path | None = None,
    *, run: RunIdentity | None = None,
) -> Path | None:
    """The checkpoint to resume from under verl's ``trainer.resume_mode``.

    ``auto``: this run's newest complete checkpoint under ``root`` (None when there is none; when
    ``root`` holds only other runs' checkpoints, `CheckpointOwnerError` naming whose they are);
    ``disable``: None; ``resume_path``: ``resume_path``, which must be complete, whoever wrote
    it. ``run``: default, the run whose run directory is ``root``.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return _auto_resume(Path(root), run)
    if resume_mode == "resume_path":
        if resume_path is None:
            raise ValueError(
                "`trainer.resume_mode=resume_path` needs `trainer.resume_from_path`, received "
                "None. Fix: set it to a `global_step_N` directory."
            )
        p = Path(resume_path)
        _require_complete(p)
        return p
    raise ValueError(
        f"Unknown `trainer.resume_mode={resume_mode!r}`. Valid values: {', '.join(RESUME_MODES)}."
    )


def _auto_resume(root: Path, run: RunIdentity | None) -> Path | None:
    if not root.is_dir():
        return None
    require_private(root)
    run = run or run_identity(root)
    own = latest_run_checkpoint(root, run)
    if own is not None:
        return own
    others = others_checkpoints(root, run)
    if others:
        raise CheckpointOwnerError(
            f"`trainer.resume_mode=auto` found no checkpoint of this run `{run.run_id}` (run "
            f"directory `{run.run_dir}`) under `{root}`, only other runs': "
            f"{describe_others(others)}. Auto-resume takes only the run's own checkpoints, and "
            "this run must not write over theirs. Fix: continue from one of them with "
            f"`trainer.resume_mode=resume_path trainer.resume_from_path={others[-1][0]}` and "
            "this run's own `trainer.default_local_dir`, or start afresh in an empty "
            "`trainer.default_local_dir`.")
    return None


# --------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a run uses (torch CPU/CUDA, Python, NumPy). The CUDA
    generators only where this process has started CUDA already: reading them would otherwise
    start it, on every GPU it sees (the Ray driver on a GPU node sees them all)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # Tensors and plain numbers, so that `weights_only` loads it.
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(cached))
    except ImportError:
        pass
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generators captured by :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos,
                             has_gauss, cached))
