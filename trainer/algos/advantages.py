"""Advantage estimators, each registered under verl's `algorithm.adv_estimator` name.

Each estimator is declared, with what it needs, in `trainer.algos.registry.ADV_ESTIMATORS` and
registers its function here; :func:`compute_advantage` calls it with keyword arguments, and `**_`
takes the inputs it does not use. Shapes: ``(batch, response_length)``; ``index`` holds the prompt
uid of each row (the samples of a prompt form a group).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from trainer.algos import registry
from trainer.algos.masked import masked_whiten
from trainer.algos.registry import register_adv_est

__all__ = [
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
]


@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), verl's variant.

    Masked positions are skipped: they neither bootstrap a value nor carry a TD error.
    Returns ``(advantages, returns)``; advantages are whitened over the mask, returns are
    ``raw advantages + values``.
    """
    with torch.no_grad():
        next_values = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        reversed_adv = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            m = response_mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_values = values[:, t] * m + (1 - m) * next_values
            last_gae = gae_t * m + (1 - m) * last_gae
            reversed_adv.append(last_gae)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns


def _group_indices(index: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(index):
        groups[key].append(i)
    return groups


def _check_index(index: Sequence[Hashable], batch: int) -> None:
    if len(index) != batch:
        raise ValueError(
            f"The group index (prompt `uid`) has {len(index)} entries but the batch has {batch} "
            "rows. Fix: pass one uid per response, the same uid for the `n` samples of a prompt."
        )


def _sequence_scores(token_level_rewards: torch.Tensor, index: Sequence[Hashable]) -> torch.Tensor:
    """Each row's score (its token rewards summed), once the group index is checked against the rows."""
    _check_index(index, token_level_rewards.shape[0])
    return token_level_rewards.sum(dim=-1)


def _outcome(per_row: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-row advantage broadcast over the response: ``(advantages, returns)``, the same tensor."""
    advantages = per_row.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: the sequence score minus its group's mean (divided by the group's
    unbiased std when ``norm_adv_by_std_in_grpo``, Dr.GRPO when not).

    ``index`` holds the prompt uid of each row; a group of one gets mean 0 and std 1.
    Returns ``(advantages, returns)``, both the per-sequence value broadcast over the mask.
    """
    scores = _sequence_scores(token_level_rewards, index)
    out = torch.empty_like(scores)
    for rows in _group_indices(index).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = torch.zeros_like(group[0]), torch.ones_like(group[0])
        else:
            mean, std = group.mean(), group.std()
        centred = group - mean
        out[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return _outcome(out, response_mask)


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: each score minus the mean of the *other* scores of its group.

    A group of one keeps its raw score. Returns ``(advantages, returns)``.
    """
    scores = _sequence_scores(token_level_rewards, index)
    out = scores.clone()
    for rows in _group_indices(index).values():
        n = len(rows)
        if n > 1:
            group = scores[rows]
            out[rows] = group * n / (n - 1) - group.mean() * n / (n - 1)
    return _outcome(out, response_mask)


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the whole batch.

    Returns ``(advantages, returns)``.
    """
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * response_mask[:, t]
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def _group_means(scores: torch.Tensor, index: Sequence[Hashable]) -> torch.Tensor:
    """Each row's group mean (0 for a group of one, as verl)."""
    means = torch.zeros_like(scores)
    for rows in _group_indices(index).values():
        if len(rows) > 1:
            means[rows] = scores[rows].mean()
    return means


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline (Hu 2025): the sequence score minus its group's mean (0 for a
    group of one), broadcast over the response, then whitened over the whole batch's tokens.
    Returns ``(advantages, advantages)``."""
    if index is None:
        raise ValueError("`adv_estimator=reinforce_plus_plus_baseline` needs the prompt uid of each row "
                         "(`index`), received None. Fix: pass the uids that group the samples of a prompt.")
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, index)
        centred = (scores - _group_means(scores, index)).unsqueeze(-1) * response_mask
        advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): the score minus its group's length-weighted mean score
    ``sum(len_i * r_i) / sum(len_i)`` (0 for a group of one). Returns ``(advantages, advantages)``."""
    scores = _sequence_scores(token_level_rewards, index)
    lengths = response_mask.sum(dim=-1)
    baseline = torch.zeros_like(scores)
    for rows in _group_indices(index).values():
        if len(rows) > 1:
            baseline[rows] = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    return _outcome(scores - baseline, response_mask)


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    f_norm: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): ``alpha * (r - group mean) / f_norm`` with
    ``alpha = rows / rows with a non-zero score`` over the whole batch (``f_norm`` 1, as verl).
    Returns ``(advantages, advantages)``."""
    scores = _sequence_scores(token_level_rewards, index)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    return _outcome(alpha * (scores - _group_means(scores, index)) / f_norm, response_mask)


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025): only the best response of each group gets an advantage,
    ``best - second best`` (divided by the group's unbiased std + 1e-6 when
    ``norm_adv_by_std_in_grpo``); ties go to the first best, as ``torch.topk``.
    Returns ``(advantages, advantages)``."""
    scores = _sequence_scores(token_level_rewards, index)
    out = torch.zeros_like(scores)
    for rows in _group_indices(index).values():
        if len(rows) < 2:
            raise ValueError(
                f"`adv_estimator=grpo_passk` needs at least 2 samples per prompt, a group has "
                f"{len(rows)}. Fix: set `actor_rollout_ref.rollout.n` >= 2.")
        group = scores[rows]
        top, where = torch.topk(group, 2)
        gap = top[0] - top[1]
        out[rows[int(where[0])]] = gap / (group.std() + epsilon) if norm_adv_by_std_in_grpo else gap
    return _outcome(out, response_mask)


@register_adv_est("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): the reward-to-go minus the score of the prompt's greedy response
    (``reward_baselines``, one per row). Returns ``(advantages, returns)``."""
    if reward_baselines is None:
        raise ValueError("`adv_estimator=remax` needs `reward_baselines` (the score of each prompt's greedy "
                         "response), received None. Fix: let the driver run the greedy rollout.")
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def compute_advantage(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Sequence[Hashable] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator registered as verl's ``algorithm.adv_estimator`` name; returns
    ``(advantages, returns)``. Inputs an estimator declares it needs must not be None."""
    spec = registry.adv_estimator(adv_estimator)
    if spec.needs_critic and values is None:
        raise ValueError(
            f"`adv_estimator={spec.name}` needs critic `values`, received None. Fix: enable the "
            "critic or choose an estimator without one (`grpo`, `rloo`, `reinforce_plus_plus`)."
        )
    if spec.min_group_size > 1 and index is None:
        raise ValueError(
            f"`adv_estimator={spec.name}` needs the prompt uid of each row (`index`), "
            "received None. Fix: pass the uids that group the `n` samples of each prompt."
        )
    if spec.fn is None:
        raise ValueError(f"`adv_estimator={spec.name}` is declared but no function registers it")
    return spec.fn(  # type: ignore[no-any-return]
        token_level_rewards=token_level_rewards, response_mask=response_mask, values=values,
        index=index, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        reward_baselines=reward_baselines,
    )
