"""verl's rollout correction (``algorithm.rollout_correction``), decoupled mode: truncated importance
weights and rejection masks between the policy that sampled (``rollout_log_probs``, vLLM's) and the
one that trains (``old_log_probs``, the actor's recomputation), with verl's metrics.

Computed as verl computes it (``verl/trainer/ppo/rollout_corr_helper.py`` at b178a3c:
``compute_rollout_correction_and_rejection_mask`` and what it calls), on the whole batch once per
step, before the advantages:

- ``rollout_is`` (``token`` | ``sequence``): weights ``exp(log r)`` per token, or ``exp(sum log r)``
  per sequence, ``log r = old - rollout`` clamped to +-20, zero on padding, truncated at
  ``rollout_is_threshold``, detached, optionally divided by their batch mean
  (``rollout_is_batch_normalize``). Every policy loss multiplies its per-token loss by them.
- ``rollout_rs`` (comma-separated options, all must pass): tokens or whole sequences whose
  divergence estimate (k1 ``-log r``, k2 ``(log r)^2 / 2``, k3 ``exp(log r) - 1 - log r``; per token,
  or a sequence's sum, mean or max) falls outside ``rollout_rs_threshold`` leave the response mask.
- Off-policy metrics (``rollout_corr/kl``, ``k3_kl``, perplexities, chi-squared) whenever the rollout's
  log-probs exist, as verl logs them whenever ``rollout_log_probs`` is in the batch.

Every name of a metric is verl's, under ``rollout_corr/``.

Bypass mode (``rollout_correction.bypass_mode=true``; :func:`bypass_policy_loss`): the rollout's
log-probs are the old ones (no recomputation by the actor), and the policy loss is verl's
``bypass_mode`` loss (``compute_policy_loss_bypass_mode`` in ``verl/trainer/ppo/core_algos.py``,
set up by ``apply_bypass_mode`` in ``rollout_corr_helper.py``, whichever ``loss_mode`` was
configured): per micro-batch, the weights and the rejection mask between the current policy and
the rollout's, then ``ppo_clip`` (the vanilla PPO loss over the kept tokens, ratio
``pi / pi_rollout``, no weights: the clipped ratio is the correction) or ``reinforce``
(``-A * log pi`` times the weights, over the kept tokens).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.algos.aggregation import agg_loss
from trainer.algos.masked import masked_mean, masked_sum
from trainer.algos.policy_losses import compute_policy_loss
from trainer.algos.registry import (
    BYPASS_LOSS_TYPES,
    ROLLOUT_IS_LEVELS,
    parse_rs_thresholds,
    policy_loss,
    rs_options,
)

__all__ = ["BYPASS_LOSS_TYPES", "SAFETY_BOUND", "RolloutCorrection", "bypass_policy_loss", "correct", "is_weights",
           "offpolicy_metrics", "rejection_mask"]


SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction`` (decoupled mode; verl's yaml defaults)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)


def _statistic(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's divergence estimate: per token (token_*) or per sequence (seq_*)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}[option[-2:]]
    if option.startswith("token"):
        return token
    reduce = option.split("_")[1]
    if reduce == "sum":
        return masked_sum(token, mask, axis=-1)
    if reduce == "mean":
        return masked_mean(token, mask, axis=-1)
    return _seq_max(token, mask)


def _rs_metrics(option: str, stat: torch.Tensor, mask: torch.Tensor, seq_valid: torch.Tensor,
                lower: float, upper: float, with_lower: bool) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` for one option (`stat` per token, or per sequence)."""
    sequence = stat.dim() == 1
    per_token = stat.unsqueeze(-1).expand_as(mask) if sequence else stat
    seqs = (stat if sequence else masked_mean(stat, mask, axis=-1))[seq_valid]
    valid = mask.bool()
    m = {"mean": masked_mean(per_token, mask).item()}
    if sequence and seqs.numel() > 0:
        m["max"], m["min"] = seqs.max().item(), seqs.min().item()
        m["fraction_high"] = (seqs > upper).float().mean().item()
        m["fraction_low"] = (seqs < lower).float().mean().item() if with_lower else 0.0
    else:
        m["max"] = per_token.masked_fill(~valid, float("-inf")).max().item()
        m["min"] = per_token.masked_fill(~valid, float("inf")).min().item()
        m["fraction_high"] = masked_mean((per_token > upper).float(), mask).item()
        m["fraction_low"] = masked_mean((per_token < lower).float(), mask).item() if with_lower else 0.0
    if mask.sum() > 1:
        clamped = per_token.clamp(min=lower if with_lower else 0.0, max=upper)
        var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
        m["std"] = torch.sqrt(var.clamp(min=0.0)).item()
    else:
        m["std"] = 0.0
    if seqs.numel() > 0:
        m |= {"seq_mean": seqs.mean().item(), "seq_std": seqs.std().item() if seqs.numel() > 1 else 0.0,
              "seq_max": seqs.max().item(), "seq_min": seqs.min().item(),
              "seq_max_deviation": seqs.abs().max().item(), "seq_fraction_high": (seqs > upper).float().mean().item()}
        if with_lower:
            m["seq_fraction_low"] = (seqs < lower).float().mean().item()
    else:
        m |= {k: 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                               "seq_fraction_high", "seq_fraction_low")}
    return {f"rollout_rs_{option}_{k}": v for k, v in m.items()}


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str,
                   threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens (or sequences) at 0, and verl's ``rollout_rs_*``
    metrics (``compute_rollout_rejection_mask``)."""
    options = rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return mask, {}
    valid, seq_valid = mask.bool(), mask.sum(dim=-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        stat = _statistic(option, log_ratio, mask)
        if k1:
            assert lower is not None
            low, up = math.log(lower), math.log(upper)
            keep = (stat >= low) & (stat <= up)
        else:
            low, up = 0.0, upper
            keep = stat <= up
        if stat.dim() == 1:
            keep = keep.unsqueeze(-1).expand_as(valid)
        metrics |= _rs_metrics(option, stat, mask, seq_valid, low, up, k1)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        seq_keep = (~(~keep & valid)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_f, mask).item()
        seqs = seq_valid.float()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * seqs).sum() / seqs.sum()).item() if seqs.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, mask).item()
    kept = (combined > 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = (~kept & valid).any(dim=-1).float().mean().item()
    return (mask * combined).to(mask.dtype), metrics


def _is_metrics(weights: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                threshold: float) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (before truncation; `log_ratio` per token, or per sequence)."""
    low = 1.0 / threshold
    m: dict[str, float] = {}
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(log_ratio.max().clamp(max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_ratio.min()).item()
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        m["rollout_is_ratio_fraction_high"] = (log_ratio > math.log(threshold)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio < math.log(low)).float().mean().item()
    else:
        valid = mask.bool()
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((weights < low).float(), mask).item()
        m["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
    clamped = weights.clamp(min=low, max=threshold)
    if mask.sum() > 1:
        var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
        m["rollout_is_std"] = torch.sqrt(var.clamp(min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    normalised = clamped / (masked_mean(clamped, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), mask).item()
    seq = masked_mean(weights, mask, axis=-1)
    m |= {"rollout_is_seq_mean": seq.mean().item(), "rollout_is_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
          "rollout_is_seq_max": seq.max().item(), "rollout_is_seq_min": seq.min().item(),
          "rollout_is_seq_max_deviation": (seq - 1.0).abs().max().item(),
          "rollout_is_seq_fraction_high": (seq > threshold).float().mean().item(),
          "rollout_is_seq_fraction_low": (seq < low).float().mean().item()}
    return m


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights and verl's ``rollout_is_*`` metrics
    (``compute_rollout_correction_weights``), on one process's whole batch."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"`rollout_is` must be `token` or `sequence` (or null), got `{level}`")
    if threshold <= 0:
        raise ValueError(f"`rollout_is_threshold` must be positive, got {threshold}")
    if level == "token":
        for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * mask
    metrics = _is_metrics(weights, for_metrics, mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_mask = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, axis=-1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: KL, k3 KL, perplexities and chi-squared between the
    rollout's and the trainer's log-probs of the sampled tokens."""
    train_mean = masked_mean(old_log_prob, mask, axis=-1)
    roll_mean = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    diff = roll_mean - train_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = masked_sum(log_ratio, mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": torch.exp(-train_mean).mean().item(), "training_log_ppl": (-train_mean).mean().item(),
            "kl": masked_mean(rollout_log_prob - old_log_prob, mask).item(),
            "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
            "rollout_ppl": torch.exp(-roll_mean).mean().item(), "rollout_log_ppl": (-roll_mean).mean().item(),
            "log_ppl_diff": diff.mean().item(), "log_ppl_abs_diff": diff.abs().mean().item(),
            "log_ppl_diff_max": diff.max().item(), "log_ppl_diff_min": diff.min().item(),
            "ppl_ratio": torch.exp(diff).mean().item(),
            "chi2_token": (masked_mean(torch.exp(safe).square(), mask) - 1.0).item(),
            "chi2_seq": (torch.exp(2.0 * seq_sum).mean() - 1.0).item()}


def correct(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
            cfg: RolloutCorrection) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(importance weights or None, the response mask after rejection, ``rollout_corr/*`` metrics):
    verl's ``compute_rollout_correction_and_rejection_mask``."""
    if not mask.any():
        raise ValueError("the batch has no response token: nothing to correct")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != mask.shape:
        raise ValueError(f"log-prob shapes {tuple(old_log_prob.shape)} / {tuple(rollout_log_prob.shape)} "
                         f"differ from the response mask's {tuple(mask.shape)}")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if cfg.rollout_is is not None and cfg.rollout_is_threshold is not None:
        weights, m = is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold,
                                cfg.rollout_is_batch_normalize)
        metrics |= m
    kept = mask.clone()
    if cfg.rollout_rs is not None:
        kept, m = rejection_mask(log_ratio, mask, cfg.rollout_rs, cfg.rollout_rs_threshold)
        metrics |= m
    metrics |= offpolicy_metrics(old_log_prob, rollout_log_prob, mask)
    return weights, kept, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def bypass_policy_loss(rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, loss_agg_mode: str, params: Any, cfg: RolloutCorrection,
                       loss_type: str = "ppo_clip", rollout_is_weights: torch.Tensor | None = None,
                       **agg: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_policy_loss_bypass_mode`` (0.9.1): `rollout_log_prob` is the old
    log-prob; `rollout_is_weights` given by the caller are ignored (computed here, as verl). Without gradient, the correction between the current policy (`log_prob`) and the
    rollout's: the weights, the mask after rejection, the ``rollout_corr/*`` metrics; then the
    ``loss_type``'s loss over the kept tokens. `params`: the vanilla loss's
    (:class:`~trainer.algos.policy_losses.PolicyLossParams`); `agg`: the aggregation's normalisers."""
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"bypass mode's `loss_type={loss_type}` must be one of {', '.join(BYPASS_LOSS_TYPES)}")
    with torch.no_grad():
        weights, kept, metrics = correct(log_prob.detach(), rollout_log_prob, response_mask, cfg)
    if loss_type == "ppo_clip":  # the ratio pi / pi_rollout is the correction: no weights on top
        loss, pg_metrics = compute_policy_loss(rollout_log_prob, log_prob, advantages, kept, loss_agg_mode,
                                               params, rollout_is_weights=None, **agg)
    else:  # verl's compute_policy_loss_reinforce: -A * log pi, times the (detached) weights
        pg_losses = -advantages * log_prob if weights is None else -advantages * log_prob * weights
        loss = agg_loss(pg_losses, kept, loss_agg_mode, **agg)
        pg_metrics = {"actor/ppo_kl": masked_mean(rollout_log_prob - log_prob, kept).item()}
    return loss, pg_metrics | metrics


def policy_loss_for(loss_mode: str, rc: Any) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """The policy loss the actor trains with: the registered `loss_mode`, or in bypass mode
    (`rc.bypass_mode`, `rc`: ``algorithm.rollout_correction``) :func:`bypass_policy_loss` whatever
    `loss_mode` says, as verl's ``apply_bypass_mode`` sets ``policy_loss.loss_mode="bypass_mode"``."""
    if not rc.bypass_mode:
        return policy_loss(loss_mode)
    cfg = RolloutCorrection(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
                            rc.rollout_rs_threshold)
    return functools.partial(_bypass_call, cfg=cfg, loss_type=rc.loss_type)


def _bypass_call(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, loss_agg_mode: str, params: Any, *, cfg: RolloutCorrection,
                 loss_type: str, **rest: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's registered-loss signature over :func:`bypass_policy_loss` (the old log-prob is the rollout's)."""
    return bypass_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params, cfg,
                              loss_type, **rest)
