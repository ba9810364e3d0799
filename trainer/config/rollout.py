"""`actor_rollout_ref.rollout.*`: generation (verl's `rollout` section). Defaults:
`trainer/config/rollout.yaml`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import DERIVED_HINT, ON_GPU_BF16, PROFILER, Dtype, h


@dataclass(frozen=True)
class ValKwargs:
    top_k: int = h("validation top-k; -1 = off")
    top_p: float = h("validation nucleus sampling")
    temperature: float = h("validation temperature; 0 = greedy")
    n: int = h("samples per validation prompt")
    do_sample: bool = h("sample during validation (false = greedy)")


@dataclass(frozen=True)
class RolloutConfig:
    name: Literal["hf", "vllm"] | None = h(
        "generation engine: `hf` (transformers generate) or `vllm`; null = `vllm` (verl's default) "
        "where vLLM is installed, else `hf` with a note saying so")
    temperature: float = h("sampling temperature")
    dtype: Dtype | None = h(f"dtype of the rollout engine's weights and compute (HF and vLLM); {ON_GPU_BF16}")
    top_k: int = h("top-k sampling; -1 = off")
    top_p: float = h("nucleus sampling")
    do_sample: bool = h("sample (false = greedy)")
    n: int = h("responses per prompt (group size for grpo/rloo)")
    gpu_memory_utilization: float = h("vLLM: share of GPU memory for weights and KV cache")
    tensor_model_parallel_size: int = h(
        "ranks per rollout engine: k consecutive ranks shard one engine (vLLM's tensor "
        "parallelism; for `hf`, the decoder's projections split over them) and get the same "
        "prompts, the groups split the prompts data-parallel; must divide the world size")
    enforce_eager: bool = h("vLLM: no CUDA graphs (verl's default false captures them on GPUs; the CPU "
                            "backend always runs eagerly)")
    free_cache_engine: bool = h("vLLM on GPUs: release the KV cache (sleep) between rollouts")
    max_num_batched_tokens: int = h("vLLM: tokens per scheduler step")
    max_num_seqs: int = h("vLLM: sequences per scheduler step")
    max_model_len: int | None = h("vLLM: context length; null = prompt + response length")
    enable_chunked_prefill: bool = h("vLLM: chunked prefill")
    disable_log_stats: bool = h("vLLM: no periodic statistics logging")
    update_weights_bucket_megabytes: int = h(
        "weight sync: MiB of gathered parameters handed to the rollout engine at once (a larger "
        "tensor goes alone); bounds the sync's memory above the engine's own weights")
    log_prob_micro_batch_size_per_gpu: int | None = h("samples per old-log-prob forward; null = all")
    log_prob_use_dynamic_bsz: bool | None = h("token-count micro-batches; null = actor's `use_dynamic_bsz`")
    log_prob_max_token_len_per_gpu: int | None = h("token budget; null = actor's `ppo_max_token_len_per_gpu`")
    val_kwargs: ValKwargs = h("sampling parameters for validation")
    calculate_log_probs: bool = h(
        "keep the engine's log-probs of the sampled tokens and log verl's "
        "`training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr` (how far "
        "the sampler's probabilities are from the actor's); the old log-probs then get their own "
        "forward pass even where the on-policy update would supply them")
    mode: Literal["sync", "async"] = h("verl: the single-turn rollout's scheduling (compatibility only, see COMPAT)")
    load_format: str = h("verl: how the rollout engine loads its first weights (compatibility only, see COMPAT)")
    layered_summon: bool = h("verl: gather LoRA weights layer by layer for the sync (compatibility only)")
    enable_prefix_caching: bool = h("vLLM's prefix cache (compatibility only, see COMPAT)")
    profiler: dict[str, Any] = h("verl's per-role profiler settings (compatibility only, see COMPAT)")
    multi_turn: dict[str, Any] = h("verl's multi-turn options; `multi_turn.enable=true` is refused "
                                   "(compatibility only, see COMPAT)")


def default_rollout_name() -> str:
    """`actor_rollout_ref.rollout.name` when it is null: verl's default, `vllm`, where vLLM is
    installed (looked up, not imported), else `hf`."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        found = False
    return "vllm" if found else "hf"


NO_VLLM_NOTE = ("`actor_rollout_ref.rollout.name` is not set and vLLM (verl's default engine) is not "
                "installed here: the rollout runs on `hf` (transformers generate), which samples from "
                "the same policy but not the same tokens as vLLM would. Set "
                "`actor_rollout_ref.rollout.name=hf` to choose it, or install vLLM")


#: verl's `rollout.*` keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "actor_rollout_ref.rollout.checkpoint_engine": (
        "checkpoint engine backends (the weights go to the rollout engine in memory here); the bucket "
        "size `checkpoint_engine.update_weights_bucket_megabytes` is read as "
        "`actor_rollout_ref.rollout.update_weights_bucket_megabytes`"),
    "actor_rollout_ref.rollout.engine_kwargs": "",
    "actor_rollout_ref.rollout.multi_turn.enable": "multi-turn rollout",
    "actor_rollout_ref.rollout.agent": "agent loops",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.rollout.prompt_length": DERIVED_HINT.format("data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": DERIVED_HINT.format("data.max_response_length"),
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "actor_rollout_ref.rollout.ignore_eos": False,
    "actor_rollout_ref.rollout.multi_turn.enable": False,
}

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "actor_rollout_ref.rollout.mode": (
        "single-turn rollout here is one batched generate per step with the current weights; verl's "
        "async single-turn agent loop samples the same on-policy responses"),
    "actor_rollout_ref.rollout.load_format": ("the rollout engine gets the actor's weights at every "
                                              "sync here, whatever it loaded first"),
    "actor_rollout_ref.rollout.layered_summon": ("LoRA weights are merged and synced in buckets here; "
                                                 "verl's layer-by-layer gather only lowers peak memory"),
    "actor_rollout_ref.rollout.enable_prefix_caching": (
        "vLLM's prefix cache is always on here (verl's default); it reuses the KV of identical prompt "
        "prefixes, the sampled responses follow the same distribution"),
    "actor_rollout_ref.rollout.profiler": PROFILER,
    "actor_rollout_ref.rollout.multi_turn": ("multi-turn options act only with `multi_turn.enable=true` "
                                             "(refused here); the rollout is single-turn, as verl's is "
                                             "without it"),
}

#: Newer verl spellings read as this trainer's key.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
}

#: Values naming a feature this trainer does not have.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.rollout.name": {"sglang": "SGLang rollout", "trtllm": "TensorRT-LLM rollout",
                                       "hf_server": "server-mode rollout"},
}
