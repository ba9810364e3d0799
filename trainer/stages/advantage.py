"""The advantage stage: the KL penalty in the reward (`algorithm.use_kl_in_reward`), the rollout
correction where the rollout's log-probs exist (`algorithm.rollout_correction`), then the
configured advantage estimator (verl's `compute_advantage`), in verl's order."""

from __future__ import annotations

from typing import Any

from trainer.algos import core_algos, rollout_corr
from trainer.batch import StepBatch, need
from trainer.config import AlgorithmConfig

__all__ = ["compute_advantages", "correct_rollout"]


def correct_rollout(batch: StepBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """verl's decoupled rollout correction (`compute_rollout_correction_and_add_to_batch`), run
    where the batch has the rollout's log-probs, as verl runs it: rejected tokens leave
    `batch.response_mask` (so the advantages, the losses and the metrics after it), the importance
    weights go to `batch.rollout_is_weights` for the policy loss; its `rollout_corr/*` metrics are
    logged even with both off."""
    if batch.rollout_log_probs is None:
        return {}
    rc = algo.rollout_correction
    cfg = rollout_corr.RolloutCorrection(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
                                         rc.rollout_rs, rc.rollout_rs_threshold)
    old = need(batch.old_log_probs, "old_log_probs")
    weights, kept, metrics = rollout_corr.correct(old, batch.rollout_log_probs, batch.response_mask, cfg)
    batch.response_mask, batch.rollout_is_weights = kept, weights
    return metrics


def compute_advantages(batch: StepBatch, algo: AlgorithmConfig, kl_ctrl: Any) -> dict[str, float]:
    """Fill `batch.token_rewards`, `advantages` and `returns` from its token scores (and its
    old and reference log-probs and values where the settings use them); `kl_ctrl` (verl's KL
    controller) gives the penalty's coefficient and is updated with the step's KL."""
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
    return metrics
