"""The actor + reference + rollout worker of one rank.

The actor (trained), the reference policy (frozen, when a KL term needs it) and the rollout
engine live in one process, so that the rollout gets the actor's weights in memory.

Which model generates:

- one rank (no process group): HF ``generate`` runs on the training model itself, nothing to sync;
- several ranks: the actor and the reference are FSDP2-sharded (on the CPU too), and the rollout
  engine keeps a model of its own, fed after every update by the streamed weight sync
  (:meth:`ActorRolloutRefWorker.sync_rollout_weights`: one bucket of gathered parameters at a
  time, never the whole model at once on top of the engine's weights). Generating with the
  sharded actor itself (``generate(..., synced_gpus=True)``) would save that copy but make every
  decoded token an all-gather of every layer on every rank, and force ranks with no prompts to
  decode along; the separate engine decodes rank by rank, and it is what vLLM needs anyway.

With LoRA (`actor_rollout_ref.model.lora_rank` > 0, :mod:`trainer.lora`) the actor is a peft
model whose adapters alone train; the reference policy is that model with its adapters disabled,
and the weight sync sends the merged weights under the base model's names.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from trainer import models as M
from trainer import parallel as P
from trainer.algos import core_algos, rollout_corr
from trainer.batch import MiniBatchShare, StepBatch, need
from trainer.hf_overrides import config_updates
from trainer.lora import apply_lora, load_lora
from trainer.metrics import flops_fields
from trainer.rollout.hf import HFRolloutEngine, rollout_copy
from trainer.rollout.vllm import VLLMRolloutEngine
from trainer.rollout.vllm_server import ReplicaMember, ServerEngine, replica_devices, server_mode
from trainer.workers import weight_broadcast as WB
from trainer.workers.base import Worker, node_ip
from trainer.workers.reward import score_on_rank
from trainer.workers.rollout_side import RolloutSide

__all__ = ["ActorRolloutRefWorker"]

class ActorRolloutRefWorker(RolloutSide, Worker):
    """Actor + reference + rollout of one rank."""

    role = "actor_rollout_ref"
    broadcast_address: WB.BroadcastAddress | None = None
    """The weight broadcast to the rollout pool (rank 0, from the first sync on)."""
    broadcast_store: Any = None
    broadcast_group: Any = None

    def build(self) -> None:
        arr = self.cfg.actor_rollout_ref
        trust = arr.model.trust_remote_code
        tokenizer_path, tokenizer_trust = self.cfg.tokenizer_source
        self.tokenizer = M.load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trust)
        self.lora = arr.model.uses_lora
        self.config_updates = config_updates(arr.model.override_config, self.tokenizer)  # verl's edits
        section = "actor_rollout_ref.actor.fsdp_config"
        if self.lora:  # before sharding: FSDP2 then shards the adapters with their layers
            base = M.load_actor(arr.model.path, dtype=arr.actor.fsdp_config.model_dtype,
                                attn_implementation=self._attention(arr.actor.fsdp_config),
                                trust_remote_code=trust, config_updates=self.config_updates,
                                gradient_checkpointing=arr.model.enable_gradient_checkpointing)
            model: Any = (load_lora(base, arr.model) if arr.model.lora_adapter_path else
                          apply_lora(base, arr.model.lora_rank, arr.model.lora_alpha, arr.model.target_modules))
            self.model = self._place(model, arr.actor.fsdp_config, section)
        else:
            self.model = self._load_placed(arr.model.path, arr.actor.fsdp_config, section, trust_remote_code=trust,
                                           gradient_checkpointing=arr.model.enable_gradient_checkpointing,
                                           config_updates=self.config_updates)
        self.model.train()
        self.ref: Any = None
        if self.cfg.derived.use_reference and not self.lora:  # LoRA: the actor, adapters disabled
            self.ref = self._load_placed(arr.model.path, arr.ref.fsdp_config, "actor_rollout_ref.ref.fsdp_config",
                                         frozen=True, trust_remote_code=trust, config_updates=self.config_updates)
        self.phases.memory.empty_cache()  # the build's transient blocks, before the rollout engine sizes itself
        self._optimizer(arr.actor.optim)
        # the registered `loss_mode`, or bypass mode's loss (verl's `apply_bypass_mode` replaces it)
        self.policy_loss = rollout_corr.policy_loss_for(arr.actor.policy_loss.loss_mode,
                                                        self.cfg.algorithm.rollout_correction)
        self.loss_params = self._loss_params()
        # the ranks of one tensor-parallel engine: its first rank leads the agent loops, or starts
        # the server-mode replica over their GPUs
        self.engine_group = P.consecutive_cpu_group(arr.rollout.tensor_model_parallel_size)
        self.rollout, self.shares_weights = self._build_rollout()
        self.agents: Any = None  # trainer.agent.manager.AgentRollout, on the first agent-loop rollout
        for model in (self.model, self.ref):  # offloaded ones go to the host until their phase
            if model is not None:
                self.phases.home(model, self.optim if model is self.model else None)

    @property
    def fsdp_config(self) -> Any:
        return self.cfg.actor_rollout_ref.actor.fsdp_config

    @property
    def remove_padding(self) -> bool:
        return bool(self.cfg.actor_rollout_ref.model.use_remove_padding)

    def _build_rollout(self) -> tuple[Any, bool]:
        """The engine, and whether it generates with the training model itself (no sync)."""
        arr = self.cfg.actor_rollout_ref
        pad = self.tokenizer.pad_token_id
        eos = M.eos_token_ids(arr.model.path, self.tokenizer, trust_remote_code=arr.model.trust_remote_code)
        tp = arr.rollout.tensor_model_parallel_size  # the ranks of one engine share its seed
        if server_mode(self.cfg):  # a server-mode replica per engine, started by its first rank
            devices = replica_devices(self.engine_group, self.gpu)
            if self.engine_group is not None and self.engine_group.rank() > 0:
                return ReplicaMember(arr.rollout.free_cache_engine), False
            return ServerEngine.from_config(self.cfg, self.tokenizer, eos, seed=self.cfg.trainer.seed + self.rank // tp,
                                            devices=devices), False
        if arr.rollout.name == "vllm":
            return VLLMRolloutEngine.from_config(self.cfg, self.tokenizer, eos,
                                                 seed=self.cfg.trainer.seed + self.rank // tp), False
        assert self.ctx is not None
        if not self.ctx.fsdp and tp == 1:
            return HFRolloutEngine(self.model, pad, eos), True
        # A sharded model cannot generate rank by rank (its forwards are collectives): keep a
        # copy for generation, whole or split over the `tp` ranks of this rank's group (which
        # get the same prompts and seed), and sync it from the gathered weights.
        copy = rollout_copy(arr.model.path, tp, self.ctx.world_size, self.device,
                            dtype=M.compute_dtype(arr.rollout.dtype, self.device),
                            trust_remote_code=arr.model.trust_remote_code, config_updates=self.config_updates)
        return HFRolloutEngine(copy, pad, eos, offload=True), False

    # ------------------------------------------------------------------ rollout

    def sync_rollout_weights(self) -> float:
        """Stream the actor's current weights into the rollout engine, one bucket of
        `update_weights_bucket_megabytes` at a time (a collective under FSDP: each parameter is
        gathered whole on every rank, then loaded and freed), in verl's memory order
        (``rollout_mode`` of its `fsdp_workers.py`): empty the cache the update left, wake the
        engine's weights, stream, empty the cache again, and only then wake the KV cache, which
        vLLM sizes from the memory left free. The engine stays awake until the next rollout.
        Returns seconds."""
        start = time.perf_counter()
        if not self.shares_weights:
            memory = self.phases.memory
            with self.phases.track("weight_sync"):
                memory.empty_cache()
                self.rollout.wake_up(tags=["weights"])
                bucket_bytes = self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20
                with self.phases.on_device("weight_sync", self.model):
                    self.phases.require_resident(self.model, "the weight sync (`full_tensor()`)")
                    self.rollout.sync_weights(P.weight_buckets(self.model, bucket_bytes))
                memory.empty_cache()
                self.rollout.wake_up(tags=["kv_cache"])
        return time.perf_counter() - start

    def export_weights(self) -> list[Any]:
        """The actor's current weights for a rollout pool of its own
        (:meth:`trainer.workers.rollout_pool.RolloutWorker.load_weights`): gathered bucket by
        bucket as for the colocated sync (a collective: every rank iterates), each bucket
        copied to host memory by rank 0 and put in Ray's object store; rank 0 returns the
        buckets' references in order, the other ranks none.

        The path is host memory on both sides: a device-to-host copy here, a host-to-device one
        in the pool. verl's checkpoint engine (`checkpoint_engine.backend=nccl`) broadcasts the
        buckets between the pools' GPUs instead (NCCL, no host copy); that path needs GPUs on
        both sides and is not built. The whole model passes through the object store once per
        sync (Ray spills it to disk when its memory is short)."""
        import ray

        refs: list[Any] = []
        bucket_bytes = self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20
        with self.phases.track("weight_sync"), self.phases.on_device("weight_sync", self.model):
            self.phases.require_resident(self.model, "the weight export (`full_tensor()`)")
            for bucket in P.weight_buckets(self.model, bucket_bytes):
                if self.rank == 0:  # the bucket is emptied in place for the next: copy it out
                    refs.append(ray.put([(name, t.detach().to("cpu", copy=True)) for name, t in bucket]))
        self.phases.memory.empty_cache()
        return refs

    def weight_broadcast_address(self, receivers: int, wire_dtype: str) -> WB.BroadcastAddress | None:
        """Rank 0: the address of the weight broadcast to `receivers` pool ranks (its store served
        here from the first call on), the backend (NCCL between GPUs, gloo between CPUs) and the
        bucket layout, floating tensors in `wire_dtype` (the pool engine's). Other ranks: None."""
        if self.rank != 0:
            return None
        if self.broadcast_address is None:
            bucket_bytes = self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20
            layout = WB.plan_layout(((e.name, e.dtype, e.shape) for e in P.state_entries(self.model)),
                                    bucket_bytes, getattr(torch, wire_dtype))
            host = node_ip()
            self.broadcast_store = WB.serve_store(host, receivers + 1, self.cfg.actor_rollout_ref.nccl_timeout)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.broadcast_address = WB.BroadcastAddress(host, int(self.broadcast_store.port), receivers + 1,
                                                         backend, layout)
        return self.broadcast_address

    def broadcast_weights(self, version: int, overlap: bool) -> tuple[float, float, float]:
        """The weight sync to the rollout pool as a collective broadcast
        (:mod:`trainer.workers.weight_broadcast`): every rank gathers bucket by bucket (a
        collective of the trainer's group), rank 0 broadcasts them to the pool's ranks, which
        call `receive_weights` at the same time. The first call forms the broadcast group.
        Returns seconds, bytes sent and seconds waiting on the network (rank 0's; zeros
        elsewhere)."""
        start = time.perf_counter()
        bucket_bytes = self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20
        with self.phases.track("weight_sync"), self.phases.on_device("weight_sync", self.model):
            self.phases.require_resident(self.model, "the weight broadcast (`full_tensor()`)")
            tensors = (item for bucket in P.weight_buckets(self.model, bucket_bytes) for item in bucket)
            if self.rank != 0:
                for _ in tensors:  # the gathers are collective: every rank walks the state
                    pass
                stats = WB.SyncStats(0.0, 0, 0.0)
            else:
                address = self.broadcast_address
                assert address is not None, "`weight_broadcast_address` comes first"
                if self.broadcast_group is None:
                    self.broadcast_group = WB.open_group(address, 0, self.cfg.actor_rollout_ref.nccl_timeout,
                                                         store=self.broadcast_store)
                sender = WB.Sender(self.broadcast_group, address.layout, self.device, overlap=overlap)
                stats = sender.send(tensors, version)
        self.phases.memory.empty_cache()
        return time.perf_counter() - start, float(stats.bytes), stats.wait_s

    def weights_digest(self) -> dict[str, float]:
        """Each state-dict entry's sum of absolute values, as the weight sync sends them (a
        collective; rank 0's answer is the whole model's, the others' empty): for tests, which
        compare it with the pool's (:meth:`trainer.workers.rollout_pool.RolloutWorker.weights_digest`)."""
        out: dict[str, float] = {}
        with self.phases.on_device("weight_sync", self.model):
            for bucket in P.weight_buckets(self.model, 2**26):
                out.update({name: float(t.double().abs().sum()) for name, t in bucket} if self.rank == 0 else {})
        return out

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def _log_probs(self, model: Any, batch: StepBatch, section: Any, entropy: bool, phase: str
                   ) -> dict[str, Any]:
        start = time.perf_counter()
        with self.phases.on_device(phase, model):
            out = self._log_probs_on_device(model, batch, section, entropy)
        return {**out, "seconds": time.perf_counter() - start}

    def _log_probs_on_device(self, model: Any, batch: StepBatch, section: Any, entropy: bool) -> dict[str, Any]:
        batch = batch.to(self.device)
        rows = self._micro(batch, section.log_prob_micro_batch_size_per_gpu,
                           bool(section.log_prob_use_dynamic_bsz), int(section.log_prob_max_token_len_per_gpu or 0))
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        lp = torch.zeros_like(batch.response_mask)
        ent = torch.zeros_like(batch.response_mask) if entropy else None
        was_training = model.training
        model.eval()
        for part in rows:
            mb = batch.select(part)
            out, e = M.compute_log_probs(model, mb.input_ids, mb.attention_mask, batch.response_length,
                                         temperature=temperature, calculate_entropy=entropy,
                                         remove_padding=self.remove_padding)
            lp[part] = out
            if ent is not None and e is not None:
                ent[part] = e
        model.train(was_training)
        P.reshard(model)
        return {"log_probs": lp.cpu(), "entropy": None if ent is None else ent.cpu()}

    def compute_log_probs(self, batch: StepBatch) -> dict[str, Any]:
        return self._log_probs(self.model, batch, self.cfg.actor_rollout_ref.rollout, True, "old_log_prob")

    def compute_ref_log_probs(self, batch: StepBatch) -> dict[str, Any]:
        """The reference policy's log-probs: the reference model's, or with LoRA the actor's
        with its adapters disabled (the base model, as verl computes them)."""
        section = self.cfg.actor_rollout_ref.ref
        if self.lora:
            with self.model.disable_adapter():
                return self._log_probs(self.model, batch, section, False, "ref")
        return self._log_probs(self.ref, batch, section, False, "ref")

    # ------------------------------------------------------------------ update

    def _loss_params(self) -> core_algos.PolicyLossParams:
        a = self.cfg.actor_rollout_ref.actor
        pl = a.policy_loss
        return core_algos.PolicyLossParams(
            clip_ratio_low=float(a.clip_ratio_low), clip_ratio_high=float(a.clip_ratio_high),
            clip_ratio_c=float(a.clip_ratio_c), tau_pos=float(a.tau_pos), tau_neg=float(a.tau_neg),
            clip_cov_ratio=float(pl.clip_cov_ratio), clip_cov_lb=float(pl.clip_cov_lb),
            clip_cov_ub=float(pl.clip_cov_ub), kl_cov_ratio=float(pl.kl_cov_ratio),
            ppo_kl_coef=float(pl.ppo_kl_coef))

    def _micro_loss(self, mb: StepBatch, agg: dict[str, Any], keep_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """`(loss, pg_loss, kl_loss, metrics)` of one micro-batch, unscaled. Without old
        log-probs (the driver's `reuses_update_log_probs`) its own log-probs, detached, stand in
        for them; `keep_entropy` keeps its entropies in `mb.entropy` for the metric."""
        a = self.cfg.actor_rollout_ref.actor
        log_prob, entropy = M.compute_log_probs(
            self.model, mb.input_ids, mb.attention_mask, mb.response_length,
            temperature=self.cfg.actor_rollout_ref.rollout.temperature,
            calculate_entropy=a.entropy_coeff != 0 or keep_entropy, entropy_grad=a.entropy_coeff != 0,
            remove_padding=self.remove_padding)
        if keep_entropy:
            mb.entropy = need(entropy, "entropy").detach()
        old = log_prob.detach() if mb.old_log_probs is None else mb.old_log_probs
        pg_loss, info = self.policy_loss(old, log_prob, need(mb.advantages, "advantages"), mb.response_mask,
                                         a.loss_agg_mode, self.loss_params,
                                         rollout_is_weights=mb.rollout_is_weights, **agg)
        loss, kl_loss = pg_loss, None
        if a.entropy_coeff != 0 and entropy is not None:
            loss = loss - a.entropy_coeff * core_algos.agg_loss(entropy, mb.response_mask, a.loss_agg_mode, **agg)
        if a.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, need(mb.ref_log_probs, "ref_log_probs"), a.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, mb.response_mask, a.loss_agg_mode, **agg)
            loss = loss + a.kl_loss_coef * kl_loss
            info["actor/kl_coef"] = a.kl_loss_coef
        return loss, pg_loss, kl_loss, info

    def _update_mini(self, share: MiniBatchShare, keep_entropy: bool, collected: dict[str, list[float]],
                     totals: dict[str, float]) -> torch.Tensor | None:
        """One optimizer step on this rank's rows of one mini-batch (which may be none: every
        row of the mini-batch was skipped); with `keep_entropy`, the entropy of each row.
        `totals` gathers verl's `actor/pg_loss` and `actor/kl_loss`: each micro-batch's loss
        times its scale, summed over micro-batches, mini-batches and epochs (verl b178a3c
        verl/workers/actor/dp_actor.py:662 `metrics["actor/pg_loss"] += pg_loss.detach().item() *
        loss_scale_factor`, :649 the same for `actor/kl_loss`, both started at 0.0 at :546)."""
        a, n = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout.n
        mini = share.batch.to(self.device)
        entropy = torch.zeros_like(mini.response_mask) if keep_entropy else None
        if len(mini) == 0:
            self._zero_grads()
        for rows in self._micro(mini, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                a.ppo_max_token_len_per_gpu) if len(mini) else []:
            mb = mini.select(rows)
            agg, scale = self._loss_scale(share, len(rows), a.ppo_mini_batch_size * n, a.ppo_micro_batch_size_per_gpu,
                                          a.use_dynamic_bsz, a.loss_scale_factor)
            loss, pg_loss, kl_loss, info = self._micro_loss(mb, agg, keep_entropy)
            (loss * scale).backward()
            if entropy is not None:
                entropy[rows] = need(mb.entropy, "entropy")
            totals["actor/pg_loss"] += pg_loss.item() * scale
            totals["actor/kl_loss"] += 0.0 if kl_loss is None else kl_loss.item() * scale
            for key, value in info.items():
                collected[key].append(value)
        collected["actor/grad_norm"].append(self._optimizer_step(a.grad_clip))
        return entropy

    def update_actor(self, epochs: list[list[MiniBatchShare]], keep_entropy: bool = False) -> dict[str, Any]:
        """One optimizer step per mini-batch; `epochs[e][m]` is this rank's part of mini-batch m.
        With `keep_entropy` (one mini-batch whose forward supplies the old log-probs) the result
        holds the entropy of each of this rank's rows."""
        start, tokens = time.perf_counter(), 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        totals: dict[str, float] = defaultdict(float)
        entropy: torch.Tensor | None = None
        self.model.train()
        with self.phases.on_device("update_actor", self.model, self.optim):  # in and out once per step
            for minis in epochs:
                for share in minis:
                    tokens += float(share.batch.attention_mask.sum())
                    entropy = self._update_mini(share, keep_entropy, collected, totals)
        for key in ("actor/pg_loss", "actor/kl_loss"):  # verl reports both, kl_loss 0 without a KL loss
            collected[key].append(totals[key])
        collected["actor/lr"].append(self.lr())  # the rate this update used (verl: before the step)
        self.sched.step()
        return {"metrics": {k: v for k, v in collected.items() if v}, "seconds": time.perf_counter() - start,
                "tokens": tokens, "entropy": None if entropy is None else entropy.cpu(),
                "device_name": self.device_name(), "flops_fields": flops_fields(self.model.config)}

    # ------------------------------------------------------------------ checkpoints

    def score_reward_model(self, path: str, dtype: str | None, texts: list[str | list[int]],
                           rows_per_forward: int | None = None) -> list[float]:
        """A colocated discriminative reward model's scores (:mod:`trainer.workers.reward`)."""
        return score_on_rank(self, path, dtype, texts, rows_per_forward)

    def save_checkpoint(self, tmp: str) -> float:
        """The actor's checkpoint, taken with the rollout engine asleep: it is awake since the
        weight sync (its KV cache holds `gpu_memory_utilization` of the device), and the save
        brings offloaded state back and gathers parameters for the HF export on top of it. The
        next rollout wakes it (after a level-2 sleep, with a weight sync first:
        :meth:`generate`). The whole model is exported to `huggingface/` only with `hf_model` in
        `actor.checkpoint.save_contents` (verl's rule), otherwise its config and tokenizer."""
        arr = self.cfg.actor_rollout_ref
        self._sleep_rollout()
        return self.save(tmp, "actor", self.cfg.data.tokenizer or arr.model.path,
                         hf_weights="hf_model" in arr.actor.checkpoint.save_contents)

    def load_checkpoint(self, path: str) -> float:
        return self.load(path, "actor")
