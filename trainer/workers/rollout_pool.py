"""The rollout pool's worker: a rank that only generates, on GPUs of its own (verl's separate
deployment, `actor_rollout_ref.hybrid_engine=false` with `rollout.nnodes` x
`rollout.n_gpus_per_node`).

It holds the rollout engine and nothing of the trainer: no actor, no optimizer, no process
group (each rank is an engine of its own: `tensor_model_parallel_size` 1). Its weights come from
the trainer's ranks after each update (:meth:`RolloutWorker.load_weights`, fed by
:meth:`trainer.workers.actor.ActorRolloutRefWorker.export_weights`), each load tagged with the
weight version it brings, and every rollout says which version generated it, so the loop can
check the lag of every batch it trains on. The engine never sleeps: the pool's GPUs hold nothing
else (verl's one-step-off config sets `rollout.free_cache_engine=false` for the same reason), so
its weights are never discarded between syncs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from trainer import models as M
from trainer import parallel as P
from trainer.config import Config
from trainer.hf_overrides import config_updates
from trainer.phases import Phases
from trainer.rollout.base import RolloutBatch
from trainer.rollout.hf import HFRolloutEngine, rollout_copy
from trainer.rollout.vllm import VLLMRolloutEngine
from trainer.workers import weight_broadcast as WB
from trainer.workers.base import Worker, resolve_device
from trainer.workers.rollout_side import RolloutSide

__all__ = ["RolloutWorker", "pool_config"]


def pool_config(cfg: Config) -> Config:
    """`cfg` as the pool's engines read it: `rollout.free_cache_engine` off (nothing else shares
    the pool's GPUs, and a level-2 sleep would discard weights only the trainer can send again)."""
    arr = cfg.actor_rollout_ref
    rollout = dataclasses.replace(arr.rollout, free_cache_engine=False)
    return dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(arr, rollout=rollout))


class RolloutWorker(RolloutSide, Worker):
    """One rank of the rollout pool: an engine, the weights of the last load, their version."""

    role = "rollout"

    def __init__(self, cfg: Config, rank: int, world_size: int, total_steps: int) -> None:
        super().__init__(pool_config(cfg), rank, world_size, total_steps)
        self.version = -1
        """The weight version of the last load (-1: none yet; the engine's weights are not the
        trainer's until the first)."""
        self.broadcast_group: Any = None
        """The trainer's weight broadcast's group, from the first `receive_weights` on."""

    @property
    def fsdp_config(self) -> Any:
        return self.cfg.actor_rollout_ref.actor.fsdp_config  # read for the optimizer offload: none here

    def init_dist(self, master_addr: str | None = None, master_port: int | None = None, *,
                  shard_alone: bool = False) -> dict[str, Any]:
        """Take this rank's device (the GPU Ray assigned, or the CPU) and build the engine; a
        pool rank joins no process group (each is an engine of its own)."""
        self.ctx = P.single_rank(resolve_device(self.cfg.trainer.device))
        self.phases = Phases(self.device, offload_optimizer=False)
        self.build()
        return {"backend": "none", "fsdp": False, "threads": torch.get_num_threads()}

    def build(self) -> None:
        arr = self.cfg.actor_rollout_ref
        tokenizer_path, tokenizer_trust = self.cfg.tokenizer_source
        self.tokenizer = M.load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trust)
        eos = M.eos_token_ids(arr.model.path, self.tokenizer, trust_remote_code=arr.model.trust_remote_code)
        self.engine_group, self.shares_weights, self.agents = None, False, None
        if arr.rollout.name == "vllm":
            self.rollout: Any = VLLMRolloutEngine.from_config(self.cfg, self.tokenizer, eos,
                                                              seed=self.cfg.trainer.seed + self.rank)
        else:  # an empty copy given memory here; the first load brings the trainer's weights
            copy = rollout_copy(arr.model.path, 1, 1, self.device,
                                dtype=M.compute_dtype(arr.rollout.dtype, self.device),
                                trust_remote_code=arr.model.trust_remote_code,
                                config_updates=config_updates(arr.model.override_config, self.tokenizer))
            self.rollout = HFRolloutEngine(copy, self.tokenizer.pad_token_id, eos)

    def load_weights(self, refs: list[Any], version: int) -> tuple[float, float]:
        """Load the trainer's weights of `version` from the object store, one bucket at a time
        (each fetched only when the engine asks for it); returns seconds and bytes loaded."""
        import ray

        loaded = 0

        def buckets() -> Any:
            nonlocal loaded
            for ref in refs:
                bucket = ray.get(ref)
                loaded += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        start = time.perf_counter()
        with self.phases.track("weight_sync"):
            self.rollout.sync_weights(buckets())
        self.phases.memory.empty_cache()
        self.version = version
        return time.perf_counter() - start, float(loaded)

    def wire_dtype(self) -> str:
        """The dtype of the engine's weights, in which the trainer broadcasts floating tensors."""
        return str(M.compute_dtype(self.cfg.actor_rollout_ref.rollout.dtype, self.device)).removeprefix("torch.")

    def receive_weights(self, address: WB.BroadcastAddress, rank: int, version: int, overlap: bool
                        ) -> tuple[float, float]:
        """Load weight version `version` from the trainer's broadcast
        (:mod:`trainer.workers.weight_broadcast`) as rank `rank` of its group (actor rank 0 sends
        in `broadcast_weights` at the same time), bucket by bucket into the engine, the next
        bucket's receive posted before the last is loaded with `overlap`. The first call joins the
        group. Returns seconds and bytes loaded."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend != address.backend:
            raise RuntimeError(
                f"the trainer broadcasts its weights over {address.backend} and this rollout rank is on "
                f"{self.device.type}, which takes {backend}: the pools' devices differ. Fix: give both pools "
                "GPUs (or both CPUs), or sync through host memory with `async_training.checkpoint_engine.enable=false`")
        start = time.perf_counter()
        if self.broadcast_group is None:
            self.broadcast_group = WB.open_group(address, rank, self.cfg.actor_rollout_ref.nccl_timeout)
        receiver = WB.Receiver(self.broadcast_group, address.layout, self.device, overlap=overlap)
        with self.phases.track("weight_sync"):
            self.rollout.sync_weights(receiver.buckets(version))
        self.phases.memory.empty_cache()
        self.version = version
        return time.perf_counter() - start, float(receiver.received)

    def loaded_version(self) -> int:
        """The weight version of the last load (-1: none yet)."""
        return self.version

    def weights_digest(self) -> dict[str, float]:
        """Each state-dict entry's sum of absolute values in the engine's model (an HF engine's;
        for tests, against the actor's :meth:`~trainer.workers.actor.ActorRolloutRefWorker.weights_digest`)."""
        model = getattr(self.rollout, "model", None)
        if model is None:
            raise RuntimeError(f"a {type(self.rollout).__name__} keeps its weights inside its engine")
        return {name: float(t.double().abs().sum()) for name, t in model.state_dict().items()}

    def sync_rollout_weights(self) -> float:
        raise RuntimeError("a rollout-pool engine lost its weights: only the trainer can send them "
                           "(`load_weights`); the pool's engines must not sleep")

    def _rolling_out(self, run: Any, has_rows: bool, seed: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The rollout on the weights of the last load, its info tagged with their version."""
        if self.version < 0:
            raise RuntimeError("the rollout pool generated before it was given the trainer's weights")
        out, info = super()._rolling_out(run, has_rows, seed)
        return out, {**info, "weight_version": float(self.version)}
