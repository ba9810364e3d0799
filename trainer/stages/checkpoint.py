"""The checkpoint stage: every worker group's shards and the driver's loop state written into
one directory and committed, or loaded back on any number of ranks."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.checkpoint import full_state as ckpt
from trainer.checkpoint import sharded
from trainer.checkpoint.layout import read_manifest
from trainer.config import ConfigError
from trainer.workers.group import WorkerGroup

__all__ = ["load", "previous_checkpoint_bytes", "save"]

#: The file of the driver's own state (step, data position, KL controller, RNG).
TRAINER_STATE = "trainer_state"


def save(root: Path, step: int, run: ckpt.RunIdentity, groups: Sequence[WorkerGroup],
         trainer_state: Mapping[str, Any], files: Mapping[str, str], metadata: Mapping[str, Any],
         keep_last: int | None) -> Path:
    """`<root>/global_step_<step>/`: every rank of each group writes its shards into the
    temporary directory, then the driver's `trainer_state` and `files` (the config) are added
    and the whole is committed, keeping the `keep_last` newest of `run`. A failed write removes
    the temporary directory (the previous checkpoint stays the newest) and, when the storage is
    out of room, says where and how much is needed."""
    tmp = None
    try:
        tmp = ckpt.begin_checkpoint(root, step, run=run)
        for group in groups:
            group.run("save_checkpoint", str(tmp))
        ckpt.write_states(tmp, {TRAINER_STATE: dict(trainer_state)})
        return ckpt.commit_checkpoint(root, step, tmp, files=dict(files), metadata=dict(metadata),
                                      keep_last=keep_last, run=run)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, sharded.CheckpointWriteError):  # a group's own, with its exact size
            raise
        error = sharded.out_of_space_error(exc, tmp or root, previous_checkpoint_bytes(root, run))
        if error is not None:
            raise error from exc
        raise


def previous_checkpoint_bytes(root: Path, run: ckpt.RunIdentity) -> int | None:
    """The size of the newest complete checkpoint of `run`: what the next one needs, about."""
    newest = ckpt.latest_run_checkpoint(root, run)
    manifest = read_manifest(newest) if newest is not None else None
    return None if manifest is None else sum(int(n) for n in manifest["files"].values())


def load(path: Path, actor: WorkerGroup, critic: WorkerGroup | None, estimator: str) -> dict[str, Any]:
    """Load every group's shards from `path` (written on any number of ranks) and return the
    driver's state; a checkpoint without the critic that `estimator` needs is refused."""
    sharded.require_group_state(path, "actor")  # refuses the gathered format of old runs
    if critic is not None and not sharded.has_group_state(path, "critic"):
        raise ConfigError(
            f"checkpoint `{path}` has no critic but `algorithm.adv_estimator={estimator}` needs one; "
            "resume with the estimator the run started with, or `trainer.resume_mode=disable`")
    for group in (actor, critic):
        if group is not None:
            group.run("load_checkpoint", str(path))
    return ckpt.load_state(path, TRAINER_STATE)  # type: ignore[no-any-return]
