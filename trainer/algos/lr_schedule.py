"""The learning-rate schedule (verl's `optim.lr_warmup_steps*`, `lr_scheduler_type`,
`min_lr_ratio`, `num_cycles`)."""

from __future__ import annotations

import math

import torch

__all__ = ["LR_SCHEDULER_TYPES", "build_lr_scheduler", "lr_lambda", "resolve_warmup_steps"]


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
