"""The critic (value model) worker of one rank."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from trainer import critic_model as CM
from trainer import models as M
from trainer import parallel as P
from trainer.algos import core_algos
from trainer.batch import MiniBatchShare, StepBatch, need
from trainer.hf_overrides import config_updates
from trainer.metrics import flops_fields
from trainer.workers.base import Worker

__all__ = ["CriticWorker"]


class CriticWorker(Worker):
    """The value model of one rank."""

    role = "critic"

    def build(self) -> None:
        c = self.cfg.critic
        assert c.model.path is not None
        tokenizer_path, tokenizer_trust = self.cfg.tokenizer_source  # the ids of the tokens it scores
        tokenizer = M.load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trust)
        self.model = self._place(CM.load_critic(c.model.path, dtype=c.model.fsdp_config.model_dtype,
                                               attn_implementation=self._attention(c.model.fsdp_config),
                                               gradient_checkpointing=c.model.enable_gradient_checkpointing,
                                               trust_remote_code=c.model.trust_remote_code,
                                               config_updates=config_updates(c.model.override_config, tokenizer)),
                                 c.model.fsdp_config, "critic.model.fsdp_config")
        self.model.train()
        self._optimizer(c.optim)
        self.phases.home(self.model, self.optim)

    @property
    def fsdp_config(self) -> Any:
        return self.cfg.critic.model.fsdp_config

    @torch.no_grad()
    def compute_values(self, batch: StepBatch) -> dict[str, Any]:
        start = time.perf_counter()
        with self.phases.on_device("values", self.model):
            values = self._values(batch)
        return {"values": values, "seconds": time.perf_counter() - start}

    def _values(self, batch: StepBatch) -> torch.Tensor:
        c = self.cfg.critic
        batch = batch.to(self.device)
        values = torch.zeros_like(batch.response_mask)
        self.model.eval()
        for part in self._micro(batch, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                int(c.forward_max_token_len_per_gpu or 0)):
            mb = batch.select(part)
            values[part] = CM.compute_values(self.model, mb.input_ids, mb.attention_mask, batch.response_length,
                                            remove_padding=c.model.use_remove_padding)
        self.model.train()
        P.reshard(self.model)
        return (values * batch.response_mask).cpu()

    def _value_loss_scale(self, share: MiniBatchShare, micro_rows: int) -> tuple[dict[str, Any], float]:
        """Normalisers and factor of one micro-batch's value loss. verl's default worker
        (dp_critic.py `update_critic`): the micro-batch mean times its share of the mini-batch,
        as the actor's. verl's model engine (losses.py `value_loss`) passes no normalisers and no
        factor: each micro-batch's own mean, summed over the micro-batches."""
        c = self.cfg.critic
        if self.global_normalisers:
            return {"loss_scale_factor": float(self.cfg.data.max_response_length)}, 1.0
        mini_size = int(c.ppo_mini_batch_size or 1) * self.cfg.actor_rollout_ref.rollout.n
        return self._loss_scale(share, micro_rows, mini_size, c.ppo_micro_batch_size_per_gpu,
                                bool(c.use_dynamic_bsz))

    def _update_mini(self, share: MiniBatchShare, collected: dict[str, list[float]]) -> float:
        """One optimizer step on this rank's rows of one mini-batch; returns its `critic/vf_loss`
        share: each micro-batch's loss times its scale, summed (verl b178a3c
        verl/workers/critic/dp_critic.py:256 `metrics["critic/vf_loss"] += vf_loss.detach().item() *
        loss_scale_factor`)."""
        c = self.cfg.critic
        mini = share.batch.to(self.device)
        vf_loss = 0.0
        for rows in self._micro(mini, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                c.ppo_max_token_len_per_gpu):
            mb = mini.select(rows)
            agg, scale = self._value_loss_scale(share, len(rows))
            vpreds = CM.compute_values(self.model, mb.input_ids, mb.attention_mask, mini.response_length,
                                      remove_padding=c.model.use_remove_padding)
            loss, clipfrac = core_algos.compute_value_loss(
                vpreds, need(mb.returns, "returns"), need(mb.values, "values"), mb.response_mask,
                c.cliprange_value, str(c.loss_agg_mode), **agg)
            (loss * scale).backward()
            vf_loss += loss.item() * scale
            collected["critic/vf_clipfrac"].append(clipfrac.item())
            collected["critic/vpred_mean"].append(core_algos.masked_mean(vpreds, mb.response_mask).item())
        collected["critic/grad_norm"].append(self._optimizer_step(c.grad_clip))
        return vf_loss

    def update_critic(self, epochs: list[list[MiniBatchShare]]) -> dict[str, Any]:
        """One optimizer step per mini-batch; `epochs[e][m]` is this rank's part of mini-batch m.
        `critic/vf_loss` is summed over mini-batches and epochs, as verl."""
        start, tokens, vf_loss = time.perf_counter(), 0.0, 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        with self.phases.on_device("update_critic", self.model, self.optim):  # in and out once per step
            for minis in epochs:
                for share in minis:
                    tokens += float(share.batch.attention_mask.sum())
                    vf_loss += self._update_mini(share, collected)
        collected["critic/vf_loss"].append(vf_loss)
        collected["critic/lr"].append(self.lr())  # the rate this update used (verl: before the step)
        self.sched.step()
        return {"metrics": {k: v for k, v in collected.items() if v}, "seconds": time.perf_counter() - start,
                "tokens": tokens, "device_name": self.device_name(), "flops_fields": flops_fields(self.model.config)}

    def save_checkpoint(self, tmp: str) -> float:
        return self.save(tmp, "critic")

    def load_checkpoint(self, path: str) -> float:
        return self.load(path, "critic")
