"""PPO mathematics as small pure tensor functions.

Shapes: ``(batch, response_length)`` for token-level tensors, with ``response_mask`` holding
1.0 on the response tokens that count (up to and including the first EOS) and 0.0 elsewhere.
Names follow verl (``clip_ratio_low``, ``cliprange_value``, ``kl_penalty``, ``loss_agg_mode``)
so the code can be read against verl's documentation and the papers.

No function here reads a configuration object: every knob is an explicit argument.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.algos import registry
from trainer.algos.registry import register_adv_est, register_policy_loss

__all__ = [
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "build_lr_scheduler",
    "PolicyLossParams",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "kl_penalty",
    "loss_normalizers",
    "lr_lambda",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "resolve_warmup_steps",
    "scores_to_token_level",
]

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_PENALTIES = registry.KL_ESTIMATORS


# --------------------------------------------------------------------------- masked statistics


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over all elements, or along ``axis``)."""
    if axis is None:
        return (values * mask).sum()
    return (values * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; an empty mask gives 0 (like verl, eps 1e-8)."""
    if axis is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim=axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` where ``mask`` is 1, with Bessel's correction when ``unbiased``."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(
                f"`masked_var` received a mask with {int(count.item())} valid element(s); the "
                "unbiased variance needs at least 2. Fix: pass a larger batch or `unbiased=False`."
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked elements.

    With ``shift_mean=False`` the original mean is added back (only the scale changes).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last valid response token (zeros elsewhere).

    A row without any valid token gets its score at index -1, the last column, as verl's reward
    managers write it (`reward_tensor[i, valid_response_length - 1]`).
    """
    token_level = torch.zeros_like(response_mask, dtype=scores.dtype)
    lengths = response_mask.sum(dim=-1).long()
    token_level[torch.arange(len(lengths)), lengths - 1] = scores
    return token_level


# --------------------------------------------------------------------------- advantages
#
# Each estimator is declared, with what it needs, in `trainer.algos.registry.ADV_ESTIMATORS` and
# registers its function here under verl's name; `compute_advantage` calls it with keyword arguments, and `**_` takes the inputs it does not use.


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
    _check_index(index, token_level_rewards.shape[0])
    scores = token_level_rewards.sum(dim=-1)
    out = torch.empty_like(scores)
    for rows in _group_indices(index).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = torch.zeros_like(group[0]), torch.ones_like(group[0])
        else:
            mean, std = group.mean(), group.std()
        centred = group - mean
        out[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


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
    _check_index(index, token_level_rewards.shape[0])
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    for rows in _group_indices(index).values():
        n = len(rows)
        if n > 1:
            group = scores[rows]
            out[rows] = group * n / (n - 1) - group.mean() * n / (n - 1)
    advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


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
    _check_index(index, token_level_rewards.shape[0])
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
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
    _check_index(index, token_level_rewards.shape[0])
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1)
    baseline = torch.zeros_like(scores)
    for rows in _group_indices(index).values():
        if len(rows) > 1:
            baseline[rows] = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


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
    _check_index(index, token_level_rewards.shape[0])
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    advantages = (alpha * (scores - _group_means(scores, index)) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


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
    _check_index(index, token_level_rewards.shape[0])
    scores = token_level_rewards.sum(dim=-1)
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
    advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


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


# --------------------------------------------------------------------------- loss aggregation


def loss_normalizers(response_mask: torch.Tensor) -> tuple[float, float]:
    """``(num_tokens, num_rows)`` of a mini-batch: the global normalisers of verl's model engine
    (``trainer.use_legacy_worker_impl=disable``), which divides token-mean by the mini-batch's
    response tokens over all ranks (``batch_num_tokens``) and the seq-mean modes by its rows
    (``global_batch_size`` = ``ppo_mini_batch_size * rollout.n``, rows without tokens counted);
    verl/workers/engine/fsdp/transformer_impl.py ``forward_backward_batch`` and
    verl/trainer/ppo/ray_trainer.py ``_update_actor``."""
    return float(response_mask.sum().item()), float(response_mask.shape[0])


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a token-level loss matrix into a scalar, as verl's ``agg_loss``.

    Modes (verl's ``loss_agg_mode``):
      - ``token-mean``: sum over valid tokens / ``batch_num_tokens`` * ``dp_size``;
      - ``seq-mean-token-sum``: per-sequence token sums, summed / ``global_batch_size`` * ``dp_size``;
      - ``seq-mean-token-mean``: per-sequence token means, summed / ``global_batch_size`` * ``dp_size``;
      - ``seq-mean-token-sum-norm`` (Dr.GRPO): per-sequence token sums, summed /
        ``loss_scale_factor`` alone (default: the padded response length ``loss_mask.shape[-1]``);
        neither the number of sequences nor ``dp_size`` enters, as in verl.

    Without the global arguments the normalisers are this batch's own: its valid tokens, its
    sequences with at least one valid token. That is verl's default worker, which scales each
    micro-batch's result by its share of the mini-batch (``1 / gradient_accumulation``). The
    model engine passes the whole mini-batch's counts and ``dp_size`` instead (gradients are
    averaged over ranks, hence the factor).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown `loss_agg_mode={loss_agg_mode!r}`. Valid values: {', '.join(LOSS_AGG_MODES)}."
        )
    if loss_agg_mode == "token-mean":
        tokens = batch_num_tokens if batch_num_tokens is not None else float(loss_mask.sum().item())
        return masked_sum(loss_mat, loss_mask) / max(tokens, 1.0) * dp_size
    seq_tokens = loss_mask.sum(dim=-1)
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_scale_factor if loss_scale_factor is not None else float(loss_mask.shape[-1])
        return seq_sums.sum() / scale
    seqs = global_batch_size if global_batch_size is not None else float((seq_tokens > 0).sum().item())
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / (seq_tokens + 1e-8)
    return seq_sums.sum() / max(seqs, 1.0) * dp_size


# --------------------------------------------------------------------------- policy losses
#
# Every policy loss takes ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
# params, **agg)`` and returns ``(pg_loss, metrics)``, as verl's registered losses do; ``agg`` are
# the normalisers of :func:`agg_loss` (empty under verl's default worker).


@dataclass(frozen=True)
class PolicyLossParams:
    """The knobs of the policy losses (verl's ``actor_rollout_ref.actor`` keys, same defaults)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    """Dual-clip constant of ``vanilla`` (> 1)."""
    tau_pos: float = 1.0
    """SAPO's gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO's gate temperature for other advantages."""
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    """``policy_loss.*`` of clip-cov and kl-cov (verl's yaml defaults)."""


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _is_weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """The per-token loss times the rollout correction's importance weights, where there are any
    (verl multiplies them in every policy loss, right before the aggregation;
    :mod:`trainer.algos.rollout_corr`)."""
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _item(value: torch.Tensor) -> float:
    return float(value.detach().item())


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip (Ye et al. 2020).

    ``ratio = exp(log_prob - old_log_prob)`` is clipped to
    ``[1 - clip_ratio_low, 1 + clip_ratio_high]``; for negative advantages the loss is further
    bounded by ``-advantages * clip_ratio_c``.
    """
    if params.clip_ratio_c <= 1.0:
        raise ValueError(
            f"`clip_ratio_c` must be greater than 1.0 for the dual clip, received "
            f"{params.clip_ratio_c}. Fix: use a value such as 3.0 (verl's default)."
        )
    negative_approx_kl = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(
        ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * params.clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3).float() * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(_is_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    return pg_loss, {"actor/pg_clipfrac": _item(pg_clipfrac), "actor/ppo_kl": _item(ppo_kl),
                     "actor/pg_clipfrac_lower": _item(pg_clipfrac_lower)}


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): the sequence's geometric-mean ratio
    ``s = exp(mean_t(log_prob - old))``, carried per token as ``sg[s] * p / sg[p]`` (log clamped
    at 10), PPO-clipped, aggregated ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as
    verl)."""
    negative_approx_kl = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (negative_approx_kl * response_mask).sum(dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = agg_loss(_is_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean", **agg)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": _item(pg_clipfrac), "actor/ppo_kl": _item(ppo_kl),
                     "actor/pg_clipfrac_lower": 0.0}


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025): a smooth gate ``sigmoid(tau * (r - 1)) * 4 / tau`` in place of the
    clip, ``tau_pos`` for positive advantages and ``tau_neg`` otherwise; aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as verl)."""
    negative_approx_kl = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, torch.full_like(ratio, params.tau_pos),
                       torch.full_like(ratio, params.tau_neg))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_loss = agg_loss(_is_weighted(-gates * advantages, rollout_is_weights), response_mask, "seq-mean-token-mean", **agg)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": _item(ppo_kl), "actor/pg_clipfrac_lower": 0.0}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax 2025): ``-sg[clip(r, 1 - low, 1 + high)] * A * log_prob``; the gradient
    flows through ``log_prob`` alone."""
    negative_approx_kl = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(negative_approx_kl)
    clipped = torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    pg_losses = -clipped.detach() * advantages * log_prob
    pg_loss = agg_loss(_is_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    pg_clipfrac = masked_mean((ratio != clipped).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": _item(pg_clipfrac), "actor/ppo_kl": _item(ppo_kl),
                     "actor/pg_clipfrac_lower": 0.0}


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (Chu et al. 2025): plain policy gradient ``-log_prob * A``, no ratio, no metrics."""
    return agg_loss(_is_weighted(-log_prob * advantages, rollout_is_weights), response_mask, loss_agg_mode, **agg), {}


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025): the PPO clip loss, with the gradient removed from up to
    ``max(1, int(clip_cov_ratio * tokens))`` tokens drawn at random among those the clip left
    alone whose centred covariance ``(A - mean A) * (log_prob - mean log_prob)`` lies strictly
    between ``clip_cov_lb`` and ``clip_cov_ub``."""
    if params.clip_cov_ratio <= 0:
        raise ValueError(f"`policy_loss.clip_cov_ratio` must be > 0, received {params.clip_cov_ratio}. "
                         "Fix: use a small fraction such as 0.0002 (verl's default).")
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask))
        candidates = (cov < params.clip_cov_ub) & (cov > params.clip_cov_lb) & valid & ~(pg_losses2 > pg_losses1)
        picked = torch.nonzero(candidates)
        clip_num = max(int(params.clip_cov_ratio * response_mask.sum().item()), 1)
        picked = picked[torch.randperm(len(picked))[:clip_num]] if len(picked) else picked
        corr = torch.ones_like(advantages)
        corr[picked[:, 0], picked[:, 1]] = 0.0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    pg_loss = agg_loss(_is_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    return pg_loss, {"actor/pg_clipfrac": _item(pg_clipfrac), "actor/ppo_kl": _item(ppo_kl)}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams = PolicyLossParams(),
    rollout_is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025): the unclipped ``-A * r``, plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` valid tokens of largest centred covariance
    ``(A - mean A) * (log_prob - mean log_prob)`` (means over the valid tokens)."""
    if params.kl_cov_ratio <= 0:
        raise ValueError(f"`policy_loss.kl_cov_ratio` must be > 0, received {params.kl_cov_ratio}. "
                         "Fix: use a small fraction such as 0.0002 (verl's default).")
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    valid = response_mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid):
        with torch.no_grad():
            adv, logp = advantages[valid].reshape(-1), log_prob.detach()[valid].reshape(-1)
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * params.kl_cov_ratio))).indices
        penalised = torch.zeros(pg_losses.numel(), dtype=torch.bool, device=pg_losses.device)
        penalised[flat_valid[top]] = True
        penalty = params.ppo_kl_coef * negative_approx_kl.abs()
        pg_losses = pg_losses + torch.where(penalised.view_as(pg_losses), penalty, torch.zeros_like(penalty))
    pg_loss = agg_loss(_is_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, **agg)
    return pg_loss, {"actor/ppo_kl": _item(masked_mean(negative_approx_kl.abs(), response_mask))}


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (clip(v, V - c, V + c) - R)^2)`` aggregated.

    ``values`` are the critic's predictions at rollout time, ``vpreds`` the current ones.
    Returns ``(vf_loss, vf_clipfrac)``.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **agg
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension of ``logits``."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


# --------------------------------------------------------------------------- KL


def _kl_forward(diff: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return diff
    if name == "abs":
        return diff.abs()
    if name in ("mse", "k2"):
        return 0.5 * diff.square()
    kl = torch.clamp(-diff, min=-20.0, max=20.0)  # low_var_kl / k3
    return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    ``kl``/``k1``: ``logprob - ref``; ``abs``: its absolute value; ``mse``/``k2``: half its
    square; ``low_var_kl``/``k3``: ``exp(ref - logprob) - (ref - logprob) - 1``, with the log
    ratio clamped to [-20, 20] and the result to [-10, 10] as verl does.

    A name ending in ``+`` (``k1+``, ``low_var_kl+``, ``k3+``, ...) is verl's straight-through
    variant: the value of the named estimator, the gradient of ``k2`` (an unbiased KL gradient):
    ``k2 - sg[k2] + sg[named]`` (verl ``kl_penalty``; its documentation, docs/algo/ppo.md). At
    verl b178a3c the value half passes the name with its ``+`` to ``kl_penalty_forward``, which
    knows no such name and raises NotImplementedError; here the value is the named estimator's.
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(
            f"Unknown KL estimator `{kl_penalty!r}` (used by `algorithm.kl_penalty` and "
            f"`actor_rollout_ref.actor.kl_loss_type`). Valid values: {', '.join(KL_PENALTIES)}."
        )
    diff = logprob - ref_logprob
    forward = _kl_forward(diff, kl_penalty.rstrip("+"))
    if not kl_penalty.endswith("+"):
        return forward
    backward = 0.5 * diff.square()
    return backward - backward.detach() + forward.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL in the reward: ``rewards = scores - kl_coef * kl`` on the response tokens.

    Returns ``(token_level_rewards, current_kl)`` where ``current_kl`` is the batch mean of the
    per-sequence mean KL: feed it to the controller's ``update(current_kl, n_steps=batch)``.
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    return rewards, float(current_kl)


class FixedKLController:
    """A KL coefficient that never changes (verl ``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (verl ``algorithm.kl_ctrl.type=adaptive``).

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"The adaptive KL controller needs `kl_ctrl.target_kl` > 0 and `kl_ctrl.horizon` "
                f"> 0, received target_kl={target_kl}, horizon={horizon}. Fix: set both, e.g. "
                "target_kl=0.1 horizon=10000."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by verl's ``algorithm.kl_ctrl.type``."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown `algorithm.kl_ctrl.type={type!r}`. Valid values: fixed, adaptive.")


# --------------------------------------------------------------------------- learning rate


def resolve_warmup_steps(
    lr_warmup_steps: int, lr_warmup_steps_ratio: float, total_training_steps: int
) -> int:
    """verl's rule: a non-negative ``lr_warmup_steps`` wins, else ``ratio * total`` (floored)."""
    if lr_warmup_steps is not None and lr_warmup_steps >= 0:
        return int(lr_warmup_steps)
    return int(lr_warmup_steps_ratio * total_training_steps)


LR_SCHEDULER_TYPES = ("constant", "cosine")


def lr_lambda(
    step: int,
    num_warmup_steps: int,
    num_training_steps: int,
    lr_scheduler_type: str = "constant",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """Multiplier of the base learning rate at optimiser step ``step`` (0-based), as verl's
    ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``.

    Both warm up linearly from 0 to 1 over ``num_warmup_steps``. ``constant`` then stays at 1;
    ``cosine`` follows ``num_cycles`` waves of a cosine between 1 and ``min_lr_ratio`` over the
    remaining steps (0.5: one half-wave down to ``min_lr_ratio``), never below ``min_lr_ratio``.
    """
    if lr_scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(
            f"Unknown `optim.lr_scheduler_type={lr_scheduler_type!r}`. Valid values: constant, cosine.")
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    if lr_scheduler_type == "constant":
        return 1.0
    progress = (step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(min_lr_ratio, x * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    lr_scheduler_type: str = "constant",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_lambda`; step it once per optimiser step."""
    lr_lambda(0, num_warmup_steps, num_training_steps, lr_scheduler_type, min_lr_ratio, num_cycles)

    def factor(step: int) -> float:
        return lr_lambda(
            step, num_warmup_steps, num_training_steps, lr_scheduler_type, min_lr_ratio, num_cycles
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
