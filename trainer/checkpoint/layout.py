"""Names and scans of checkpoint directories, without torch: what a complete checkpoint is.

A checkpoint is ``<root>/global_step_N/`` whose ``manifest.json`` names step N and lists every
file with its size, all present (see `trainer.checkpoint.full_state` for how one is written).
The launcher (`hpcrl status`, on a login node) reads checkpoints with the same rule through this
module.

**Which run wrote a checkpoint.** A run is its run directory: the trainer's `trainer.run_dir`
(under hpcrl the job's `RUN/`, whatever restart, requeue or `hpcrl submit --resume` runs it;
standalone, the checkpoint root itself). The first save creates ``<run dir>/run_id``, a random
id written once and never changed, so every later job of the same run directory has the same
id, and a copy of another run's checkpoints, or a second run pointed at the same
``trainer.default_local_dir``, has a different one. Each manifest records ``run`` (id and run
directory) and ``seq``, the run's commit counter: a run's newest checkpoint is its highest
``seq``, not its highest step (a run resumed from an earlier step writes lower steps later).
Retention, auto-resume and the clean-up of temporaries (named ``.tmp-<run id>-...``) touch
only the run's own entries; another run's checkpoints are named, never taken or deleted.

**Who may write it.** A checkpoint is loaded only when its root and every file and directory
in it are writable by their owner alone (no group or world write bit): whoever can write
there could replace what the next resume loads.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_PREFIX = "global_step_"
STEP_RE = re.compile(r"^global_step_(\d+)$")
RUN_ID_FILE = "run_id"
RUN_ID_RE = re.compile(r"^[0-9a-f]{16}$")
TMP_PREFIX = ".tmp-"


class CheckpointOwnerError(Exception):
    """A checkpoint of another run is in the way (auto-resume found only theirs, or a save would
    replace one)."""


class CheckpointPermissionError(Exception):
    """A checkpoint root or checkpoint that users other than its owner can write."""


@dataclass(frozen=True)
class RunIdentity:
    """Who writes: the run's id and its run directory (see the module docstring)."""

    run_id: str
    run_dir: str

    @property
    def tmp_prefix(self) -> str:
        """The prefix of this run's temporary entries in a checkpoint root."""
        return f"{TMP_PREFIX}{self.run_id}-"


def read_run_identity(run_dir: str | Path) -> RunIdentity | None:
    """The identity of the run in `run_dir` if it has one yet (nothing is created)."""
    d = Path(run_dir).absolute()
    try:
        run_id = (d / RUN_ID_FILE).read_text().strip()
    except OSError:
        return None
    return RunIdentity(run_id, str(d)) if RUN_ID_RE.match(run_id) else None


def run_identity(run_dir: str | Path) -> RunIdentity:
    """The identity of the run whose run directory is `run_dir`, created on first use.

    Created with a hard link from a complete temporary file, so two processes racing to create
    it both read the one that won, never a half-written one.
    """
    d = Path(run_dir).absolute()
    target = d / RUN_ID_FILE
    if not target.exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{TMP_PREFIX}{RUN_ID_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.write_text(secrets.token_hex(8) + "\n")
        tmp.chmod(0o644)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    run_id = target.read_text().strip()
    if not RUN_ID_RE.match(run_id):
        raise CheckpointOwnerError(
            f"`{target}` holds `{run_id[:40]}`, not a run id (16 hexadecimal digits, written by "
            "the first checkpoint save of the run). Fix: restore the file from the run's "
            f"checkpoints (`run.id` in any `global_step_N/{MANIFEST}`), or delete it to start a "
            "new run identity that no existing checkpoint belongs to.")
    return RunIdentity(run_id, str(d))


def step_dir(root: str | Path, step: int) -> Path:
    """``<root>/global_step_<step>``."""
    return Path(root) / f"{STEP_PREFIX}{int(step)}"


def step_of(path: str | Path) -> int:
    """The step number of a ``global_step_N`` directory."""
    match = STEP_RE.match(Path(path).name)
    if not match:
        raise ValueError(
            f"`{path}` is not a checkpoint directory: its name must be `global_step_<N>`. Fix: "
            "pass a directory written by `save_checkpoint`."
        )
    return int(match.group(1))


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: str | Path) -> bool:
    """True when ``path`` is a ``global_step_N`` dir whose manifest matches its files."""
    p = Path(path)
    if not STEP_RE.match(p.name) or not p.is_dir():
        return False
    manifest = read_manifest(p)
    if manifest is None or manifest.get("step") != step_of(p):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict):
        return False
    for rel, size in files.items():
        f = p / rel
        try:
            if not f.is_file() or f.stat().st_size != size:
                return False
        except OSError:  # removed or unreadable meanwhile
            return False
    return True


def owner_of(manifest: dict[str, Any] | None) -> RunIdentity | None:
    """The run that wrote a checkpoint, from its manifest (None: none recorded)."""
    run = (manifest or {}).get("run")
    if not isinstance(run, dict) or not isinstance(run.get("id"), str):
        return None
    return RunIdentity(run["id"], str(run.get("dir", "?")))


def describe_owner(owner: RunIdentity | None) -> str:
    if owner is None:
        return "an unknown run (no run id in its manifest: written before run ids, or by hand)"
    return f"run `{owner.run_id}` (run directory `{owner.run_dir}`)"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest step first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if STEP_RE.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None.

    Directories are scanned rather than trusting the marker alone: a checkpoint renamed into
    place just before a kill (marker not yet updated) is complete and is picked; a partial
    directory is not, even if something points at it.
    """
    found = list_checkpoints(root)
    return found[-1] if found else None


def _seq(path: Path) -> int:
    seq = (read_manifest(path) or {}).get("seq")
    return seq if isinstance(seq, int) else 0


def run_checkpoints(root: str | Path, run: RunIdentity) -> list[Path]:
    """The complete checkpoints of run `run` under `root`, oldest commit first (``seq``)."""
    own = [p for p in list_checkpoints(root) if (o := owner_of(read_manifest(p))) and o.run_id == run.run_id]
    return sorted(own, key=lambda p: (_seq(p), step_of(p)))


def latest_run_checkpoint(root: str | Path, run: RunIdentity) -> Path | None:
    """The newest checkpoint run `run` committed under `root`, or None."""
    own = run_checkpoints(root, run)
    return own[-1] if own else None


def next_seq(root: str | Path, run: RunIdentity) -> int:
    """The commit counter of run `run`'s next checkpoint under `root`."""
    own = run_checkpoints(root, run)
    return _seq(own[-1]) + 1 if own else 1


def others_checkpoints(root: str | Path, run: RunIdentity) -> list[tuple[Path, RunIdentity | None]]:
    """The complete checkpoints under `root` that run `run` did not write, with their writers."""
    out = []
    for p in list_checkpoints(root):
        owner = owner_of(read_manifest(p))
        if owner is None or owner.run_id != run.run_id:
            out.append((p, owner))
    return out


def describe_others(others: list[tuple[Path, RunIdentity | None]]) -> str:
    """``global_step_5, global_step_9 of run `abc` (run directory `/x`); ...``"""
    by_owner: dict[str, list[str]] = {}
    for p, owner in others:
        by_owner.setdefault(describe_owner(owner), []).append(p.name)
    return "; ".join(f"{', '.join(names)} of {who}" for who, names in by_owner.items())


def _writable_by_others(path: Path) -> bool:
    mode = path.lstat().st_mode
    return not stat.S_ISLNK(mode) and bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def require_private(path: str | Path, *, tree: bool = False) -> None:
    """Raise `CheckpointPermissionError` when `path` (with `tree`: or anything under it) is
    writable by group or others."""
    p = Path(path)
    found = [p] if p.exists() and _writable_by_others(p) else []
    if tree and not found and p.is_dir():
        for dirpath, dirs, files in os.walk(p):
            found += [q for q in (Path(dirpath) / n for n in dirs + files) if _writable_by_others(q)]
            if found:
                break
    if found:
        bad = found[0]
        raise CheckpointPermissionError(
            f"`{bad}` is writable by users other than its owner (mode "
            f"{stat.filemode(bad.lstat().st_mode)}): a checkpoint is loaded only from a root and "
            "files that no one else can write, since whoever can write there decides what the "
            f"next resume loads. Fix: `chmod -R go-w {p}` (and check that its contents are "
            "yours), then run again.")
