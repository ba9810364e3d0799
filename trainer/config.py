"""The trainer's configuration: verl-named keys, frozen dataclasses, dotted overrides.

Defaults live in `trainer/config.yaml`; the dataclasses below give each key its type and one
line of help. `load_config(["data.train_batch_size=64", ...])` applies verl/Hydra-style dotted
overrides, rejects unknown keys (listing the valid ones at that level) and keys verl has that
this trainer does not implement yet, fills the derived values once and validates the whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.algos import registry

DEFAULTS_FILE = Path(__file__).with_name("config.yaml")
RUN_DIR_ENV = "HPCRL_RUN_DIR"
"""Set by hpcrl's node agent: the job's run directory (shared by every restart)."""


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message says what and how to fix it."""


def _h(text: str) -> Any:
    return field(metadata={"help": text})


# ----------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DataConfig:
    tokenizer: str | None = _h("tokenizer path; null uses the actor model's tokenizer")
    train_files: list[str] = _h("training parquet file(s) in verl's format")
    val_files: list[str] = _h("validation parquet file(s) in verl's format")
    prompt_key: str = _h("column holding the prompt as a chat list")
    reward_fn_key: str = _h("column that selects the reward function (e.g. `data_source`)")
    max_prompt_length: int = _h("longest prompt in tokens after the chat template")
    max_response_length: int = _h("longest generated response in tokens")
    train_batch_size: int = _h("prompts per training step")
    val_batch_size: int | None = _h("prompts per validation batch; null = whole set at once")
    shuffle: bool = _h("shuffle the training prompts every epoch")
    seed: int = _h("seed of the training-data shuffle")
    filter_overlong_prompts: bool = _h("drop prompts longer than `max_prompt_length`")
    return_raw_chat: bool = _h("keep the prompt's chat messages (compatibility only, see COMPAT)")
    truncation: Literal["error", "left", "right", "middle"] = _h(
        "what to do with a prompt longer than `max_prompt_length` that was not filtered"
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str = _h("HF model directory (or hub id) of the actor and reference")
    enable_gradient_checkpointing: bool = _h("recompute activations in backward to save memory")
    use_remove_padding: bool = _h("verl's padding-free packing (compatibility only, see COMPAT)")
    trust_remote_code: bool = _h("allow model code shipped with the checkpoint")
    lora_rank: int = _h(
        "LoRA rank (peft); 0 = full fine-tuning. Above 0 only the low-rank adapters train (and "
        "hold optimizer state); the reference policy is the same model with its adapters "
        "disabled (no second model copy), and the rollout engine and the HF export get the "
        "merged weights W + alpha/rank * B A under the base model's names")
    lora_alpha: int = _h("LoRA scaling: the adapters' update is multiplied by `lora_alpha` / `lora_rank`")
    target_modules: list[str] = _h(
        "modules that get LoRA adapters: `all-linear` (every linear layer but the output head) "
        "or module names, e.g. `[q_proj,v_proj]`")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _h("peak learning rate of AdamW")
    lr_warmup_steps: int = _h("linear warm-up steps; -1 uses `lr_warmup_steps_ratio`")
    lr_warmup_steps_ratio: float = _h("warm-up steps as a share of the total training steps")
    min_lr_ratio: float = _h("cosine schedule floor as a share of `lr`")
    warmup_style: Literal["constant", "cosine"] = _h("schedule after warm-up")
    weight_decay: float = _h("AdamW weight decay")
    betas: list[float] = _h("AdamW betas")
    clip_grad: float | None = _h("newer verl name of the section's `grad_clip`; when set it replaces it")


@dataclass(frozen=True)
class FsdpConfig:
    param_offload: bool = _h("offload parameters to CPU between uses (FSDP workers)")
    optimizer_offload: bool = _h("offload optimizer state to CPU between uses (FSDP workers)")


@dataclass(frozen=True)
class RefFsdpConfig:
    param_offload: bool = _h("offload the reference model's parameters to CPU (FSDP workers)")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = _h("policy loss registered under this name (`trainer.algos.registry`); vanilla = PPO clip")


@dataclass(frozen=True)
class ActorConfig:
    strategy: Literal["fsdp", "fsdp2"] = _h("parallel strategy of the actor workers")
    ppo_mini_batch_size: int = _h("prompts per optimizer step (times `rollout.n` samples)")
    ppo_micro_batch_size_per_gpu: int | None = _h("samples per forward/backward; null = whole mini-batch")
    use_dynamic_bsz: bool = _h("form micro-batches by token count instead of sample count")
    ppo_max_token_len_per_gpu: int = _h("token budget of one micro-batch with `use_dynamic_bsz`")
    grad_clip: float = _h("clip the gradient norm to this value")
    clip_ratio: float = _h("PPO clip epsilon, used for low and high when those are null")
    clip_ratio_low: float | None = _h("lower clip epsilon; null = `clip_ratio`")
    clip_ratio_high: float | None = _h("upper clip epsilon; null = `clip_ratio`")
    clip_ratio_c: float = _h("dual-clip constant for negative advantages (> 1)")
    policy_loss: PolicyLossConfig = _h("policy loss")
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = _h("how token losses are aggregated")
    entropy_coeff: float = _h("entropy bonus coefficient")
    use_kl_loss: bool = _h("add KL(actor || reference) to the actor loss")
    kl_loss_coef: float = _h("coefficient of the KL loss")
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = _h("KL estimator of the KL loss")
    ppo_epochs: int = _h("passes over each batch of rollouts")
    shuffle: bool = _h("shuffle samples between mini-batches")
    optim: OptimConfig = _h("actor optimizer")
    fsdp_config: FsdpConfig = _h("actor FSDP options")


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = _h("samples per reference forward; null = all")
    log_prob_use_dynamic_bsz: bool | None = _h("token-count micro-batches; null = actor's `use_dynamic_bsz`")
    log_prob_max_token_len_per_gpu: int | None = _h("token budget; null = actor's `ppo_max_token_len_per_gpu`")
    fsdp_config: RefFsdpConfig = _h("reference FSDP options")


@dataclass(frozen=True)
class ValKwargs:
    top_k: int = _h("validation top-k; -1 = off")
    top_p: float = _h("validation nucleus sampling")
    temperature: float = _h("validation temperature; 0 = greedy")
    n: int = _h("samples per validation prompt")
    do_sample: bool = _h("sample during validation (false = greedy)")


@dataclass(frozen=True)
class RolloutConfig:
    name: Literal["hf", "vllm"] = _h("generation engine: `hf` (transformers generate) or `vllm`")
    temperature: float = _h("sampling temperature")
    top_k: int = _h("top-k sampling; -1 = off")
    top_p: float = _h("nucleus sampling")
    do_sample: bool = _h("sample (false = greedy)")
    n: int = _h("responses per prompt (group size for grpo/rloo)")
    gpu_memory_utilization: float = _h("vLLM: share of GPU memory for weights and KV cache")
    tensor_model_parallel_size: int = _h(
        "ranks per rollout engine: k consecutive ranks shard one engine (vLLM's tensor "
        "parallelism; for `hf`, the decoder's projections split over them) and get the same "
        "prompts, the groups split the prompts data-parallel; must divide the world size")
    enforce_eager: bool = _h("vLLM: no CUDA graphs")
    free_cache_engine: bool = _h("vLLM on GPUs: release the KV cache (sleep) between rollouts")
    max_num_batched_tokens: int = _h("vLLM: tokens per scheduler step")
    max_num_seqs: int = _h("vLLM: sequences per scheduler step")
    max_model_len: int | None = _h("vLLM: context length; null = prompt + response length")
    enable_chunked_prefill: bool = _h("vLLM: chunked prefill")
    disable_log_stats: bool = _h("vLLM: no periodic statistics logging")
    update_weights_bucket_megabytes: int = _h(
        "weight sync: MiB of gathered parameters handed to the rollout engine at once (a larger "
        "tensor goes alone); bounds the sync's memory above the engine's own weights")
    log_prob_micro_batch_size_per_gpu: int | None = _h("samples per old-log-prob forward; null = all")
    log_prob_use_dynamic_bsz: bool | None = _h("token-count micro-batches; null = actor's `use_dynamic_bsz`")
    log_prob_max_token_len_per_gpu: int | None = _h("token budget; null = actor's `ppo_max_token_len_per_gpu`")
    val_kwargs: ValKwargs = _h("sampling parameters for validation")


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    nccl_timeout: int = _h("seconds a collective of the worker groups may wait before the group "
                           "fails (torch.distributed's timeout; NCCL/RCCL on GPUs, gloo on CPUs)")
    hybrid_engine: bool = _h("actor and rollout share weights; must be true (a separate rollout "
                             "deployment is not supported)")
    model: ModelConfig = _h("actor/reference model")
    actor: ActorConfig = _h("actor training")
    ref: RefConfig = _h("reference model")
    rollout: RolloutConfig = _h("generation")


@dataclass(frozen=True)
class CriticModelConfig:
    path: str | None = _h("critic model directory; null = the actor's model path")
    tokenizer_path: str | None = _h("critic tokenizer (compatibility only, see COMPAT)")
    enable_gradient_checkpointing: bool = _h("recompute activations in backward")
    use_remove_padding: bool = _h("verl's padding-free packing (compatibility only, see COMPAT)")
    trust_remote_code: bool = _h("allow model code shipped with the checkpoint")
    fsdp_config: FsdpConfig = _h("critic FSDP options")


@dataclass(frozen=True)
class CriticConfig:
    strategy: Literal["fsdp", "fsdp2"] = _h("parallel strategy of the critic workers")
    optim: OptimConfig = _h("critic optimizer")
    model: CriticModelConfig = _h("critic model")
    ppo_mini_batch_size: int | None = _h("prompts per critic optimizer step; null = actor's")
    ppo_micro_batch_size_per_gpu: int | None = _h("samples per critic forward/backward; null = all")
    use_dynamic_bsz: bool | None = _h("token-count micro-batches; null = actor's")
    ppo_max_token_len_per_gpu: int = _h("token budget of one critic micro-batch")
    forward_max_token_len_per_gpu: int | None = _h("token budget of value forwards; null = previous")
    ppo_epochs: int | None = _h("critic passes per batch; null = actor's `ppo_epochs`")
    shuffle: bool | None = _h("shuffle between mini-batches; null = actor's")
    grad_clip: float = _h("clip the critic gradient norm to this value")
    cliprange_value: float = _h("value clipping range")
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] | None = _h("value-loss aggregation; null = actor's `loss_agg_mode`")


@dataclass(frozen=True)
class CustomRewardConfig:
    path: str | None = _h("Python file holding a reward function; null = built-in scorers")
    name: str = _h("name of the function in that file")


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = _h("dapo: penalise responses that run into the last `len` tokens of the limit")
    len: int = _h("dapo: tokens before `data.max_response_length` where the penalty starts")
    penalty_factor: float = _h("dapo: penalty at the limit (rising linearly over the buffer)")
    log: bool = _h("dapo: report the penalty and whether the response was overlong as metrics")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = _h("a model-based reward model; must be false (rule-based rewards only)")
    reward_manager: Literal["naive", "dapo", "batch"] = _h(
        "how the reward function is called: `naive` once per response, `batch` once per step with "
        "lists (`data_sources`, `solution_strs`, `ground_truths`, `extra_infos`), `dapo` per response "
        "plus the overlong penalty")
    launch_reward_fn_async: bool = _h("score the responses in a thread while the log-probs are computed")
    overlong_buffer: OverlongBufferConfig = _h("DAPO's soft overlong punishment")


@dataclass(frozen=True)
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = _h("KL coefficient controller for the in-reward penalty")
    kl_coef: float = _h("initial KL coefficient")
    horizon: int = _h("adaptive controller horizon")
    target_kl: float = _h("adaptive controller target KL")


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = _h("discount factor")
    lam: float = _h("GAE lambda")
    adv_estimator: str = _h("advantage estimator registered under this name (`trainer.algos.registry`): "
                            "gae, grpo, rloo, reinforce_plus_plus")
    norm_adv_by_std_in_grpo: bool = _h("grpo: divide by the group's standard deviation")
    use_kl_in_reward: bool = _h("subtract a KL penalty from the token rewards")
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = _h("KL estimator of the in-reward penalty")
    kl_ctrl: KLCtrlConfig = _h("KL controller")


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = _h("passes over the training data")
    total_training_steps: int | None = _h("stop after this many steps; null = epochs x batches")
    project_name: str = _h("project name for loggers and the default checkpoint directory")
    experiment_name: str = _h("experiment name for loggers and the default checkpoint directory")
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = _h(
        "metric sinks; the JSONL file in `run_dir` is always written"
    )
    nnodes: int = _h("nodes of the Ray cluster")
    log_val_generations: int = _h(
        "at each validation, log this many samples (the same prompts every time: input, output, "
        "score) to `val_generations.jsonl` in `run_dir` and, with the console logger, print them")
    n_gpus_per_node: int = _h("workers (GPUs) per node; CPU worker slots on nodes without GPUs")
    distributed: bool | None = _h(
        "run on Ray worker groups (true) or in this process (false); null = Ray when "
        "`nnodes` x `n_gpus_per_node` > 1. Ray is joined at `RAY_ADDRESS` (never `auto`), "
        "or a private local cluster is started when it is unset"
    )
    device: Literal["auto", "cpu", "cuda"] = _h("torch device of a run on one rank (several ranks: one GPU per rank, or CPUs)")
    save_freq: int = _h("checkpoint every N steps; -1 = only on stop and at the end")
    resume_mode: Literal["auto", "disable", "resume_path"] = _h(
        "auto: newest complete checkpoint; disable: start fresh; resume_path: `resume_from_path`"
    )
    resume_from_path: str | None = _h("checkpoint directory for `resume_mode=resume_path`")
    val_before_train: bool = _h("validate once before the first step")
    val_only: bool = _h("validate once, log it, and exit without training (a model's baseline)")
    test_freq: int = _h("validate every N steps; -1 = never")
    critic_warmup: int = _h("steps during which only the critic is trained")
    default_local_dir: str | None = _h(
        "checkpoint root; null = `$HPCRL_RUN_DIR/checkpoints` under hpcrl, else "
        "checkpoints/<project>/<experiment>"
    )
    run_dir: str | None = _h(
        "metrics file and STOP file directory; null = `$HPCRL_RUN_DIR` under hpcrl, else "
        "`default_local_dir`"
    )
    deadline_margin_s: float = _h(
        "seconds kept free before the job's end (`HPCRL_JOB_END_TIME`, set by hpcrl) for the "
        "launcher to stop and requeue: the trainer checkpoints and stops by itself when one more "
        "step and a checkpoint would not fit"
    )
    max_actor_ckpt_to_keep: int | None = _h("keep the newest K checkpoints; null = all")
    max_critic_ckpt_to_keep: int | None = _h(
        "null or the same as `max_actor_ckpt_to_keep`: the critic is saved in the same checkpoint")
    balance_batch: bool = _h("give data-parallel workers equal sample counts of similar token totals")
    seed: int = _h("seed of model init, sampling and mini-batch shuffles")


@dataclass(frozen=True)
class DerivedConfig:
    """Values computed once from the others (not settable)."""

    use_critic: bool = _h("a critic is trained (the estimator needs one, e.g. gae)")
    use_reference: bool = _h("a reference model is needed (KL in reward or KL loss)")
    world_size: int = _h("nnodes x n_gpus_per_node")


@dataclass(frozen=True)
class Config:
    data: DataConfig = _h("training and validation data")
    actor_rollout_ref: ActorRolloutRefConfig = _h("actor, rollout and reference")
    critic: CriticConfig = _h("critic (value model)")
    reward_model: RewardModelConfig = _h("how responses are scored (rule-based)")
    custom_reward_function: CustomRewardConfig = _h("user reward function")
    algorithm: AlgorithmConfig = _h("advantage and KL settings")
    trainer: TrainerConfig = _h("loop, logging, checkpoints")
    derived: DerivedConfig = _h("computed values")


# ------------------------------------------------------------------- keys verl has, we do not

_DERIVED_HINT = "is derived here; set `{}` instead"
_CRITIC_LORA = ("LoRA for the critic; the critic trains all its weights. LoRA for the actor is "
                "`actor_rollout_ref.model.lora_rank`")
#: Keys of verl's config that this trainer does not implement; setting one is an error.
NOT_SUPPORTED: dict[str, str] = {
    "data.return_raw_input_ids": "",
    "data.return_full_prompt": "",
    "data.image_key": "multimodal data",
    "data.video_key": "multimodal data",
    "data.custom_cls": "custom dataset classes",
    "data.dataloader_num_workers": "",
    "data.filter_overlong_prompts_workers": "",
    "data.trust_remote_code": "",
    "data.use_shm": "",
    "data.sampler": "custom samplers",
    "data.datagen": "",
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
    "actor_rollout_ref.actor.optim.total_training_steps": _DERIVED_HINT.format(
        "trainer.total_training_steps"
    ),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "sequence parallelism",
    "actor_rollout_ref.ref.fsdp_config.wrap_policy": "",
    "actor_rollout_ref.rollout.mode": "async rollout",
    "actor_rollout_ref.rollout.dtype": "",
    "actor_rollout_ref.rollout.load_format": "",
    "actor_rollout_ref.rollout.layered_summon": "",
    "actor_rollout_ref.rollout.engine_kwargs": "",
    "actor_rollout_ref.rollout.multi_turn": "multi-turn rollout",
    "actor_rollout_ref.rollout.agent": "agent loops",
    "actor_rollout_ref.rollout.calculate_log_probs": "",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.rollout.prompt_length": _DERIVED_HINT.format("data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": _DERIVED_HINT.format("data.max_response_length"),
    "critic.rollout_n": _DERIVED_HINT.format("actor_rollout_ref.rollout.n"),
    "critic.ppo_micro_batch_size": "deprecated in verl; use `critic.ppo_micro_batch_size_per_gpu`",
    "critic.ulysses_sequence_parallel_size": "sequence parallelism",
    "critic.checkpoint": "checkpoint contents are fixed",
    "critic.model.override_config": "",
    "critic.model.external_lib": "",
    "critic.model.lora_rank": _CRITIC_LORA,
    "critic.model.lora_alpha": _CRITIC_LORA,
    "critic.model.target_modules": _CRITIC_LORA,
    "critic.optim.total_training_steps": _DERIVED_HINT.format("trainer.total_training_steps"),
    "custom_reward_function.reward_kwargs": "",
    "algorithm.use_pf_ppo": "",
    "algorithm.pf_ppo": "",
    "algorithm.filter_groups": "DAPO group filtering",
    "trainer.default_hdfs_dir": "HDFS upload",
    "trainer.del_local_ckpt_after_load": "",
    "trainer.validation_data_dir": "",
    "trainer.rollout_data_dir": "",
    "trainer.ray_wait_register_center_timeout": "",
    "trainer.esi_redundant_time": "",
    "trainer.profile_steps": "profiling",
    "trainer.controller_nsight_options": "profiling",
    "trainer.worker_nsight_options": "profiling",
    "ray_init": "",
    "ray_kwargs": "",
}

_PADDING = ("verl's padding-free packing is a speed-up only; the padded computation here gives "
            "the same losses")
#: Keys accepted for verl compatibility that change nothing here, and why nothing is lost;
#: `--print-config` and `--list-keys` mark them. Every other key acts or is refused.
COMPAT: dict[str, str] = {
    "actor_rollout_ref.model.use_remove_padding": _PADDING,
    "critic.model.use_remove_padding": _PADDING,
    "actor_rollout_ref.actor.strategy": "`fsdp` and `fsdp2` both shard with FSDP2 here",
    "critic.strategy": "`fsdp` and `fsdp2` both shard with FSDP2 here",
    "data.return_raw_chat": ("every prompt's chat messages are kept with its batch anyway "
                             "(`Example.prompt`)"),
    "critic.model.tokenizer_path": ("the critic scores the actor's tokens and has no HF export, "
                                    "so it loads no tokenizer"),
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "trainer.default_hdfs_dir": None,
    "actor_rollout_ref.model.use_liger": False,
    "actor_rollout_ref.model.use_fused_kernels": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 1,
    "critic.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.rollout.mode": "sync",
    "actor_rollout_ref.rollout.ignore_eos": False,
    "trainer.del_local_ckpt_after_load": False,
    "algorithm.use_pf_ppo": False,
}


_REWARD_MODEL_WORKER = ("model-based reward models (the reward model worker) are not supported; "
                        "rule-based rewards via `data_source` and `custom_reward_function` are")
#: Values of a key that name a feature this trainer does not have: one clear error each.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.rollout.name": {"sglang": "SGLang rollout", "trtllm": "TensorRT-LLM rollout",
                                       "hf_server": "server-mode rollout"},
    "actor_rollout_ref.actor.strategy": {"megatron": "Megatron-LM training"},
    "actor_rollout_ref.ref.strategy": {"megatron": "Megatron-LM training"},
    "critic.strategy": {"megatron": "Megatron-LM training"},
}


def _not_supported(key: str) -> str | None:
    for prefix, why in NOT_SUPPORTED.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    if ".megatron." in f".{key}." and not key.startswith("reward_model."):
        return "Megatron-LM training (FSDP2 only)"
    if key.startswith("reward_model."):
        try:
            _resolve_key(key)
        except ConfigError:
            return _REWARD_MODEL_WORKER
    return None


def _unsupported_value(key: str, text: str) -> str | None:
    feature = UNSUPPORTED_VALUES.get(key, {}).get(_unquote(text))
    return None if feature is None else (f"`{key}={_unquote(text)}`: {feature} is not supported; "
                                         "this trainer runs FSDP2 training with HF or vLLM rollout")


# ------------------------------------------------------------------------------ value parsing


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = " | ".join(repr(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        name = f"list of {_type_name(typing.get_args(inner)[0])}"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _split_list(text: str) -> list[str]:
    """`[a, 'b', "c,d"]` -> ['a', 'b', 'c,d'] (commas inside quotes kept)."""
    items, current, quote = [], "", ""
    for ch in text[1:-1]:
        if quote:
            current += ch
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            current, quote = current + ch, ch
        elif ch == ",":
            items.append(current)
            current = ""
        else:
            current += ch
    if current.strip() or items:
        items.append(current)
    return [_unquote(i) for i in items]


_NULLS = ("null", "None", "~", "none", "NULL")
_TRUE = ("true", "True", "TRUE", "yes", "on")
_FALSE = ("false", "False", "FALSE", "no", "off")


def parse_value(text: str, tp: Any) -> Any:
    """Parse override text into a value of type `tp`; raise ValueError naming the rule."""
    inner, optional = _split_optional(tp)
    if text.strip() in _NULLS:
        if optional:
            return None
        raise ValueError("null is not allowed here")
    origin = typing.get_origin(inner)
    if origin is list:
        stripped = _unquote(text)
        parts = _split_list(stripped) if stripped.startswith("[") and stripped.endswith("]") else [stripped]
        return [parse_value(p, typing.get_args(inner)[0]) for p in parts]
    text = _unquote(text)
    if origin is Literal:
        choices = typing.get_args(inner)
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}")
        return text
    if inner is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError("must be true or false")
    if inner is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("not a whole number") from None
    if inner is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("not a number") from None
    if inner is str:
        return text
    raise TypeError(f"unsupported config type {inner!r}")


def _coerce_default(value: Any, tp: Any, key: str) -> Any:
    """Check a value coming from YAML against `tp` (ints widen to float, str to [str])."""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"`{key}` is null but must be a {_type_name(tp)}")
    if typing.get_origin(inner) is list:
        seq = value if isinstance(value, list) else [value]
        return [_coerce_default(v, typing.get_args(inner)[0], key) for v in seq]
    if typing.get_origin(inner) is Literal:
        if value not in typing.get_args(inner):
            raise ConfigError(f"`{key}`={value!r} must be a {_type_name(tp)}")
        return value
    if inner is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, inner) or (inner is int and isinstance(value, bool)):
        raise ConfigError(f"`{key}`={value!r} must be a {_type_name(tp)}")
    return value


# -------------------------------------------------------------------------------- overrides


def _valid_keys(cls: type) -> str:
    return ", ".join(f"`{k}`" for k in _hints(cls))


def _resolve_key(key: str) -> tuple[list[str], Any]:
    """Walk `a.b.c` through the dataclasses; return the path and the leaf type."""
    cls: Any = Config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        hints = _hints(cls)
        where = f"`{'.'.join(parts[:depth])}`" if depth else "the top level"
        if part not in hints or (cls is Config and part == "derived"):
            valid = _valid_keys(cls).replace("`derived`, ", "").replace(", `derived`", "")
            raise ConfigError(
                f"unknown key `{key}`: `{part}` is not a key of {where}; valid keys there: {valid}"
            )
        cls = hints[part]
        if _is_section(cls) and depth == len(parts) - 1:
            raise ConfigError(
                f"`{key}` is a section, not a value; set one of its keys: {_valid_keys(cls)}"
            )
        if not _is_section(cls) and depth < len(parts) - 1:
            raise ConfigError(f"unknown key `{key}`: `{'.'.join(parts[: depth + 1])}` is a value, not a section")
    return parts, cls


def _check_accepted_only_as(key: str, text: str) -> bool:
    """True when `key` is a verl key we accept only with its default value and `text` is it."""
    if key not in ACCEPTED_ONLY_AS:
        return False
    allowed = ACCEPTED_ONLY_AS[key]
    tp = type(allowed) if allowed is not None else str | None
    try:
        value = parse_value(text, tp)
    except ValueError:
        value = text
    if value == allowed:
        return True
    shown = "null" if allowed is None else str(allowed).lower() if isinstance(allowed, bool) else str(allowed)
    why = NOT_SUPPORTED.get(key)
    raise ConfigError(
        f"`{key}={text}` is not supported yet{f' ({why})' if why else ''}: only `{key}={shown}` "
        "is accepted; remove the override"
    )


def _not_supported_message(key: str, item: str, why: str) -> str:
    if why.startswith("is derived"):
        return f"`{key}` {why}"
    if why.startswith("deprecated"):
        return f"`{key}` is not supported: {why}"
    if why == _REWARD_MODEL_WORKER:
        return f"`{key}`: {why}; remove the override `{item}`"
    detail = f" ({why})" if why else ""
    return f"`{key}` is not supported yet{detail}; remove the override `{item}`"


@dataclass(frozen=True)
class Override:
    """One command-line override in verl's grammar (Hydra's override grammar, parsed by Hydra)."""

    item: str
    """The override as given."""
    key: str
    """The dotted key."""
    op: Literal["set", "add", "force_add", "delete"]
    """`key=v`, `+key=v`, `++key=v`, `~key` / `~key=v`."""
    value: Any
    """The value as Hydra's grammar reads it (scalars, lists, dicts, None); None for `~key`."""
    text: str | None
    """The value text as given (None for `~key`): unquoted scalars are read from it with this
    trainer's types, so `trainer.experiment_name=007` stays the string `007`."""

    @property
    def interpolated(self) -> bool:
        """The value names other keys (`${a.b}`), resolved against the final config."""
        return self.text is not None and "${" in self.text


_OPS = {"CHANGE": "set", "ADD": "add", "FORCE_ADD": "force_add", "DEL": "delete"}


def _hydra_parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse_override(item: str, parser: Any = None) -> Override:
    """Read one override in verl's grammar: `key=value`, `+key=value` (add), `++key=value`
    (force add), `~key` or `~key=value` (delete), `key=null`, lists `[a,'b,c']`, dicts `{k: v}`,
    quoted strings and `${a.b}` interpolations."""
    from hydra.errors import HydraException

    if "=" not in item and not item.startswith("~"):
        raise ConfigError(
            f"override `{item}` has no `=`; write overrides as `dotted.key=value`, "
            "e.g. `data.train_batch_size=64` (or `~dotted.key` to restore a key's default)"
        )
    try:
        o = (parser or _hydra_parser()).parse_override(item)
    except HydraException as err:
        detail = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"override `{item}` does not parse ({detail}); write `dotted.key=value` and quote "
            "values with spaces or special characters: `key='a b'`"
        ) from None
    if o.is_sweep_override():
        raise ConfigError(
            f"override `{item}` is a sweep in Hydra's grammar (several values); a run takes one "
            "value: write a list as `key=[a,b]`, or quote a string that holds a comma: `key='a,b'`"
        )
    if o.package is not None:
        raise ConfigError(f"override `{item}`: `@package` overrides select config groups, "
                          "which this trainer does not have; write `dotted.key=value`")
    key = o.key_or_group
    text = item.split("=", 1)[1] if "=" in item else None
    return Override(item=item, key=key, op=_OPS[o.type.name], value=o.value() if text is not None else None,
                    text=text)


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def typed_value(value: Any, text: str | None, tp: Any) -> Any:
    """A value read by the grammar (`text` is its unquoted text, when it has one) as type `tp`;
    raise ValueError naming the rule."""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError("null is not allowed here")
    if typing.get_origin(inner) is list:
        seq = value if isinstance(value, list) else [value]
        return [typed_value(v, text if len(seq) == 1 and not isinstance(value, list) else None,
                            typing.get_args(inner)[0]) for v in seq]
    if isinstance(value, dict):
        raise ValueError("got a dict")
    if isinstance(value, list):
        raise ValueError("got a list")
    if isinstance(value, str):
        return value if inner is str else parse_value(value, tp)
    raw = text.strip() if text is not None and not _quoted(text) else _scalar_text(value)
    return parse_value(raw, tp)


def _quoted(text: str) -> bool:
    text = text.strip()
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the nested dict `tree` with the overrides applied in order (the last one
    of a key wins, as in Hydra). `+key`/`++key` set the key like `key=value` (verl scripts add
    with `+` the keys verl's own yaml lacks; here every key has a default); `~key` restores the
    default. Interpolations (`${a.b}`, `${oc.env:NAME}`) are resolved by OmegaConf against the
    config after every override, then typed like any value."""
    return _apply(tree, overrides)[0]


def _apply(defaults: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """:func:`apply_overrides`, and the keys the overrides set, in order."""
    import copy

    tree = copy.deepcopy(defaults)
    parser = _hydra_parser() if overrides else None
    deferred: list[tuple[Override, list[str], Any]] = []
    keys: list[str] = []
    for item in overrides:
        o = parse_override(item, parser)
        if o.op == "delete" and _not_supported(o.key) is not None:
            continue  # removing a key this trainer does not have leaves nothing to remove
        if o.op != "delete" and _check_accepted_only_as(o.key, o.text or ""):
            continue
        why = _not_supported(o.key)
        if why is not None:
            raise ConfigError(_not_supported_message(o.key, item, why))
        refused = None if o.op == "delete" else _unsupported_value(o.key, o.text or "")
        if refused is not None:
            raise ConfigError(refused)
        parts, tp = _resolve_key(o.key)
        keys.append(o.key)
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        deferred = [d for d in deferred if d[0].key != o.key]
        if o.op == "delete":
            if o.text is not None and node.get(parts[-1]) != _override_value(o, tp):
                raise ConfigError(f"`{item}` deletes `{o.key}` only while it equals the given "
                                  f"value, but it is {node.get(parts[-1])!r}; write `~{o.key}`")
            node[parts[-1]] = copy.deepcopy(_lookup(defaults, o.key)[1])
        elif o.interpolated:
            node[parts[-1]] = o.value
            deferred.append((o, parts, tp))
        else:
            node[parts[-1]] = _override_value(o, tp)
    if deferred:
        _resolve_interpolations(tree, deferred)
    return tree, keys


def is_override(arg: str) -> bool:
    """Whether a command-line word is a trainer override (`key=value`, `~key`), not a flag."""
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


@contextlib.contextmanager
def _reading_env(job_env: Mapping[str, str] | None) -> Iterator[None]:
    """The variables of `job_env` this process lacks, set while the overrides are read."""
    added = {k: v for k, v in (job_env or {}).items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def override_values(args: Sequence[str], job_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keys the overrides among `args` set and the value each ends with (verl's grammar,
    interpolations resolved, `~key` back to its default): how the launcher reads a payload's
    overrides (submit's checks, the run directory's paths), by the trainer's own rules. Keys
    this trainer does not have are left out. `job_env`: variables the job will have that this
    process lacks (`${oc.env:HPCRL_NUM_NODES}`), for the reading only. Raises ConfigError as the
    trainer would."""
    with _reading_env(job_env):
        tree, keys = _apply(load_defaults(), [a for a in args if is_override(a)])
    return {key: _lookup(tree, key)[1] for key in keys}


def check_overrides(args: Sequence[str], job_env: Mapping[str, str] | None = None) -> Config:
    """The trainer's whole check of the overrides among `args` (types, ranges, the settings it
    refuses), as its start on the job's nodes runs it, with `job_env` as in `override_values`;
    files are not looked at (they may exist only on the compute nodes). Raises ConfigError."""
    with _reading_env(job_env):
        return load_config([a for a in args if is_override(a)], env=dict(os.environ))


def _lookup(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(whether dotted `key` is in `tree`, its value)."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _override_value(o: Override, tp: Any) -> Any:
    try:
        return typed_value(o.value, o.text, tp)
    except ValueError as err:
        raise ConfigError(f"`{o.item}`: {err}; expected a {_type_name(tp)}") from None


def _resolve_interpolations(tree: dict[str, Any], deferred: list[tuple[Override, list[str], Any]]) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    conf = OmegaConf.create(tree)
    resolved = []
    for o, parts, tp in deferred:
        try:
            value = OmegaConf.select(conf, o.key, throw_on_resolution_failure=True)
        except OmegaConfBaseException as err:
            detail = str(err).strip().splitlines()[0]
            raise ConfigError(
                f"`{o.item}`: the interpolation cannot be resolved ({detail}); `${{...}}` must "
                "name a key of the final config, e.g. `${data.max_prompt_length}`, or a "
                "variable, `${oc.env:NAME}`"
            ) from None
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        resolved.append((parts, _override_value(dataclasses.replace(o, value=value, text=None), tp)))
    for parts, value in resolved:
        node = tree
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value


# ------------------------------------------------------------------------------ build + derive


def _build(cls: type, tree: Any, prefix: str) -> Any:
    if not isinstance(tree, dict):
        raise ConfigError(f"`{prefix}` must be a section with keys {_valid_keys(cls)}")
    hints = _hints(cls)
    unknown = set(tree) - set(hints)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'`{prefix}.{k}`' for k in sorted(unknown))}; "
            f"valid keys of `{prefix}`: {_valid_keys(cls)}"
        )
    values = {}
    for name, tp in hints.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in tree:
            raise ConfigError(f"`{key}` is missing from the defaults file {DEFAULTS_FILE}")
        sub = tree[name]
        values[name] = _build(tp, sub, key) if _is_section(tp) else _coerce_default(sub, tp, key)
    return cls(**values)


def _expand(path: str) -> str:
    return os.path.expanduser(os.path.expandvars(path))


def _derive(tree: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Fill the null "derived" values in place, verl's interpolations done once; under hpcrl
    (`HPCRL_RUN_DIR` in `env`) checkpoints and metrics default to the job's run directory."""
    arr = tree["actor_rollout_ref"]
    actor, critic, trainer = arr["actor"], tree["critic"], tree["trainer"]
    for section in (arr["ref"], arr["rollout"]):
        if section["log_prob_use_dynamic_bsz"] is None:
            section["log_prob_use_dynamic_bsz"] = actor["use_dynamic_bsz"]
        if section["log_prob_max_token_len_per_gpu"] is None:
            section["log_prob_max_token_len_per_gpu"] = actor["ppo_max_token_len_per_gpu"]
    for section in (actor, critic):
        if section["optim"]["clip_grad"] is not None:
            section["grad_clip"] = section["optim"]["clip_grad"]
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if actor[name] is None:
            actor[name] = actor["clip_ratio"]
    for name in ("ppo_mini_batch_size", "ppo_epochs", "shuffle", "use_dynamic_bsz", "loss_agg_mode"):
        if critic[name] is None:
            critic[name] = actor[name]
    if critic["forward_max_token_len_per_gpu"] is None:
        critic["forward_max_token_len_per_gpu"] = critic["ppo_max_token_len_per_gpu"]
    if critic["model"]["path"] is None:
        critic["model"]["path"] = arr["model"]["path"]
    if critic["model"]["tokenizer_path"] is None:
        critic["model"]["tokenizer_path"] = critic["model"]["path"]
    launched = (env or {}).get(RUN_DIR_ENV)
    if trainer["default_local_dir"] is None:
        trainer["default_local_dir"] = (
            os.path.join(launched, "checkpoints") if launched
            else f"checkpoints/{trainer['project_name']}/{trainer['experiment_name']}"
        )
    if trainer["run_dir"] is None:
        trainer["run_dir"] = launched or trainer["default_local_dir"]
    data = tree["data"]
    data["train_files"] = [_expand(p) for p in _as_list(data["train_files"])]
    data["val_files"] = [_expand(p) for p in _as_list(data["val_files"])]
    arr["model"]["path"] = _expand(arr["model"]["path"])
    critic["model"]["path"] = _expand(critic["model"]["path"])
    algo = tree["algorithm"]
    tree["derived"] = {
        "use_critic": _estimator(str(algo["adv_estimator"])).needs_critic,
        "use_reference": bool(algo["use_kl_in_reward"] or actor["use_kl_loss"]),
        "world_size": trainer["nnodes"] * trainer["n_gpus_per_node"],
    }
    return tree


def _estimator(name: str) -> Any:
    """The registered estimator `name` (:mod:`trainer.algos.registry`), or a `ConfigError`."""
    try:
        return registry.adv_estimator(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Cross-key rules (batch divisibility, algorithm requirements)."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    for key, value in (("data.train_batch_size", data.train_batch_size),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                       ("actor_rollout_ref.rollout.n", rollout.n),
                       ("trainer.nnodes", cfg.trainer.nnodes),
                       ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node),
                       ("data.max_prompt_length", data.max_prompt_length),
                       ("data.max_response_length", data.max_response_length),
                       ("actor_rollout_ref.rollout.update_weights_bucket_megabytes",
                        rollout.update_weights_bucket_megabytes)):
        _require(value >= 1, f"`{key}`={value} must be at least 1")
    _require(
        data.train_batch_size % actor.ppo_mini_batch_size == 0,
        f"`data.train_batch_size`={data.train_batch_size} must be a multiple of "
        f"`actor_rollout_ref.actor.ppo_mini_batch_size`={actor.ppo_mini_batch_size}; "
        "change one of them",
    )
    world = cfg.derived.world_size
    samples = actor.ppo_mini_batch_size * rollout.n
    _require(
        samples % world == 0,
        f"a mini-batch holds `ppo_mini_batch_size` x `rollout.n` = {samples} samples, which "
        f"must split evenly over {world} workers (`trainer.nnodes` x `trainer.n_gpus_per_node`)",
    )
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro is not None and not actor.use_dynamic_bsz:
        _require(
            (samples // world) % micro == 0,
            f"`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`={micro} must divide the "
            f"{samples // world} samples per worker of one mini-batch",
        )
    group = _estimator(cfg.algorithm.adv_estimator).min_group_size
    _require(
        rollout.n >= group,
        f"`algorithm.adv_estimator={cfg.algorithm.adv_estimator}` compares responses within a "
        f"group and needs `actor_rollout_ref.rollout.n` >= {group} (got {rollout.n})",
    )

    _require(
        actor.policy_loss.loss_mode in registry.policy_loss_names(),
        f"`actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode}` is not a "
        f"registered policy loss; valid values: {', '.join(registry.policy_loss_names())}",
    )
    _require(actor.clip_ratio_c > 1.0, f"`actor_rollout_ref.actor.clip_ratio_c`={actor.clip_ratio_c} must be > 1")
    _require(
        cfg.trainer.resume_mode != "resume_path" or cfg.trainer.resume_from_path is not None,
        "`trainer.resume_mode=resume_path` needs `trainer.resume_from_path=<checkpoint dir>`",
    )
    tp = rollout.tensor_model_parallel_size
    _require(tp >= 1, f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` must be at least 1")
    _require(
        world % tp == 0,
        f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` must divide the {world} "
        "ranks (`trainer.nnodes` x `trainer.n_gpus_per_node`): each group of that many ranks runs "
        "one rollout engine (verl's rollout mesh, dp x tp). Fix: pick a divisor of the world size",
    )
    _require(not cfg.trainer.val_only or bool(data.val_files),
             "`trainer.val_only=true` validates and exits, and needs a validation set: set "
             "`data.val_files`")
    _require(cfg.trainer.log_val_generations >= 0,
             f"`trainer.log_val_generations={cfg.trainer.log_val_generations}` must be 0 or more")
    _require(arr.nccl_timeout > 0, f"`actor_rollout_ref.nccl_timeout={arr.nccl_timeout}` must be positive")
    _require(not cfg.reward_model.enable, f"`reward_model.enable=true`: {_REWARD_MODEL_WORKER}. Fix: "
             "remove the override, and score with `custom_reward_function.path=<file.py>`")
    buffer = cfg.reward_model.overlong_buffer
    _require(
        not buffer.enable or 0 < buffer.len <= data.max_response_length,
        f"`reward_model.overlong_buffer.len={buffer.len}` must be between 1 and "
        f"`data.max_response_length`={data.max_response_length} when the buffer is enabled",
    )
    _require(
        not buffer.enable or cfg.reward_model.reward_manager == "dapo",
        "`reward_model.overlong_buffer.enable=true` acts only with `reward_model.reward_manager=dapo` "
        f"(it is `{cfg.reward_model.reward_manager}`); set both",
    )
    _require(
        arr.hybrid_engine,
        "`actor_rollout_ref.hybrid_engine=false`: the actor and the rollout always share one set "
        "of weights here (verl's hybrid engine); a separate rollout deployment is not supported. "
        "Fix: remove the override",
    )
    _validate_lora(cfg)
    keep = cfg.trainer.max_critic_ckpt_to_keep
    _require(
        keep is None or keep == cfg.trainer.max_actor_ckpt_to_keep,
        f"`trainer.max_critic_ckpt_to_keep={keep}`: the critic is saved inside each checkpoint "
        "with the actor, so one limit applies to both; set `trainer.max_actor_ckpt_to_keep` "
        f"instead (it is {cfg.trainer.max_actor_ckpt_to_keep})",
    )
    c = cfg.critic
    if cfg.derived.use_critic and c.ppo_mini_batch_size is not None:
        critic_samples = c.ppo_mini_batch_size * rollout.n
        _require(
            critic_samples % world == 0,
            f"a critic mini-batch holds `critic.ppo_mini_batch_size` x `rollout.n` = {critic_samples} "
            f"samples, which must split evenly over {world} workers",
        )


def _validate_lora(cfg: Config) -> None:
    model = cfg.actor_rollout_ref.model
    _require(model.lora_rank >= 0, f"`actor_rollout_ref.model.lora_rank={model.lora_rank}` must be 0 "
             "(full fine-tuning) or a positive LoRA rank")
    if model.lora_rank == 0:
        return
    _require(model.lora_alpha > 0, f"`actor_rollout_ref.model.lora_alpha={model.lora_alpha}` must be "
             "positive with LoRA (`lora_rank` > 0): the adapters' update is scaled by "
             "`lora_alpha` / `lora_rank` (verl's default is 16)")
    targets = model.target_modules
    _require(bool(targets) and all(t.strip() for t in targets),
             "`actor_rollout_ref.model.target_modules` is empty with LoRA (`lora_rank` > 0); set "
             "`all-linear` or module names such as `[q_proj,v_proj]`")
    _require("all-linear" not in targets or len(targets) == 1,
             f"`actor_rollout_ref.model.target_modules={targets}`: `all-linear` already selects "
             "every linear layer; give it alone or list module names without it")
    _require(not cfg.actor_rollout_ref.ref.fsdp_config.param_offload,
             "`actor_rollout_ref.ref.fsdp_config.param_offload=true` with LoRA (`lora_rank` > 0): "
             "the reference policy is the actor with its adapters disabled and has no weights of "
             "its own to offload. Fix: remove the override (or offload the actor's with "
             "`actor_rollout_ref.actor.fsdp_config.param_offload=true`)")


def load_defaults() -> dict[str, Any]:
    with open(DEFAULTS_FILE) as fh:
        return yaml.safe_load(fh)


def load_config(
    overrides: list[str] | tuple[str, ...] = (), env: Mapping[str, str] | None = None
) -> Config:
    """Defaults + dotted overrides -> validated, derived, frozen `Config`; `env` (default: the
    process environment) supplies `HPCRL_RUN_DIR` when hpcrl launched the trainer."""
    tree = apply_overrides(load_defaults(), list(overrides))
    cfg = _build(Config, _derive(tree, os.environ if env is None else env), "")
    validate(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a `Config` from `config_to_dict` output (e.g. the copy in a checkpoint)."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


class _Dumper(yaml.SafeDumper):
    """Sections as blocks (one key per line), lists inline."""


_Dumper.add_representer(
    list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def dump_config(cfg: Config) -> str:
    """The config as YAML; the keys accepted only for compatibility carry a comment saying so."""
    text = yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    lines, path = [], []
    for line in text.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.strip().split(":", 1)[0]
        path = [*path[:depth], name]
        why = COMPAT.get(".".join(path))
        lines.append(f"{line}  # compatibility only: {why}" if why and ":" in line else line)
    return "\n".join(lines) + "\n"


def describe_keys() -> list[tuple[str, str, str]]:
    """(dotted key, type, help) for every settable key, in file order."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if cls is Config and f.name == "derived":
                continue
            tp = _hints(cls)[f.name]
            key = f"{prefix}{f.name}"
            if _is_section(tp):
                walk(tp, key + ".")
            else:
                why = COMPAT.get(key)
                rows.append((key, _type_name(tp),
                             f.metadata["help"] + (f" [compatibility only: {why}]" if why else "")))

    walk(Config, "")
    return rows
