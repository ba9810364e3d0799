"""What every config section shares: the error type, the help-line field, the optimizer and
FSDP sections the actor and the critic both have, and the loss aggregation modes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

RUN_DIR_ENV = "HPCRL_RUN_DIR"
"""Set by hpcrl's node agent: the job's run directory (shared by every restart)."""
GPUS_ENV = "HPCRL_GPUS_PER_NODE"
"""Set by hpcrl: the GPUs per node the job asked Slurm for (the profile's `slurm.gpus_per_node`;
0 = none), the default of `trainer.n_gpus_per_node`."""


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message says what and how to fix it."""


def h(text: str) -> Any:
    """A dataclass field whose help line is `text` (`--list-keys` prints it)."""
    return field(metadata={"help": text})


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

DERIVED_HINT = "is derived here; set `{}` instead"
PROFILER = "verl's profilers (nsys, torch, NPU) only record timings; nothing is profiled here"
TORCH_COMPILE = ("verl compiles its entropy and log-prob helpers with torch.compile for speed; they run "
                 "eagerly here: the same formulas")
PREFETCH = ("FSDP1's all-gather prefetch only overlaps communication; FSDP2 here gathers each layer "
            "before its forward, the same weights")
STRATEGY = "`fsdp` and `fsdp2` both shard with FSDP2 here"
BUFFER_DTYPE = ("FSDP2 has no buffer dtype: buffers (rotary frequencies) stay in `model_dtype`, as in "
                "verl's FSDP2 path")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = h("peak learning rate of AdamW")
    lr_warmup_steps: int = h("linear warm-up steps; -1 uses `lr_warmup_steps_ratio`")
    lr_warmup_steps_ratio: float = h("warm-up steps as a share of the total training steps")
    min_lr_ratio: float = h("cosine schedule floor as a share of `lr`")
    lr_scheduler_type: Literal["constant", "cosine"] = h(
        "schedule after the linear warm-up from 0: `constant`, or `cosine` down to `min_lr_ratio`")
    num_cycles: float = h("cosine waves over the steps after the warm-up (0.5: one fall to the floor)")
    warmup_style: Literal["constant", "cosine"] | None = h(
        "verl's deprecated name of `lr_scheduler_type`; when set it replaces it")
    weight_decay: float = h("AdamW weight decay")
    betas: list[float] = h("AdamW betas")
    clip_grad: float | None = h("newer verl name of the section's `grad_clip`; when set it replaces it")


def check_optim(section: str, optim: OptimConfig) -> None:
    """Values AdamW and the schedule cannot use, refused before anything loads (a negative `lr`
    ascends the loss; torch's AdamW raises on it only at the first update, minutes into a job)."""
    key = f"`{section}.optim"

    def number(name: str, value: float, low: float, high: float | None, why: str) -> None:
        ok = math.isfinite(value) and value >= low and (high is None or value <= high)
        bound = f"from {low:g} to {high:g}" if high is not None else f"{low:g} or more"
        require(ok, f"{key}.{name}={value}` must be a number {bound}: {why}")

    number("lr", optim.lr, 0.0, None, "the step size of AdamW (verl's actor default 1e-6); a negative "
           "one would climb the loss")
    number("weight_decay", optim.weight_decay, 0.0, None, "AdamW's decoupled decay (verl: 0.01)")
    number("lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0,
           "the share of the training steps spent warming up")
    number("min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0, "the cosine floor as a share of `lr`")
    require(optim.lr_warmup_steps >= -1, f"{key}.lr_warmup_steps={optim.lr_warmup_steps}` must be -1 "
            "(use `lr_warmup_steps_ratio`) or a number of steps, 0 or more")
    betas = list(optim.betas)
    require(len(betas) == 2 and all(math.isfinite(b) and 0.0 <= b < 1.0 for b in betas),
            f"{key}.betas={betas}` must be two numbers from 0 up to (not including) 1, as AdamW takes "
            "them (verl: [0.9, 0.999])")
    if optim.clip_grad is not None:
        number("clip_grad", optim.clip_grad, 0.0, None, "the gradient norm clipped to")


Dtype = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]

ON_GPU_BF16 = "null = bf16 on GPUs (verl's default), fp32 on CPU"


@dataclass(frozen=True)
class MixedPrecisionConfig:
    param_dtype: Dtype | None = h(
        "dtype of the parameters in forward and backward (FSDP2's `MixedPrecisionPolicy`; one rank: "
        f"`torch.autocast`), the master weights stay in `model_dtype`; {ON_GPU_BF16}")
    reduce_dtype: Dtype = h("dtype of the gradient reduce-scatter across ranks (verl: fp32)")
    buffer_dtype: Dtype = h("verl's FSDP1 buffer dtype; FSDP2 keeps buffers in `model_dtype`, as "
                            "verl's FSDP2 does (compatibility only)")


@dataclass(frozen=True)
class FsdpConfig:
    param_offload: bool = h("parameters in host memory between phases, on the device for log-probs, update, sync")
    optimizer_offload: bool = h("optimizer state in host memory except during the update (once per step)")
    forward_prefetch: bool = h("verl's FSDP1 forward prefetch (compatibility only, see COMPAT)")
    model_dtype: Dtype = h("dtype the model is loaded and kept in: the master weights the optimizer "
                           "updates (verl: fp32)")
    mixed_precision: MixedPrecisionConfig = h("forward/backward and gradient-reduction dtypes")
