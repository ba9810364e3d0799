"""`actor_rollout_ref.*` but the rollout: the model, the actor's training and the reference
policy (verl's `actor`, `ref` and `model` sections). Defaults: `trainer/config/actor.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import (
    DERIVED_HINT,
    PADDING,
    FsdpConfig,
    LossAggMode,
    OptimConfig,
    h,
    require,
)
from trainer.config.rollout import RolloutConfig


@dataclass(frozen=True)
class ModelConfig:
    path: str = h("HF model directory (or hub id) of the actor and reference")
    enable_gradient_checkpointing: bool = h("recompute activations in backward to save memory")
    use_remove_padding: bool = h("verl's padding-free packing (compatibility only, see COMPAT)")
    trust_remote_code: bool = h("allow model code shipped with the checkpoint")
    lora_rank: int = h(
        "LoRA rank (peft); 0 = full fine-tuning. Above 0 only the low-rank adapters train (and "
        "hold optimizer state); the reference policy is the same model with its adapters "
        "disabled (no second model copy), and the rollout engine and the HF export get the "
        "merged weights W + alpha/rank * B A under the base model's names")
    lora_alpha: int = h("LoRA scaling: the adapters' update is multiplied by `lora_alpha` / `lora_rank`")
    target_modules: list[str] = h(
        "modules that get LoRA adapters: `all-linear` (every linear layer but the output head) "
        "or module names, e.g. `[q_proj,v_proj]`")


@dataclass(frozen=True)
class RefFsdpConfig:
    param_offload: bool = h("offload the reference model's parameters to CPU (FSDP workers)")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = h("policy loss registered under this name (`trainer.algos.registry`); vanilla = PPO clip")


@dataclass(frozen=True)
class ActorConfig:
    strategy: Literal["fsdp", "fsdp2"] = h("parallel strategy of the actor workers")
    ppo_mini_batch_size: int = h("prompts per optimizer step (times `rollout.n` samples)")
    ppo_micro_batch_size_per_gpu: int | None = h("samples per forward/backward; null = whole mini-batch")
    use_dynamic_bsz: bool = h("form micro-batches by token count instead of sample count")
    ppo_max_token_len_per_gpu: int = h("token budget of one micro-batch with `use_dynamic_bsz`")
    grad_clip: float = h("clip the gradient norm to this value")
    clip_ratio: float = h("PPO clip epsilon, used for low and high when those are null")
    clip_ratio_low: float | None = h("lower clip epsilon; null = `clip_ratio`")
    clip_ratio_high: float | None = h("upper clip epsilon; null = `clip_ratio`")
    clip_ratio_c: float = h("dual-clip constant for negative advantages (> 1)")
    policy_loss: PolicyLossConfig = h("policy loss")
    loss_agg_mode: LossAggMode = h("how token losses are aggregated")
    entropy_coeff: float = h("entropy bonus coefficient")
    use_kl_loss: bool = h("add KL(actor || reference) to the actor loss")
    kl_loss_coef: float = h("coefficient of the KL loss")
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = h("KL estimator of the KL loss")
    ppo_epochs: int = h("passes over each batch of rollouts")
    shuffle: bool = h("shuffle samples between mini-batches")
    optim: OptimConfig = h("actor optimizer")
    fsdp_config: FsdpConfig = h("actor FSDP options")


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = h("samples per reference forward; null = all")
    log_prob_use_dynamic_bsz: bool | None = h("token-count micro-batches; null = actor's `use_dynamic_bsz`")
    log_prob_max_token_len_per_gpu: int | None = h("token budget; null = actor's `ppo_max_token_len_per_gpu`")
    fsdp_config: RefFsdpConfig = h("reference FSDP options")


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    nccl_timeout: int = h("seconds a collective of the worker groups may wait before the group "
                          "fails (torch.distributed's timeout; NCCL/RCCL on GPUs, gloo on CPUs)")
    hybrid_engine: bool = h("actor and rollout share weights; must be true (a separate rollout "
                            "deployment is not supported)")
    model: ModelConfig = h("actor/reference model")
    actor: ActorConfig = h("actor training")
    ref: RefConfig = h("reference model")
    rollout: RolloutConfig = h("generation")


#: verl's model, actor and reference keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "actor_rollout_ref.model.external_lib": "",
    "actor_rollout_ref.model.override_config": "",
    "actor_rollout_ref.model.use_shm": "",
    "actor_rollout_ref.model.use_liger": ("Liger fused kernels; the log-probs here come from the "
                                          "model's logits, which cost memory but give the same values"),
    "actor_rollout_ref.model.use_fused_kernels": ("verl's fused linear + log-prob kernel; the "
                                                  "log-probs here come from the model's logits"),
    "actor_rollout_ref.model.custom_chat_template": "",
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "sequence parallelism",
    "actor_rollout_ref.actor.use_torch_compile": "",
    "actor_rollout_ref.actor.checkpoint": "checkpoint contents are fixed",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy": "",
    "actor_rollout_ref.actor.fsdp_config.offload_policy": "",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": "",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "",
    "actor_rollout_ref.actor.optim.total_training_steps": DERIVED_HINT.format(
        "trainer.total_training_steps"
    ),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "sequence parallelism",
    "actor_rollout_ref.ref.fsdp_config.wrap_policy": "",
}

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "actor_rollout_ref.model.use_remove_padding": PADDING,
    "actor_rollout_ref.actor.strategy": "`fsdp` and `fsdp2` both shard with FSDP2 here",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "actor_rollout_ref.model.use_liger": False,
    "actor_rollout_ref.model.use_fused_kernels": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 1,
}

#: Values naming a feature this trainer does not have.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.actor.strategy": {"megatron": "Megatron-LM training"},
    "actor_rollout_ref.ref.strategy": {"megatron": "Megatron-LM training"},
}


def validate_lora(arr: ActorRolloutRefConfig) -> None:
    """LoRA's rules (`model.lora_rank` > 0): a positive alpha, target modules, no reference offload."""
    model = arr.model
    require(model.lora_rank >= 0, f"`actor_rollout_ref.model.lora_rank={model.lora_rank}` must be 0 "
            "(full fine-tuning) or a positive LoRA rank")
    if model.lora_rank == 0:
        return
    require(model.lora_alpha > 0, f"`actor_rollout_ref.model.lora_alpha={model.lora_alpha}` must be "
            "positive with LoRA (`lora_rank` > 0): the adapters' update is scaled by "
            "`lora_alpha` / `lora_rank` (verl's default is 16)")
    targets = model.target_modules
    require(bool(targets) and all(t.strip() for t in targets),
            "`actor_rollout_ref.model.target_modules` is empty with LoRA (`lora_rank` > 0); set "
            "`all-linear` or module names such as `[q_proj,v_proj]`")
    require("all-linear" not in targets or len(targets) == 1,
            f"`actor_rollout_ref.model.target_modules={targets}`: `all-linear` already selects "
            "every linear layer; give it alone or list module names without it")
    require(not arr.ref.fsdp_config.param_offload,
            "`actor_rollout_ref.ref.fsdp_config.param_offload=true` with LoRA (`lora_rank` > 0): "
            "the reference policy is the actor with its adapters disabled and has no weights of "
            "its own to offload. Fix: remove the override (or offload the actor's with "
            "`actor_rollout_ref.actor.fsdp_config.param_offload=true`)")
