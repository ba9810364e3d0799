"""The update stage: the critic and actor updates over the step's batch. The batch is cut into
verl's mini-batches, each rank gets its share of each with the loss normalisers of the whole
mini-batch (so the update does not depend on the number of ranks), the rows whose loss has no
gradient may skip their passes, and the ranks' metrics are merged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.algos import core_algos, registry
from trainer.batch import MiniBatchShare, StepBatch, need, step_seed
from trainer.config import Config
from trainer.metrics import mfu
from trainer.parallel import rank_mini_batches
from trainer.stages.logprobs import Note, entropy_metric
from trainer.workers.group import WorkerGroup

__all__ = ["MiniBatcher", "keeps_every_row", "measures_entropy", "merge", "rows_to_update", "step_mfu",
           "update_actor", "update_critic"]

#: Names the rows of a mini-batch to compute (the others skip their passes).
Skip = Callable[[StepBatch], list[int]]


@dataclass
class MiniBatcher:
    """How one step's batch becomes each rank's shares of its mini-batches."""

    world: int
    split: Callable[[StepBatch], list[list[int]]]
    """Rows of each rank (:func:`trainer.stages.logprobs.split_batch`)."""
    seed: int
    step: int
    model_engine: bool
    """`trainer.use_legacy_worker_impl=disable` (verl's model engine)."""

    def mini_batches(self, batch: StepBatch, mini_size: int, shuffle: bool, salt: int) -> list[list[list[int]]]:
        """Rows of every mini-batch, per rank, as verl forms them: the batch is first split over
        the ranks (each rank's rows in its order), then each rank's rows are cut into local
        mini-batches (:func:`~trainer.parallel.rank_mini_batches`). Which rows share a
        mini-batch, a rank and a micro-batch changes the update under verl's per-micro-batch
        means, so this order is verl's. `shuffle` acts only under verl's model engine (where
        verl's loader shuffles each rank's rows): there each rank's rows are permuted (this
        trainer's seeded permutation, not the one torch's sampler draws in verl); verl's default
        worker ignores it, and so does this."""
        per_rank = self.split(batch)
        local = max(mini_size // self.world, 1)
        if shuffle and self.model_engine:
            gen = torch.Generator().manual_seed(step_seed(self.seed, self.step, salt))
            per_rank = [[rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()] for rows in per_rank]
        return rank_mini_batches(per_rank, local)

    def fill_to_ranks(self, rows: list[int], size: int) -> list[int]:
        """`rows` topped up with skipped rows (whose gradient is zero) to a multiple of the
        number of ranks, so every rank runs as many forward passes (FSDP's collectives need it)."""
        short = -len(rows) % self.world
        chosen = set(rows)
        extra = [r for r in range(size) if r not in chosen][:short]
        return sorted(rows + extra)

    def shares(self, batch: StepBatch, ranks_rows: list[list[int]], skip: Skip | None
               ) -> tuple[list[MiniBatchShare], list[list[int]], float]:
        """Each rank's share of one mini-batch (`ranks_rows`: rows of `batch` per rank) with the
        normalisers of the whole mini-batch, the rows of `batch` each share holds, and the
        fraction of rows skipped. `skip(mini)` names the rows of the mini-batch to compute
        (None: all, each rank its own rows in verl's order); the kept rows are then re-split
        over the ranks, which changes no number where rows may be skipped (global normalisers)."""
        union = [r for rows in ranks_rows for r in rows]
        mini = batch.select(union)
        tokens, seqs = core_algos.loss_normalizers(mini.response_mask)
        if skip is None:
            parts, at = [], 0
            for rows in ranks_rows:
                parts.append(list(range(at, at + len(rows))))
                at += len(rows)
        else:
            kept = self.fill_to_ranks(skip(mini), len(mini))
            parts = [[kept[i] for i in part] for part in self.split(mini.select(kept))]
        shares = [MiniBatchShare(mini.select(part).tensors_only(), tokens, seqs) for part in parts]
        return shares, [[union[i] for i in part] for part in parts], 1.0 - sum(map(len, parts)) / len(union)

    def rank_minis(self, batch: StepBatch, mini_size: int, shuffle: bool, epochs: int, salt: int,
                   skip: Skip | None = None) -> tuple[list[tuple[Any, ...]], list[float], list[list[int]]]:
        """Per rank: for each epoch, its share of every mini-batch; the fraction of rows skipped
        in each mini-batch; and the rows of `batch` each rank holds in the last mini-batch, in
        its order (what the entropy the update measures belongs to)."""
        per_rank: list[list[list[MiniBatchShare]]] = [[] for _ in range(self.world)]
        skipped: list[float] = []
        rows_of: list[list[int]] = [[] for _ in range(self.world)]
        for epoch in range(epochs):
            shares_of_minis = []
            for ranks_rows in self.mini_batches(batch, mini_size, shuffle, salt + epoch):
                shares, rows_of, frac = self.shares(batch, ranks_rows, skip)
                skipped.append(frac)
                shares_of_minis.append(shares)
            for rank in range(self.world):
                per_rank[rank].append([shares[rank] for shares in shares_of_minis])
        return [(epochs_of_rank,) for epochs_of_rank in per_rank], skipped, rows_of


def keeps_every_row(cfg: Config, keep_entropy: bool) -> bool:
    """Whether the actor update computes every row in verl's places (see :func:`rows_to_update`)."""
    a = cfg.actor_rollout_ref.actor
    micro_means = cfg.trainer.use_legacy_worker_impl != "disable"  # a skipped row would change them
    row_mean = a.policy_loss.loss_mode in registry.ROW_MEAN_LOSSES  # so would it a loss's own mean of rows
    return keep_entropy or a.entropy_coeff != 0 or a.use_kl_loss or micro_means or row_mean


def rows_to_update(mini: StepBatch) -> list[int]:
    """Rows of `mini` whose loss has a gradient; the others skip their forward and backward passes.

    With neither an entropy bonus nor a KL loss, a row whose advantages are all zero (a GRPO
    group whose samples scored alike) adds exactly zero to the policy gradient, and under
    `trainer.use_legacy_worker_impl=disable` the loss normalisers (from the whole mini-batch)
    still count it. verl's default worker divides by each micro-batch's own counts, which a
    skipped row (or a row moved to another micro-batch) would change: there every row is
    kept where verl computes it (:func:`keeps_every_row`). Every row is kept too when the
    update must supply the entropy metric.
    """
    advantages = need(mini.advantages, "advantages") * mini.response_mask
    return torch.nonzero((advantages != 0).any(dim=-1)).flatten().tolist()


def measures_entropy(batch: StepBatch) -> bool:
    """The old log-probs come from the actor update and the rollout gave no entropies: the
    update measures them."""
    return batch.old_log_probs is None and batch.entropy is None


def merge(results: list[dict[str, Any]], prefix: str, note: Note) -> dict[str, float]:
    """Rank metrics merged: every value is the mean over ranks and mini-batches (loss shares
    average to the whole mini-batch's loss because each is scaled by the world size)."""
    keys = {k for r in results for k in r["metrics"]}
    merged = {k: float(np.mean([v for r in results for v in r["metrics"].get(k, [])])) for k in keys}
    note(f"{prefix}_s", [r["seconds"] for r in results])
    note(f"{prefix}_tokens", [r["tokens"] for r in results])
    return merged


def step_mfu(batch: StepBatch, results: list[dict[str, Any]], epochs: int, world: int) -> float:
    """verl's `perf/mfu/<role>`: the model FLOPs of `epochs` passes over every row of the
    batch in each rank's update time, per rank, over its device's promised FLOP/s; the mean
    over ranks."""
    seqlens = batch.attention_mask.sum(-1).long().tolist()
    return float(np.mean([mfu(r["flops_fields"], seqlens, r["seconds"], r["device_name"],
                              epochs=epochs, world_size=world) for r in results]))


def update_critic(batch: StepBatch, critic: WorkerGroup, cfg: Config, batcher: MiniBatcher,
                  note: Note) -> dict[str, float]:
    """One critic update over `batch` (`critic.ppo_epochs` passes of its mini-batches)."""
    c, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
    args, _, _ = batcher.rank_minis(batch, int(c.ppo_mini_batch_size or 1) * n, bool(c.shuffle),
                                    int(c.ppo_epochs or 1), 100)
    results = critic.run_each("update_critic", args)
    metrics = merge(results, "update_critic", note)
    metrics["perf/mfu/critic"] = step_mfu(batch, results, int(c.ppo_epochs or 1), batcher.world)
    return metrics


def update_actor(batch: StepBatch, actor: WorkerGroup, cfg: Config, batcher: MiniBatcher, note: Note,
                 skip: Skip | None) -> dict[str, float]:
    """One actor update over `batch`; `skip` names each mini-batch's rows to compute (None:
    every row, see :func:`keeps_every_row`)."""
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    keep_entropy = measures_entropy(batch)
    args, skipped, rows_of = batcher.rank_minis(batch, a.ppo_mini_batch_size * n, a.shuffle, a.ppo_epochs, 0,
                                                skip=skip)
    results = actor.run_each("update_actor", [(*arg, keep_entropy) for arg in args])
    metrics = merge(results, "update_actor", note)
    metrics["perf/mfu/actor"] = step_mfu(batch, results, a.ppo_epochs, batcher.world)
    metrics["actor/skipped_row_frac"] = float(np.mean(skipped))
    if keep_entropy:  # one mini-batch, every row kept: each rank's rows in its split order
        metrics["actor/entropy"] = entropy_metric(
            torch.cat([r["entropy"] for r in results]), batch.response_mask[sum(rows_of, [])], a.loss_agg_mode)
    return metrics
