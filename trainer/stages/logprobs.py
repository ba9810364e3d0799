"""The log-prob stage: the old and reference log-probs (the actor group) and the values (the
critic group), each computed on every rank's rows and reassembled in row order; and the rule
for when the actor update supplies the old log-probs itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.algos import core_algos
from trainer.batch import StepBatch, need
from trainer.config import Config
from trainer.parallel import balanced_split, split_rows
from trainer.workers.group import WorkerGroup

__all__ = ["Note", "entropy_metric", "old_log_probs", "on_ranks", "ref_log_probs", "reuses_update_log_probs",
           "split_batch", "values"]

#: Records a per-rank figure (`dp/rank_<r>/<name>`) and returns the largest.
Note = Callable[[str, list[float]], float]


def split_batch(batch: StepBatch, world: int, balance: bool) -> list[list[int]]:
    """Rows of each rank: contiguous, or with `trainer.balance_batch` equal counts of similar
    token totals (the maths does not depend on the split, only the load does)."""
    if balance:
        return balanced_split(batch.attention_mask.sum(-1).long().tolist(), world)
    return split_rows(len(batch), world)


def on_ranks(group: WorkerGroup, method: str, batch: StepBatch, key: str, parts: list[list[int]],
             note: Note, phase: str) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """`method` on every rank's rows (`parts`) of `batch`; its `key` output reassembled in row
    order, and each rank's whole result."""
    results = group.run_each(method, [(batch.select(p).tensors_only(),) for p in parts])
    note(f"{phase}_s", [r["seconds"] for r in results])
    out = torch.zeros_like(batch.response_mask)
    for part, res in zip(parts, results, strict=True):
        if part:
            out[part] = res[key]
    return out, results


def entropy_metric(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """verl's `actor/entropy`: the entropies aggregated as the policy loss is."""
    return float(core_algos.agg_loss(entropy, response_mask, loss_agg_mode).item())


def old_log_probs(batch: StepBatch, actor: WorkerGroup, parts: list[list[int]], loss_agg_mode: str,
                  note: Note, bypass: bool = False) -> dict[str, float]:
    """Fill `batch.old_log_probs` and `batch.entropy` with the actor's current weights; in
    rollout correction's bypass mode (`bypass`) the old log-probs are the rollout's, with no
    forward pass and no entropy (verl's `apply_bypass_mode` in `rollout_corr_helper.py`, called by
    `RayPPOTrainer.fit` in place of `_compute_old_log_prob`)."""
    if bypass:
        batch.old_log_probs = need(batch.rollout_log_probs, "rollout_log_probs")
        return {}
    batch.old_log_probs, results = on_ranks(actor, "compute_log_probs", batch, "log_probs", parts, note,
                                            "old_log_prob")
    batch.entropy = torch.zeros_like(batch.response_mask)
    for part, res in zip(parts, results, strict=True):
        if part:
            batch.entropy[part] = res["entropy"]
    return {"actor/entropy": entropy_metric(batch.entropy, batch.response_mask, loss_agg_mode)}


def ref_log_probs(batch: StepBatch, actor: WorkerGroup, parts: list[list[int]], note: Note) -> None:
    """Fill `batch.ref_log_probs` (the reference policy, held by the actor group)."""
    batch.ref_log_probs, _ = on_ranks(actor, "compute_ref_log_probs", batch, "log_probs", parts, note, "ref")


def values(batch: StepBatch, critic: WorkerGroup, parts: list[list[int]], note: Note) -> None:
    """Fill `batch.values` (the critic's)."""
    batch.values, _ = on_ranks(critic, "compute_values", batch, "values", parts, note, "values")


def reuses_update_log_probs(cfg: Config, batch: StepBatch) -> bool:
    """Whether the actor update supplies the old log-probs itself, skipping their forward pass.

    When the update is one optimiser step over the whole batch (one PPO epoch, one
    mini-batch) and nothing needs the old log-probs before it (no KL in the reward), every
    micro-batch's forward runs with the weights the old log-probs would be recomputed with:
    the old log-probs are that forward's log-probs, detached (the ratio is exactly 1, the
    on-policy case). With dropout the recomputation would run without it; here it does not.
    """
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    return (a.ppo_epochs == 1 and len(batch) <= a.ppo_mini_batch_size * n
            and not cfg.algorithm.use_kl_in_reward and batch.rollout_log_probs is None)
