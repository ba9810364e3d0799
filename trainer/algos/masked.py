"""Masked statistics over token-level tensors, and a sequence score placed on its last token.

Shapes: ``(batch, response_length)``, with a mask holding 1.0 on the tokens that count and 0.0
elsewhere. The epsilons are verl's (``verl.utils.torch_functional``).
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten", "scores_to_token_level"]

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

