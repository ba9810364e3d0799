"""Policy losses, each registered under verl's `actor_rollout_ref.actor.policy_loss.loss_mode` name.

Every loss is called as verl calls its registered losses, ``fn(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, params, rollout_is_weights=None, **agg) -> (pg_loss, metrics)``;
``agg`` are the normalisers of :func:`~trainer.algos.aggregation.agg_loss` (empty under verl's
default worker). That signature is written once, in :func:`register`, which hands the loss's body
the call's arguments as one :class:`PolicyLossInputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.algos.aggregation import agg_loss
from trainer.algos.masked import masked_mean
from trainer.algos.registry import register_policy_loss

__all__ = [
    "PolicyLossInputs",
    "PolicyLossParams",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
]

LossResult = tuple[torch.Tensor, dict[str, float]]


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


@dataclass(frozen=True)
class PolicyLossInputs:
    """One call's arguments, in verl's order, and the steps the losses share."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    loss_agg_mode: str
    params: PolicyLossParams
    rollout_is_weights: torch.Tensor | None = None
    """The rollout correction's importance weights (:mod:`trainer.algos.rollout_corr`), if any."""
    agg: dict[str, Any] = field(default_factory=dict)

    def log_ratio(self, clamp: bool) -> torch.Tensor:
        """``log_prob - old_log_prob`` (verl's ``negative_approx_kl``), clamped to [-20, 20] where
        the loss clamps it."""
        diff = self.log_prob - self.old_log_prob
        return torch.clamp(diff, min=-20.0, max=20.0) if clamp else diff

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` over the response tokens."""
        return masked_mean(values, self.response_mask)

    def surrogates(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PPO's two surrogate losses ``(-A * r, -A * clip(r, 1 - low, 1 + high))``."""
        p = self.params
        return -self.advantages * ratio, -self.advantages * torch.clamp(
            ratio, 1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)

    def aggregate(self, pg_losses: torch.Tensor, loss_agg_mode: str | None = None) -> torch.Tensor:
        """The per-token loss times the importance weights, where there are any (verl multiplies
        them in every policy loss, right before the aggregation), aggregated in `loss_agg_mode`
        (the call's unless the loss fixes its own)."""
        weighted = pg_losses if self.rollout_is_weights is None else pg_losses * self.rollout_is_weights
        return agg_loss(weighted, self.response_mask, loss_agg_mode or self.loss_agg_mode, **self.agg)


PolicyLossFn = Callable[..., LossResult]


def register(name: str) -> Callable[[Callable[[PolicyLossInputs], LossResult]], PolicyLossFn]:
    """Register ``body(inputs) -> (pg_loss, metrics)`` as verl's policy loss `name`, callable with
    verl's signature (see the module's docstring); the function returned keeps the body's name
    and documentation."""

    def wrap(body: Callable[[PolicyLossInputs], LossResult]) -> PolicyLossFn:
        def loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                 params: PolicyLossParams = PolicyLossParams(),
                 rollout_is_weights: torch.Tensor | None = None, **agg: Any) -> LossResult:
            return body(PolicyLossInputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                         params, rollout_is_weights, agg))

        loss.__name__, loss.__qualname__, loss.__doc__ = body.__name__, body.__qualname__, body.__doc__
        return register_policy_loss(name)(loss)

    return wrap


def _item(value: torch.Tensor) -> float:
    return float(value.detach().item())


def _ppo_metrics(clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor,
                 clipfrac_lower: torch.Tensor | float = 0.0) -> dict[str, float]:
    def number(v: torch.Tensor | float) -> float:
        return _item(v) if isinstance(v, torch.Tensor) else v

    return {"actor/pg_clipfrac": number(clipfrac), "actor/ppo_kl": _item(ppo_kl),
            "actor/pg_clipfrac_lower": number(clipfrac_lower)}


@register("vanilla")
def compute_policy_loss(x: PolicyLossInputs) -> LossResult:
    """PPO clipped surrogate with asymmetric clip range and dual clip (Ye et al. 2020).

    ``ratio = exp(log_prob - old_log_prob)`` is clipped to
    ``[1 - clip_ratio_low, 1 + clip_ratio_high]``; for negative advantages the loss is further
    bounded by ``-advantages * clip_ratio_c``.
    """
    if x.params.clip_ratio_c <= 1.0:
        raise ValueError(
            f"`clip_ratio_c` must be greater than 1.0 for the dual clip, received "
            f"{x.params.clip_ratio_c}. Fix: use a value such as 3.0 (verl's default)."
        )
    negative_approx_kl = x.log_ratio(clamp=True)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = x.mean(-negative_approx_kl)

    pg_losses1, pg_losses2 = x.surrogates(ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = x.mean(torch.gt(pg_losses2, pg_losses1).float())

    pg_losses3 = -x.advantages * x.params.clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = x.mean(torch.gt(clip_pg_losses1, pg_losses3).float() * (x.advantages < 0).float())
    pg_losses = torch.where(x.advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return x.aggregate(pg_losses), _ppo_metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register("gspo")
def compute_policy_loss_gspo(x: PolicyLossInputs) -> LossResult:
    """GSPO (Zheng et al. 2025): the sequence's geometric-mean ratio
    ``s = exp(mean_t(log_prob - old))``, carried per token as ``sg[s] * p / sg[p]`` (log clamped
    at 10), PPO-clipped, aggregated ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as
    verl)."""
    negative_approx_kl = x.log_ratio(clamp=False)
    lengths = x.response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (negative_approx_kl * x.response_mask).sum(dim=-1) / lengths
    log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg_losses1, pg_losses2 = x.surrogates(ratio)
    pg_loss = x.aggregate(torch.maximum(pg_losses1, pg_losses2), "seq-mean-token-mean")
    pg_clipfrac = x.mean(torch.gt(pg_losses2, pg_losses1).float())
    return pg_loss, _ppo_metrics(pg_clipfrac, x.mean(-negative_approx_kl))


@register("sapo")
def compute_policy_loss_sapo(x: PolicyLossInputs) -> LossResult:
    """SAPO (Gao et al. 2025): a smooth gate ``sigmoid(tau * (r - 1)) * 4 / tau`` in place of the
    clip, ``tau_pos`` for positive advantages and ``tau_neg`` otherwise; aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as verl)."""
    negative_approx_kl = x.log_ratio(clamp=True)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(x.advantages > 0, torch.full_like(ratio, x.params.tau_pos),
                       torch.full_like(ratio, x.params.tau_neg))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_loss = x.aggregate(-gates * x.advantages, "seq-mean-token-mean")
    return pg_loss, _ppo_metrics(0.0, x.mean(-negative_approx_kl))


@register("cispo")
def compute_policy_loss_cispo(x: PolicyLossInputs) -> LossResult:
    """CISPO (MiniMax 2025): ``-sg[clip(r, 1 - low, 1 + high)] * A * log_prob``; the gradient
    flows through ``log_prob`` alone."""
    negative_approx_kl = x.log_ratio(clamp=True)
    ratio = torch.exp(negative_approx_kl)
    clipped = torch.clamp(ratio, 1 - x.params.clip_ratio_low, 1 + x.params.clip_ratio_high)
    pg_loss = x.aggregate(-clipped.detach() * x.advantages * x.log_prob)
    pg_clipfrac = x.mean((ratio != clipped).float())
    return pg_loss, _ppo_metrics(pg_clipfrac, x.mean(-negative_approx_kl))


@register("gpg")
def compute_policy_loss_gpg(x: PolicyLossInputs) -> LossResult:
    """GPG (Chu et al. 2025): plain policy gradient ``-log_prob * A``, no ratio, no metrics."""
    return x.aggregate(-x.log_prob * x.advantages), {}


def _positive_ratio(value: float, key: str) -> None:
    if value <= 0:
        raise ValueError(f"`policy_loss.{key}` must be > 0, received {value}. "
                         "Fix: use a small fraction such as 0.0002 (verl's default).")


@register("clip_cov")
def compute_policy_loss_clip_cov(x: PolicyLossInputs) -> LossResult:
    """Clip-Cov (Cui et al. 2025): the PPO clip loss, with the gradient removed from up to
    ``max(1, int(clip_cov_ratio * tokens))`` tokens drawn at random among those the clip left
    alone whose centred covariance ``(A - mean A) * (log_prob - mean log_prob)`` lies strictly
    between ``clip_cov_lb`` and ``clip_cov_ub``."""
    p, mask = x.params, x.response_mask
    _positive_ratio(p.clip_cov_ratio, "clip_cov_ratio")
    negative_approx_kl = x.log_ratio(clamp=False)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = x.mean(-negative_approx_kl)
    pg_losses1, pg_losses2 = x.surrogates(ratio)
    with torch.no_grad():
        cov = (x.advantages - x.mean(x.advantages)) * (x.log_prob - x.mean(x.log_prob))
        candidates = ((cov < p.clip_cov_ub) & (cov > p.clip_cov_lb) & (mask > 0)
                      & ~(pg_losses2 > pg_losses1))
        picked = torch.nonzero(candidates)
        clip_num = max(int(p.clip_cov_ratio * mask.sum().item()), 1)
        picked = picked[torch.randperm(len(picked))[:clip_num]] if len(picked) else picked
        corr = torch.ones_like(x.advantages)
        corr[picked[:, 0], picked[:, 1]] = 0.0
    pg_loss = x.aggregate(torch.maximum(pg_losses1, pg_losses2) * corr)
    return pg_loss, {"actor/pg_clipfrac": _item(x.mean((corr == 0).float())), "actor/ppo_kl": _item(ppo_kl)}


@register("kl_cov")
def compute_policy_loss_kl_cov(x: PolicyLossInputs) -> LossResult:
    """KL-Cov (Cui et al. 2025): the unclipped ``-A * r``, plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` valid tokens of largest centred covariance
    ``(A - mean A) * (log_prob - mean log_prob)`` (means over the valid tokens)."""
    _positive_ratio(x.params.kl_cov_ratio, "kl_cov_ratio")
    negative_approx_kl = x.log_ratio(clamp=False)
    pg_losses = -x.advantages * torch.exp(negative_approx_kl)
    valid = x.response_mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid):
        with torch.no_grad():
            adv, logp = x.advantages[valid].reshape(-1), x.log_prob.detach()[valid].reshape(-1)
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * x.params.kl_cov_ratio))).indices
        penalised = torch.zeros(pg_losses.numel(), dtype=torch.bool, device=pg_losses.device)
        penalised[flat_valid[top]] = True
        penalty = x.params.ppo_kl_coef * negative_approx_kl.abs()
        pg_losses = pg_losses + torch.where(penalised.view_as(pg_losses), penalty, torch.zeros_like(penalty))
    return x.aggregate(pg_losses), {"actor/ppo_kl": _item(x.mean(negative_approx_kl.abs()))}


@register("geo_mean")
def compute_policy_loss_geo_mean(x: PolicyLossInputs) -> LossResult:
    """GMPO (Zhao et al. 2025, verl's `geo_mean`): each sequence's ratio is the geometric mean of
    its token ratios, each token's log ratio first clipped to ``[-clip_ratio_low,
    clip_ratio_high]`` on the side the sign of its advantage makes pessimistic; the loss is
    ``-mean_t(A) * ratio`` per sequence, times the geometric mean of the rollout correction's
    weights where there are any, averaged over the rows. Like verl it ignores ``loss_agg_mode``
    and the global normalisers (a micro-batch's mean over its rows, fully masked rows counted),
    and its log ratio is not clamped."""
    mask, p = x.response_mask, x.params
    negative_approx_kl = x.log_ratio(clamp=False)
    sign = torch.sign(x.advantages)
    clamped = torch.clamp(negative_approx_kl, -p.clip_ratio_low, p.clip_ratio_high)
    pessimistic = sign * torch.min(sign * negative_approx_kl, sign * clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    ratio = torch.exp((pessimistic * mask).sum(dim=-1) / lengths)
    pg_losses = -((x.advantages * mask).sum(dim=-1) / lengths) * ratio
    if x.rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(x.rollout_is_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    clipped = torch.ne(negative_approx_kl, clamped)
    return torch.mean(pg_losses), _ppo_metrics(x.mean((clipped * (x.advantages > 0)).float()),
                                                x.mean(-negative_approx_kl),
                                                x.mean((clipped * (x.advantages < 0)).float()))
