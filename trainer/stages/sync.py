"""The sync stage: the actor's current weights to every rank's rollout engine, or to the
rollout pool's engines (a separate deployment: :mod:`trainer.workers.rollout_pool`)."""

from __future__ import annotations

import time

from trainer.stages.logprobs import Note
from trainer.workers.group import WorkerGroup

__all__ = ["sync_pool", "sync_weights"]


def sync_weights(actor: WorkerGroup, note: Note) -> None:
    """Give every rank's rollout engine the actor's current weights (nothing to do where the
    engine generates with the actor itself); each rank's seconds noted as `update_weights_s`."""
    note("update_weights_s", actor.run("sync_rollout_weights"))


def sync_pool(actor: WorkerGroup, pool: WorkerGroup, version: int, note: Note) -> None:
    """Give the rollout pool's engines the actor's current weights as weight version `version`:
    the actor's ranks gather them bucket by bucket into the object store
    (`ActorRolloutRefWorker.export_weights`), every pool rank loads them. The actor's seconds
    are noted as `export_weights_s`, the pool's as `rollout_pool/load_weights_s`, with the GB
    each pool rank loaded and the whole sync's rate (`rollout_pool/weight_sync_gb`,
    `rollout_pool/weight_sync_gb_per_s`: bytes over export and load together)."""
    start = time.perf_counter()
    refs = actor.run("export_weights")[0]  # rank 0 holds the buckets' references
    note("export_weights_s", [time.perf_counter() - start] * actor.world_size)
    loads = pool.run("load_weights", refs, version)
    total = time.perf_counter() - start
    note("rollout_pool/load_weights_s", [seconds for seconds, _ in loads])
    note("rollout_pool/weight_sync_gb", [size / 1e9 for _, size in loads])
    note("rollout_pool/weight_sync_gb_per_s", [size / 1e9 / max(total, 1e-9) for _, size in loads])
