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
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantage",
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
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


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
    )


# --------------------------------------------------------------------------- loss aggregation


def loss_normalizers(response_mask: torch.Tensor) -> tuple[float, float]:
    """``(num_tokens, num_seqs)`` of a batch: the global normalisers for :func:`agg_loss`.

    Compute them once over a whole mini-batch (and sum over data-parallel ranks) and pass them
    to every micro-batch's :func:`agg_loss`: the accumulated gradient then does not depend on
    how the mini-batch was split. A sequence counts when it has at least one valid token.
    """
    num_tokens = float(response_mask.sum().item())
    num_seqs = float((response_mask.sum(dim=-1) > 0).sum().item())
    return num_tokens, num_seqs


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_length: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Aggregate a token-level loss matrix into a scalar.

    Modes (verl's ``loss_agg_mode``):
      - ``token-mean``: sum over valid tokens / ``global_num_tokens``;
      - ``seq-mean-token-sum``: per-sequence token sums, summed / ``global_num_seqs``;
      - ``seq-mean-token-mean``: per-sequence token means, summed / ``global_num_seqs``;
      - ``seq-mean-token-sum-norm`` (Dr.GRPO): per-sequence token sums, summed /
        (``global_num_seqs`` * ``norm_length``), ``norm_length`` a constant such as the maximum
        response length (default: this batch's padded length).

    The normalisers default to this batch's own counts (:func:`loss_normalizers`). Passing the
    counts of the whole mini-batch makes the sum of the micro-batch losses equal the loss of
    the whole mini-batch. With data parallelism pass counts summed over ranks and ``dp_size``:
    the result is scaled by ``dp_size`` because gradients are averaged across ranks.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown `loss_agg_mode={loss_agg_mode!r}`. Valid values: {', '.join(LOSS_AGG_MODES)}."
        )
    local_tokens, local_seqs = loss_normalizers(loss_mask)
    if loss_agg_mode == "token-mean":
        denom = global_num_tokens if global_num_tokens is not None else local_tokens
        return masked_sum(loss_mat, loss_mask) / max(denom, 1.0) * dp_size
    seqs = global_num_seqs if global_num_seqs is not None else local_seqs
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / max(seqs, 1.0) * dp_size
    if loss_agg_mode == "seq-mean-token-mean":
        seq_means = seq_sums / loss_mask.sum(dim=-1).clamp(min=1)
        return seq_means.sum() / max(seqs, 1.0) * dp_size
    length = norm_length if norm_length is not None else float(loss_mask.shape[-1])
    return seq_sums.sum() / (max(seqs, 1.0) * length) * dp_size


# --------------------------------------------------------------------------- losses


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clip range and dual clip (Ye et al. 2020).

    ``ratio = exp(log_prob - old_log_prob)`` is clipped to
    ``[1 - clip_ratio_low, 1 + clip_ratio_high]``; for negative advantages the loss is further
    bounded by ``-advantages * clip_ratio_c``. ``agg_kwargs`` go to :func:`agg_loss`
    (``global_num_tokens``, ``global_num_seqs``, ``norm_length``, ``dp_size``).

    Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``; the last three are detached.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"`clip_ratio_c` must be greater than 1.0 for the dual clip, received {clip_ratio_c}. "
            "Fix: use a value such as 3.0 (verl's default)."
        )
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3).float() * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach()


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (clip(v, V - c, V + c) - R)^2)`` aggregated.

    ``values`` are the critic's predictions at rollout time, ``vpreds`` the current ones.
    Returns ``(vf_loss, vf_clipfrac)``.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **agg_kwargs
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension of ``logits``."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


# --------------------------------------------------------------------------- KL


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    ``kl``/``k1``: ``logprob - ref``; ``abs``: its absolute value; ``mse``/``k2``: half its
    square; ``low_var_kl``/``k3``: ``exp(ref - logprob) - (ref - logprob) - 1``, with the log
    ratio clamped to [-20, 20] and the result to [-10, 10] as verl does.
    """
    diff = logprob - ref_logprob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)
    raise ValueError(
        f"Unknown KL estimator `{kl_penalty!r}` (used by `algorithm.kl_penalty` and "
        f"`actor_rollout_ref.actor.kl_loss_type`). Valid values: {', '.join(KL_PENALTIES)}."
    )


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
