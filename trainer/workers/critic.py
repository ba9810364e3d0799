"""The critic (value model) worker of one rank."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from trainer import models as M
from trainer import parallel as P
from trainer.algos import core_algos
from trainer.batch import MiniBatchShare, StepBatch, need
from trainer.workers.base import Worker

__all__ = ["CriticWorker"]


class CriticWorker(Worker):
    """The value model of one rank."""

    role = "critic"

    def build(self) -> None:
        c = self.cfg.critic
        assert c.model.path is not None
        self.model = self._place(M.load_critic(c.model.path, dtype=c.model.fsdp_config.model_dtype,
                                               gradient_checkpointing=c.model.enable_gradient_checkpointing,
                                               trust_remote_code=c.model.trust_remote_code),
                                 c.model.fsdp_config, "critic.model.fsdp_config")
        self.model.train()
        self._optimizer(c.optim)

    @property
    def fsdp_config(self) -> Any:
        return self.cfg.critic.model.fsdp_config

    @torch.no_grad()
    def compute_values(self, batch: StepBatch) -> dict[str, Any]:
        start = time.perf_counter()
        c = self.cfg.critic
        batch = batch.to(self.device)
        values = torch.zeros_like(batch.response_mask)
        self.model.eval()
        for part in self._micro(batch, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                int(c.forward_max_token_len_per_gpu or 0)):
            mb = batch.select(part)
            values[part] = M.compute_values(self.model, mb.input_ids, mb.attention_mask, batch.response_length,
                                            remove_padding=c.model.use_remove_padding)
        self.model.train()
        P.reshard(self.model)
        return {"values": (values * batch.response_mask).cpu(), "seconds": time.perf_counter() - start}

    def _update_mini(self, share: MiniBatchShare, collected: dict[str, list[float]]) -> None:
        c = self.cfg.critic
        mini = share.batch.to(self.device)
        agg, vf_loss = self._agg_kwargs(share.num_tokens, share.num_seqs), 0.0
        for rows in self._micro(mini, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                c.ppo_max_token_len_per_gpu):
            mb = mini.select(rows)
            vpreds = M.compute_values(self.model, mb.input_ids, mb.attention_mask, mini.response_length,
                                      remove_padding=c.model.use_remove_padding)
            loss, clipfrac = core_algos.compute_value_loss(
                vpreds, need(mb.returns, "returns"), need(mb.values, "values"), mb.response_mask,
                c.cliprange_value, str(c.loss_agg_mode), **agg)
            loss.backward()
            vf_loss += loss.item()
            collected["critic/vf_clipfrac"].append(clipfrac.item())
        collected["critic/vf_loss"].append(vf_loss)
        collected["critic/grad_norm"].append(self._optimizer_step(c.grad_clip))

    def update_critic(self, epochs: list[list[MiniBatchShare]]) -> dict[str, Any]:
        """One optimizer step per mini-batch; `epochs[e][m]` is this rank's part of mini-batch m."""
        start, tokens = time.perf_counter(), 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for minis in epochs:
            for share in minis:
                tokens += float(share.batch.attention_mask.sum())
                self._update_mini(share, collected)
        self.sched.step()
        collected["critic/lr"].append(self.lr())
        return {"metrics": {k: v for k, v in collected.items() if v}, "seconds": time.perf_counter() - start,
                "tokens": tokens}

    def save_checkpoint(self, tmp: str) -> float:
        return self.save(tmp, "critic")

    def load_checkpoint(self, path: str) -> float:
        return self.load(path, "critic")
