"""PF-PPO (policy filtration for PPO, Zhang et al. 2024, arXiv:2409.06957; verl's `algorithm.use_pf_ppo`): after
the advantages, the batch's rows are drawn again, with replacement, in proportion to a weight of
each row's score (verl's `compute_pf_ppo_reweight_data`, which its trainer calls after `gae`).

verl draws from torch's global generator, which its trainer does not seed per step; here the draw
takes a generator of its own, seeded per step by the caller, so a resumed run draws what an
unbroken one did. Given the same generator state the draws are verl's (`torch.multinomial` on the
same weights)."""

from __future__ import annotations

import torch

from trainer.algos.registry import PF_PPO_REWEIGHT_METHODS

__all__ = ["pf_ppo_rows", "pf_ppo_weights"]


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """Each row's sampling weight from its score (verl's `compute_weights`): `pow`, ``|score| **
    weight_pow``; `max_min`, 1 for the rows holding the batch's highest or lowest score, 0 for the
    others; `max_random`, 0.4 for the rows holding the highest score, 0.1 for the others."""
    if reweight_method == "pow":
        return torch.pow(torch.abs(scores), weight_pow)
    if reweight_method == "max_min":
        return torch.where((scores == torch.max(scores)) | (scores == torch.min(scores)), 1.0, 0.0)
    if reweight_method == "max_random":
        return torch.where(scores == torch.max(scores), 0.4, 0.1)
    raise ValueError(f"Unknown `algorithm.pf_ppo.reweight_method={reweight_method!r}`. Valid values: "
                     f"{', '.join(PF_PPO_REWEIGHT_METHODS)}.")


@torch.no_grad()
def pf_ppo_rows(scores: torch.Tensor, reweight_method: str, weight_pow: float,
                generator: torch.Generator) -> torch.Tensor:
    """As many rows as ``scores`` has, drawn with replacement in proportion to
    :func:`pf_ppo_weights` (plus 1e-8, so that a batch of zero weights draws uniformly, as verl)."""
    weights = torch.clamp(pf_ppo_weights(scores, reweight_method, weight_pow) + 1e-8, min=1e-8)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
