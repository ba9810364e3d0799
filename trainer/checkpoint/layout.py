"""Names and scans of checkpoint directories, without torch: what a complete checkpoint is.

A checkpoint is ``<root>/global_step_N/`` whose ``manifest.json`` names step N and lists every
file with its size, all present (see `trainer.checkpoint.full_state` for how one is written).
The launcher (`hpcrl status`, on a login node) reads checkpoints with the same rule through this
module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_PREFIX = "global_step_"
STEP_RE = re.compile(r"^global_step_(\d+)$")


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
