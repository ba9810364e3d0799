"""The sync stage: the actor's current weights to every rank's rollout engine."""

from __future__ import annotations

from trainer.stages.logprobs import Note
from trainer.workers.group import WorkerGroup

__all__ = ["sync_weights"]


def sync_weights(actor: WorkerGroup, note: Note) -> None:
    """Give every rank's rollout engine the actor's current weights (nothing to do where the
    engine generates with the actor itself); each rank's seconds noted as `update_weights_s`."""
    note("update_weights_s", actor.run("sync_rollout_weights"))
