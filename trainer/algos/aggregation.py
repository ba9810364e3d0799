"""Loss aggregation (verl's `loss_agg_mode` and its normalisers), the clipped value loss and the
entropy of the logits: what turns a token-level loss matrix into the scalar a backward pass takes.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.algos.masked import masked_mean, masked_sum

__all__ = ["LOSS_AGG_MODES", "agg_loss", "compute_value_loss", "entropy_from_logits", "loss_normalizers"]

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


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

