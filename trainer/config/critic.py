"""`critic.*`: the value model (verl's `critic` section). Defaults: `trainer/config/critic.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import (
    BUFFER_DTYPE,
    DERIVED_HINT,
    PREFETCH,
    PROFILER,
    STRATEGY,
    FsdpConfig,
    LossAggMode,
    OptimConfig,
    h,
)


@dataclass(frozen=True)
class CriticModelConfig:
    path: str | None = h("critic model directory; null = the actor's model path")
    tokenizer_path: str | None = h("critic tokenizer (compatibility only, see COMPAT)")
    enable_gradient_checkpointing: bool = h("recompute activations in backward")
    use_remove_padding: bool = h(
        "compute real tokens only: each micro-batch's sequences packed into one row (position ids "
        "restarting per sequence; flash-attention varlen on GPUs with flash-attn, else SDPA once per "
        "sequence, never a dense mask); false: the padded rows, cut to their longest real row")
    trust_remote_code: bool = h("allow model code shipped with the checkpoint")
    fsdp_config: FsdpConfig = h("critic FSDP options")
    override_config: dict[str, Any] = h(
        "edits of the critic model's HF config, as `actor_rollout_ref.model.override_config` for the "
        "actor (verl's `update_model_config`, over the tokenizer's BOS/EOS/PAD ids)")


@dataclass(frozen=True)
class CriticConfig:
    strategy: Literal["fsdp", "fsdp2"] = h("parallel strategy of the critic workers")
    optim: OptimConfig = h("critic optimizer")
    model: CriticModelConfig = h("critic model")
    ppo_mini_batch_size: int | None = h("prompts per critic optimizer step; null = actor's")
    ppo_micro_batch_size_per_gpu: int | None = h(
        "samples per critic forward/backward; null only with dynamic batching (refused at the start "
        "otherwise, as verl's CriticConfig refuses it)")
    use_dynamic_bsz: bool | None = h("token-count micro-batches; null = actor's")
    ppo_max_token_len_per_gpu: int = h("token budget of one critic micro-batch")
    forward_max_token_len_per_gpu: int | None = h("token budget of value forwards; null = previous")
    ppo_epochs: int | None = h("critic passes per batch; null = actor's `ppo_epochs`")
    shuffle: bool | None = h("as `actor.shuffle`, for the critic; null = actor's")
    grad_clip: float = h("clip the critic gradient norm to this value")
    cliprange_value: float = h("value clipping range")
    loss_agg_mode: LossAggMode | None = h("value-loss aggregation; null = actor's `loss_agg_mode`")
    profiler: dict[str, Any] = h("verl's per-role profiler settings (compatibility only, see COMPAT)")


_CRITIC_LORA = ("LoRA for the critic; the critic trains all its weights. LoRA for the actor is "
                "`actor_rollout_ref.model.lora_rank`")

#: verl's `critic.*` keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "critic.rollout_n": DERIVED_HINT.format("actor_rollout_ref.rollout.n"),
    "critic.ppo_micro_batch_size": "deprecated in verl; use `critic.ppo_micro_batch_size_per_gpu`",
    "critic.ulysses_sequence_parallel_size": "sequence parallelism",
    "critic.checkpoint": "checkpoint contents are fixed",
    "critic.model.external_lib": "",
    "critic.model.lora_rank": _CRITIC_LORA,
    "critic.model.lora_alpha": _CRITIC_LORA,
    "critic.model.target_modules": _CRITIC_LORA,
    "critic.optim.total_training_steps": DERIVED_HINT.format("trainer.total_training_steps"),
}

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "critic.strategy": STRATEGY,
    "critic.profiler": PROFILER,
    "critic.model.fsdp_config.forward_prefetch": PREFETCH,
    "critic.model.fsdp_config.mixed_precision.buffer_dtype": BUFFER_DTYPE,
    "critic.model.tokenizer_path": ("the critic scores the actor's tokens: its config takes the BOS/EOS/PAD "
                                    "ids of the trainer's tokenizer (verl's default `tokenizer_path` is the "
                                    "actor's model path) and it has no HF export"),
}

#: Newer verl spellings read as this trainer's key: verl 0.9.1 keeps the critic's FSDP engine
#: config in `critic.fsdp` (`verl.workers.config.FSDPCriticConfig.fsdp`).
ALIASES: dict[str, str] = {
    **{f"critic.fsdp.{name}": f"critic.model.fsdp_config.{name}"
       for name in ("param_offload", "optimizer_offload", "forward_prefetch", "model_dtype")},
    "critic.fsdp.dtype": "critic.model.fsdp_config.mixed_precision.param_dtype",
    "critic.model.fsdp_config.dtype": "critic.model.fsdp_config.mixed_precision.param_dtype",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "critic.ulysses_sequence_parallel_size": 1,
}

#: Values naming a feature this trainer does not have.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "critic.strategy": {"megatron": "Megatron-LM training"},
}
