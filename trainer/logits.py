"""Log-probs and entropies from a model's logits, in fp32 over chunks of positions: no
full-vocabulary fp32 copy of the batch's logits, in forward or backward."""

from __future__ import annotations

from typing import Any

import torch

from trainer.algos.core_algos import entropy_from_logits

__all__ = ["LOGIT_CHUNK", "entropy_chunked", "log_probs_from_logits"]


#: Positions whose full-vocabulary logits are upcast to fp32 at once by the log-prob and entropy
#: helpers: they never hold an fp32 copy of every position's logits.
LOGIT_CHUNK = 1024


class _TokenLogProb(torch.autograd.Function):
    """``logit[label] - logsumexp(logits)`` per row, in fp32 chunk by chunk; the backward pass
    recomputes each chunk's softmax from the saved logits and the saved log-normalisers (one
    fp32 number per row), so no fp32 ``log_softmax`` of the whole batch is kept for it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        for i in range(0, logits.shape[0], chunk):
            part = logits[i:i + chunk].float()
            lse[i:i + chunk] = torch.logsumexp(part, dim=-1)
            picked[i:i + chunk] = part.gather(-1, labels[i:i + chunk, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            g = grad[i:i + ctx.chunk, None].float()
            part = -torch.exp(logits[i:i + ctx.chunk].float() - lse[i:i + ctx.chunk, None]) * g
            part.scatter_add_(-1, labels[i:i + ctx.chunk, None], g)
            out[i:i + ctx.chunk] = part
        return out, None, None


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk: int = LOGIT_CHUNK
                          ) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position, in float32: the gathered logit minus the
    log-sum-exp, over chunks of ``chunk`` positions (no full-vocabulary fp32 copy)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = _TokenLogProb.apply(flat, labels.reshape(-1).to(flat.device), chunk)
    return out.view(labels.shape)


def entropy_chunked(logits: torch.Tensor, chunk: int = LOGIT_CHUNK) -> torch.Tensor:
    """`entropy_from_logits` in float32 over chunks of ``chunk`` positions; with grad each chunk
    is recomputed in the backward pass (activation checkpointing) instead of kept."""
    from torch.utils.checkpoint import checkpoint

    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for i in range(0, flat.shape[0], chunk):
        part = flat[i:i + chunk]
        if torch.is_grad_enabled() and part.requires_grad:
            parts.append(checkpoint(lambda x: entropy_from_logits(x.float()), part, use_reentrant=False))
        else:
            parts.append(entropy_from_logits(part.float()))
    return torch.cat(parts).view(logits.shape[:-1])
