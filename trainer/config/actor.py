"""`actor_rollout_ref.*` but the rollout: the model, the actor's training and the reference
policy (verl's `actor`, `ref` and `model` sections). Defaults: `trainer/config/actor.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import (
    BUFFER_DTYPE,
    DERIVED_HINT,
    PREFETCH,
    PROFILER,
    STRATEGY,
    TORCH_COMPILE,
    Dtype,
    FsdpConfig,
    LossAggMode,
    MixedPrecisionConfig,
    OptimConfig,
    h,
    require,
)
from trainer.config.rollout import RolloutConfig


@dataclass(frozen=True)
class ModelConfig:
    path: str = h("HF model directory (or hub id) of the actor and reference")
    enable_gradient_checkpointing: bool = h("recompute activations in backward to save memory")
    use_remove_padding: bool = h(
        "compute real tokens only: each micro-batch's sequences packed into one row (position ids "
        "restarting per sequence; flash-attention varlen on GPUs with flash-attn, else SDPA once per "
        "sequence, never a dense mask); false: the padded rows, cut to their longest real row")
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
    lora_adapter_path: str | None = h(
        "a saved peft LoRA adapter directory (`adapter_config.json` and its weights) the actor's "
        "adapters start from, as verl's `PeftModel.from_pretrained(..., is_trainable=True)`; its "
        "`r`, `lora_alpha` and `target_modules` are the run's (`lora_rank=0` takes them; a run "
        "that sets them must agree, checked when the actor is built)")

    @property
    def uses_lora(self) -> bool:
        """Whether the actor trains LoRA adapters: `lora_rank` > 0 or a saved adapter (verl's
        `_is_lora`, b178a3cd's workers)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None
    use_shm: bool = h("verl: load the model through shared memory (compatibility only, see COMPAT)")
    enable_activation_offload: bool = h("verl: keep checkpointed activations in host memory "
                                        "(compatibility only, see COMPAT)")
    use_liger: bool = h("Liger's Triton kernels (compatibility only, see COMPAT)")
    use_fused_kernels: bool = h("verl's fused linear + log-prob kernel (compatibility only, see COMPAT)")
    fused_kernel_options: dict[str, Any] = h("options of verl's fused kernels (compatibility only, see COMPAT)")
    override_config: dict[str, Any] = h(
        "edits of the model's HF config, as verl's `update_model_config` applies them (e.g. "
        "`+actor_rollout_ref.model.override_config.max_position_embeddings=32768`): over the "
        "tokenizer's BOS/EOS/PAD ids, for the actor, the reference and the rollout engines (vLLM: "
        "`hf_overrides`); a `model_config` sub-mapping is read as the mapping; `attn_implementation` "
        "is read and not applied (`trainer/hf_overrides.py`)")


@dataclass(frozen=True)
class RefFsdpConfig:
    param_offload: bool = h("offload the reference model's parameters to CPU (FSDP workers)")
    forward_prefetch: bool = h("verl's FSDP1 forward prefetch (compatibility only, see COMPAT)")
    model_dtype: Dtype = h("dtype the reference model is loaded in (verl: fp32)")
    mixed_precision: MixedPrecisionConfig = h("forward dtype of the reference model")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = h("policy loss registered under this name (`trainer.algos.registry`): vanilla (PPO "
                       "clip), gspo, sapo, cispo, gpg, clip_cov, kl_cov, geo_mean")
    clip_cov_ratio: float = h("clip_cov: fraction of the tokens whose gradient is dropped")
    clip_cov_lb: float = h("clip_cov: a dropped token's covariance lies above this")
    clip_cov_ub: float = h("clip_cov: a dropped token's covariance lies below this")
    kl_cov_ratio: float = h("kl_cov: fraction of the tokens (largest covariance) given the |log ratio| penalty")
    ppo_kl_coef: float = h("kl_cov: coefficient of the |log ratio| penalty")


CHECKPOINT_PARTS = ("model", "optimizer", "extra")
"""What every checkpoint holds here (the sharded model, optimizer, scheduler and loop state)."""


@dataclass(frozen=True)
class CheckpointConfig:
    save_contents: list[str] = h(
        "verl's checkpoint contents: `model`, `optimizer`, `extra` (always all three here: a "
        "checkpoint resumes completely) and, optionally, `hf_model`: the whole model in HF "
        "safetensors under `huggingface/` (gathered on every save; without it `huggingface/` holds "
        "the config, generation config and tokenizer, as in verl)")
    load_contents: list[str] | None = h("what a resume loads; null = `save_contents` (verl: "
                                        "`${.save_contents}`); all of `model`, `optimizer`, `extra`")
    async_save: bool = h("verl: asynchronous saves, Megatron only (compatibility only)")


def validate_checkpoint(arr: Any) -> None:
    """`actor.checkpoint`: the parts verl names, all of model/optimizer/extra saved and loaded."""
    c = arr.actor.checkpoint
    for key, given in (("save_contents", c.save_contents), ("load_contents", c.load_contents)):
        if given is None:
            continue
        unknown = sorted(set(given) - {*CHECKPOINT_PARTS, "hf_model"})
        require(not unknown, f"`actor_rollout_ref.actor.checkpoint.{key}` names {unknown}; the parts are "
                f"{', '.join(f'`{p}`' for p in (*CHECKPOINT_PARTS, 'hf_model'))}")
        missing = [p for p in CHECKPOINT_PARTS if p not in given]
        require(not missing, f"`actor_rollout_ref.actor.checkpoint.{key}={list(given)}` leaves out "
                f"{missing}: partial checkpoints (saving or loading only some parts) are not supported; "
                "every checkpoint here holds and resumes the model, optimizer and loop state. Fix: "
                "keep `model`, `optimizer` and `extra` (add `hf_model` for a full HF export)")


@dataclass(frozen=True)
class ActorConfig:
    strategy: Literal["fsdp", "fsdp2"] = h("parallel strategy of the actor workers")
    ppo_mini_batch_size: int = h("prompts per optimizer step (times `rollout.n` samples)")
    ppo_micro_batch_size_per_gpu: int | None = h("samples per forward/backward; null = whole mini-batch")
    use_dynamic_bsz: bool = h("form micro-batches by token count instead of sample count")
    ppo_max_token_len_per_gpu: int = h("token budget of one micro-batch with `use_dynamic_bsz`")
    grad_clip: float = h("clip the gradient norm to this value")
    clip_ratio: float = h("PPO clip epsilon; acts only where `clip_ratio_low`/`clip_ratio_high` are null "
                          "(as in verl, whose defaults for both are 0.2)")
    clip_ratio_low: float | None = h("lower clip epsilon (0 is honoured: no clip below 1); null = `clip_ratio`")
    clip_ratio_high: float | None = h("upper clip epsilon; null = `clip_ratio`")
    tau_pos: float = h("sapo: gate temperature for positive advantages")
    tau_neg: float = h("sapo: gate temperature for the other advantages")
    clip_ratio_c: float = h("dual-clip constant for negative advantages (> 1)")
    policy_loss: PolicyLossConfig = h("policy loss")
    loss_agg_mode: LossAggMode = h("how token losses are aggregated")
    use_rollout_log_probs: bool = h("verl 0.9.1's actor switch to the rollout's log-probs (compatibility only, "
                                    "see COMPAT)")
    loss_scale_factor: float | None = h(
        "divisor of `seq-mean-token-sum-norm` (Dr.GRPO); null = the padded response length "
        "(`data.max_response_length`). As in verl it acts under `trainer.use_legacy_worker_impl=disable` "
        "only: verl's default worker always divides by the padded length")
    entropy_coeff: float = h("entropy bonus coefficient")
    use_kl_loss: bool = h("add KL(actor || reference) to the actor loss")
    kl_loss_coef: float = h("coefficient of the KL loss")
    kl_loss_type: str = h("KL estimator of the KL loss: kl (k1), abs, mse (k2), low_var_kl (k3); a "
                          "trailing `+` (`k3+`) keeps the value and takes k2's gradient")
    ppo_epochs: int = h("passes over each batch of rollouts")
    shuffle: bool = h("permute each rank's rows every epoch under `trainer.use_legacy_worker_impl=disable`; verl's default worker ignores it, and so does this one then")
    optim: OptimConfig = h("actor optimizer")
    fsdp_config: FsdpConfig = h("actor FSDP options")
    checkpoint: CheckpointConfig = h("what a checkpoint holds (verl's `checkpoint` section)")
    use_torch_compile: bool = h("verl: torch.compile the entropy and log-prob helpers (compatibility only)")
    entropy_from_logits_with_chunking: bool = h("verl: the entropy in chunks (compatibility only, see COMPAT)")
    profiler: dict[str, Any] = h("verl's per-role profiler settings (compatibility only, see COMPAT)")


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = h("samples per reference forward; null = all")
    log_prob_use_dynamic_bsz: bool | None = h("token-count micro-batches; null = actor's `use_dynamic_bsz`")
    log_prob_max_token_len_per_gpu: int | None = h("token budget; null = actor's `ppo_max_token_len_per_gpu`")
    fsdp_config: RefFsdpConfig = h("reference FSDP options")
    strategy: Literal["fsdp", "fsdp2"] = h("parallel strategy of the reference workers (compatibility only)")
    use_torch_compile: bool = h("verl: torch.compile the log-prob helpers (compatibility only)")
    entropy_from_logits_with_chunking: bool = h("verl: the entropy in chunks (compatibility only, see COMPAT)")
    profiler: dict[str, Any] = h("verl's per-role profiler settings (compatibility only, see COMPAT)")


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    nccl_timeout: int = h("seconds a collective of the worker groups may wait before the group "
                          "fails (torch.distributed's timeout; NCCL/RCCL on GPUs, gloo on CPUs)")
    hybrid_engine: bool = h("actor and rollout share the training GPUs (colocated); false: generation "
                            "on a rollout pool of its own (`rollout.nnodes` x `rollout.n_gpus_per_node`)")
    model: ModelConfig = h("actor/reference model")
    actor: ActorConfig = h("actor training")
    ref: RefConfig = h("reference model")
    rollout: RolloutConfig = h("generation")


CHUNKED_ENTROPY = ("verl computes the entropy over chunks of the sequence to save memory; it is "
                   "computed over the whole logits here, the same values")

#: verl's model, actor and reference keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "actor_rollout_ref.model.external_lib": "",
    "actor_rollout_ref.model.lora": ("Megatron's LoRA options; FSDP LoRA is "
                                     "`actor_rollout_ref.model.lora_rank`, `lora_alpha` and `target_modules` "
                                     "(`model.lora.rank` and `model.lora.alpha` are read as the first two)"),
    "actor_rollout_ref.model.custom_chat_template": "",
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "sequence parallelism",
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
    "actor_rollout_ref.actor.use_rollout_log_probs": (
        "verl 0.9.1 declares it (`ActorConfig`) and reads it nowhere; the rollout's log-probs become the old "
        "ones through `algorithm.rollout_correction.bypass_mode=true`, as in verl"),
    "actor_rollout_ref.actor.strategy": STRATEGY,
    "actor_rollout_ref.ref.strategy": STRATEGY,
    "actor_rollout_ref.model.use_shm": ("the model is read from its path; verl's copy to shared memory "
                                        "only speeds the load, the weights are the same"),
    "actor_rollout_ref.model.enable_activation_offload": (
        "verl's activation offload only moves the activations saved for the backward pass to host "
        "memory and back (`verl.utils.activation_offload`); the same tensors are used"),
    "actor_rollout_ref.model.use_fused_kernels": (
        "verl's fused linear + log-prob kernel only saves memory; the log-probs here come from the "
        "model's full logits"),
    "actor_rollout_ref.model.use_liger": ("Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear "
                                          "cross-entropy) compute the same layers with less memory; the "
                                          "model's own layers run here"),
    "actor_rollout_ref.model.fused_kernel_options": "options of verl's fused kernels, which do not run here",
    "actor_rollout_ref.actor.use_torch_compile": TORCH_COMPILE,
    "actor_rollout_ref.ref.use_torch_compile": TORCH_COMPILE,
    "actor_rollout_ref.actor.profiler": PROFILER,
    "actor_rollout_ref.actor.checkpoint.async_save": ("verl saves asynchronously with Megatron only; its "
                                                      "FSDP saves are synchronous, as here: the same files"),
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": PREFETCH,
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch": PREFETCH,
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": CHUNKED_ENTROPY,
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": CHUNKED_ENTROPY,
    "actor_rollout_ref.ref.profiler": PROFILER,
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype": BUFFER_DTYPE,
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.buffer_dtype": BUFFER_DTYPE,
}

#: Newer verl spellings read as this trainer's key.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.model.lora.rank": "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.actor.fsdp_config.dtype": "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    "actor_rollout_ref.ref.fsdp_config.dtype": "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 1,
}

#: Values naming a feature this trainer does not have.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.actor.strategy": {"megatron": "Megatron-LM training"},
    "actor_rollout_ref.ref.strategy": {"megatron": "Megatron-LM training"},
}


def validate_lora(arr: ActorRolloutRefConfig) -> None:
    """LoRA's rules (`model.lora_rank` > 0): a positive alpha, target modules."""
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
