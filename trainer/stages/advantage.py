"""The advantage stage: the KL penalty in the reward (`algorithm.use_kl_in_reward`), the rollout
correction where the rollout's log-probs exist (`algorithm.rollout_correction`), the configured
advantage estimator (verl's `compute_advantage`), then PF-PPO's redraw of the rows
(`algorithm.use_pf_ppo`), in verl's order."""

from __future__ import annotations

from typing import Any

import torch

from trainer.algos import core_algos, rollout_corr
from trainer.batch import StepBatch, need
from trainer.config import AlgorithmConfig

__all__ = ["compute_advantages", "correct_rollout", "resample_pf_ppo"]


def correct_rollout(batch: StepBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """verl's decoupled rollout correction (`compute_rollout_correction_and_add_to_batch`), run
    where the batch has the rollout's log-probs, as verl runs it: rejected tokens leave
    `batch.response_mask` (so the advantages, the losses and the metrics after it), the importance
    weights go to `batch.rollout_is_weights` for the policy loss; its `rollout_corr/*` metrics are
    logged even with both off."""
    rc = algo.rollout_correction
    if batch.rollout_log_probs is None or rc.bypass_mode:  # bypass: the policy loss corrects (verl's fit)
        return {}
    cfg = rollout_corr.RolloutCorrection(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
                                         rc.rollout_rs, rc.rollout_rs_threshold)
    old = need(batch.old_log_probs, "old_log_probs")
    weights, kept, metrics = rollout_corr.correct(old, batch.rollout_log_probs, batch.response_mask, cfg)
    batch.response_mask, batch.rollout_is_weights = kept, weights
    return metrics


def resample_pf_ppo(batch: StepBatch, algo: AlgorithmConfig, seed: int) -> None:
    """verl's PF-PPO (`compute_pf_ppo_reweight_data`, called after `gae`): the batch becomes as
    many rows drawn with replacement from it, weighted by each row's summed token scores
    (:func:`trainer.algos.pf_ppo.pf_ppo_rows`); every per-row field follows, so the updates and
    the step's metrics see the drawn rows, as verl's do. `seed` seeds the draw (verl draws from
    torch's global generator, unseeded per step)."""
    scores = need(batch.token_scores, "token_scores").sum(dim=-1).cpu()
    rows = core_algos.pf_ppo_rows(scores, algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow,
                                  torch.Generator().manual_seed(seed))
    batch.take_rows(rows.tolist())


def compute_advantages(batch: StepBatch, algo: AlgorithmConfig, kl_ctrl: Any,
                       pf_ppo_seed: int | None = None) -> dict[str, float]:
    """Fill `batch.token_rewards`, `advantages` and `returns` from its token scores (and its
    old and reference log-probs and values where the settings use them); `kl_ctrl` (verl's KL
    controller) gives the penalty's coefficient and is updated with the step's KL. With
    `algorithm.use_pf_ppo` the rows are then redrawn (:func:`resample_pf_ppo`, seeded by
    `pf_ppo_seed`)."""
    metrics: dict[str, float] = {}
    assert batch.token_scores is not None
    batch.token_rewards = batch.token_scores
    if algo.use_kl_in_reward:
        batch.token_rewards, current_kl = core_algos.apply_kl_penalty(
            batch.token_scores, need(batch.old_log_probs, "old_log_probs"),
            need(batch.ref_log_probs, "ref_log_probs"), batch.response_mask,
            kl_ctrl.value, algo.kl_penalty)
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_ctrl.value}
        kl_ctrl.update(current_kl, len(batch))
    metrics.update(correct_rollout(batch, algo))
    batch.advantages, batch.returns = core_algos.compute_advantage(
        algo.adv_estimator, batch.token_rewards, batch.response_mask, values=batch.values,
        index=batch.uids, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, reward_baselines=batch.reward_baselines)
    if algo.use_pf_ppo:
        if pf_ppo_seed is None:
            raise ValueError("`algorithm.use_pf_ppo=true` redraws the rows, and the draw needs a seed: pass "
                             "`pf_ppo_seed` (the driver gives each step its own)")
        resample_pf_ppo(batch, algo, pf_ppo_seed)
    return metrics
