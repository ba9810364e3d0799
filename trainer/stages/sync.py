"""The sync stage: the actor's current weights to every rank's rollout engine, or to the
rollout pool's engines (a separate deployment: :mod:`trainer.workers.rollout_pool`)."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, wait
from typing import Any

from trainer.config.async_training import CheckpointEngineConfig
from trainer.stages.logprobs import Note
from trainer.workers.group import WorkerGroup, in_background

__all__ = ["PEER_FAILURE_WAIT_S", "sync_pool", "sync_weights"]

PEER_FAILURE_WAIT_S = 30.0
"""After actor rank 0's broadcast failed, how long the pool's side may take to report a failure
of its own, which is then the one raised: a pool rank that dies inside a sync (its node dies)
resets the sender's connection at once, and gloo's "Connection reset by peer" on the trainer's
rank would name the wrong rank and node, while Ray reports the pool rank dead only once it
notices the node gone (its health checks: 10-15 s on the lab)."""


def sync_weights(actor: WorkerGroup, note: Note) -> None:
    """Give every rank's rollout engine the actor's current weights (nothing to do where the
    engine generates with the actor itself); each rank's seconds noted as `update_weights_s`."""
    note("update_weights_s", actor.run("sync_rollout_weights"))


def sync_pool(actor: WorkerGroup, pool: WorkerGroup, version: int, note: Note,
              engine: CheckpointEngineConfig, address: Any = None) -> Any:
    """Give the rollout pool's engines the actor's current weights as weight version `version`.

    With `async_training.checkpoint_engine.enable` (the default), a collective broadcast from
    actor rank 0 to every pool rank (:mod:`trainer.workers.weight_broadcast`: NCCL/RCCL between
    GPUs, gloo between CPUs), pipelined with `overlap_broadcast_and_consume`. Otherwise through
    Ray's object store in host memory: the actor's ranks gather bucket by bucket into it
    (`ActorRolloutRefWorker.export_weights`), every pool rank loads them.

    Noted: the actor's seconds as `export_weights_s`, the pool's as
    `rollout_pool/load_weights_s`, the GB each pool rank loaded and the whole sync's rate
    (`rollout_pool/weight_sync_gb`, `rollout_pool/weight_sync_gb_per_s`: bytes over the sync's
    wall time); with the broadcast also actor rank 0's seconds blocked on the network
    (`rollout_pool/broadcast_wait_s`).

    `address`: the broadcast's address (:class:`~trainer.workers.weight_broadcast.BroadcastAddress`)
    as the last sync returned it, or None at the first: it is asked of actor rank 0 once (it is
    fixed for the run: the store, the backend, the bucket layout). Returns it (None through the
    object store)."""
    start = time.perf_counter()
    if engine.enable:
        if address is None:
            wire = pool.run_rank(0, "wire_dtype")
            address = actor.run_rank(0, "weight_broadcast_address", pool.world_size, wire)
        sending = in_background("weight-broadcast", actor.run, "broadcast_weights", version,
                                engine.overlap_broadcast_and_consume)
        loading = in_background("weight-receive", pool.run_each, "receive_weights",
                                [(address, rank + 1, version, engine.overlap_broadcast_and_consume)
                                 for rank in range(pool.world_size)])
        wait([sending, loading], return_when=FIRST_EXCEPTION)  # a failed side must not wait for the other's timeout
        if sending.done() and sending.exception() is not None:  # the receivers' failure explains it
            wait([loading], timeout=PEER_FAILURE_WAIT_S)
        for side in (loading, sending):
            if side.done() and side.exception() is not None:
                raise side.exception()  # type: ignore[misc]
        sent, loads = sending.result(), loading.result()
        note("export_weights_s", [seconds for seconds, _, _ in sent])
        note("rollout_pool/broadcast_wait_s", [sent[0][2]])
    else:
        refs = actor.run("export_weights")[0]  # rank 0 holds the buckets' references
        note("export_weights_s", [time.perf_counter() - start] * actor.world_size)
        loads = pool.run("load_weights", refs, version)
    total = time.perf_counter() - start
    note("rollout_pool/load_weights_s", [seconds for seconds, _ in loads])
    note("rollout_pool/weight_sync_gb", [size / 1e9 for _, size in loads])
    note("rollout_pool/weight_sync_gb_per_s", [size / 1e9 / max(total, 1e-9) for _, size in loads])
    return address
