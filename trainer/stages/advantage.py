"""The advantage stage: the KL penalty in the reward (`algorithm.use_kl_in_reward`), then the
configured advantage estimator (verl's `compute_advantage`)."""

from __future__ import annotations

from typing import Any

from trainer.algos import core_algos
from trainer.batch import StepBatch, need
from trainer.config import AlgorithmConfig

__all__ = ["compute_advantages"]


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
    batch.advantages, batch.returns = core_algos.compute_advantage(
        algo.adv_estimator, batch.token_rewards, batch.response_mask, values=batch.values,
        index=batch.uids, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, reward_baselines=batch.reward_baselines)
    return metrics
