"""`actor_rollout_ref.rollout.*`: generation (verl's `rollout` section). Defaults:
`trainer/config/rollout.yaml`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import DERIVED_HINT, ON_GPU_BF16, PROFILER, Dtype, h, require


@dataclass(frozen=True)
class ValKwargs:
    top_k: int = h("validation top-k; -1 = off")
    top_p: float = h("validation nucleus sampling")
    temperature: float = h("validation temperature; 0 = greedy")
    n: int = h("samples per validation prompt")
    do_sample: bool = h("false = greedy validation in the batched single-turn rollout only; agent loops "
                        "do not read it, as verl's do not (`temperature: 0` is greedy everywhere)")


#: verl's agent loop for a row without `agent_name` (`rollout.agent.default_agent_loop`): one
#: generation per prompt, the rollout this trainer runs.
SINGLE_TURN_AGENT = "single_turn_agent"

def server_mode(cfg: Any) -> bool:
    """Whether the rollout runs server-mode replicas (`rollout.mode=async` on vLLM): one per
    `tensor_model_parallel_size` consecutive ranks, started by the first of them
    (:mod:`trainer.rollout.vllm_server`)."""
    r = cfg.actor_rollout_ref.rollout
    return r.name == "vllm" and r.mode == "async"


_UNUSED_HERE = ("read by verl's SGLang multi-turn rollout only (`verl/workers/rollout/schemas.py`), "
                "not by its agent loops, which are the rollout here (compatibility only, see COMPAT)")


@dataclass(frozen=True)
class MultiTurnConfig:
    """verl's `rollout.multi_turn.*`: settings of its tool agent loop (`trainer.agent.loops`)."""

    enable: bool = h("verl: tags the batch as multi-turn; the loop is chosen per row by `agent_name` "
                     "(compatibility only, see COMPAT)")
    max_assistant_turns: int | None = h("tool agent loop: stop after this many model turns; null = no limit")
    tool_config_path: str | None = h("tool agent loop: verl's tool config YAML (`tools: [{class_name, config, "
                                     "tool_schema}]`, see `trainer.agent.tools`); null = no tools")
    max_user_turns: int | None = h("tool agent loop: stop after this many tool/user turns; null = no limit")
    max_parallel_calls: int = h("tool agent loop: tool calls of one model turn that run (the rest are dropped)")
    max_tool_response_length: int = h("tool agent loop: characters of a tool's reply kept")
    tool_response_truncate_side: Literal["left", "right", "middle"] = h(
        "tool agent loop: where a long tool reply is cut (verl's names: `left` keeps the start)")
    interaction_config_path: str | None = h(
        "tool agent loop: verl's interaction config YAML (`interaction: [{name, class_name, config}]`); "
        "rows choose one by `extra_info.interaction_kwargs.name`; null = none")
    use_inference_chat_template: bool = h(_UNUSED_HERE)
    tokenization_sanity_check_mode: str = h(_UNUSED_HERE)
    format: str = h("tool agent loop: the tool-call format the parser reads (`hermes`)")
    num_repeat_rollouts: int | None = h(_UNUSED_HERE)


@dataclass(frozen=True)
class AgentConfig:
    """verl's `rollout.agent.*`; `agent_loop_manager_class` and `custom_async_server` are
    accepted only at their defaults."""

    num_workers: int = h("verl: agent-loop workers the rollout's requests are spread over "
                         "(compatibility only, see COMPAT)")
    default_agent_loop: str = h("the agent loop of a data row without `agent_name`")
    agent_loop_config_path: str | None = h(
        "custom agent loops: a YAML list of `{name, _target_: package.module.Class}` (subclasses of "
        "`trainer.agent.base.AgentLoop`, or loops written for verl with their constructor arguments beside "
        "`_target_`); rows choose them by `agent_name`")


@dataclass(frozen=True)
class TraceConfig:
    """verl's `rollout.trace.*` (trainer.agent.trace)."""

    backend: Literal["mlflow"] | None = h(
        "trace each agent-loop trajectory (its turns and tool calls as spans) to MLflow, into "
        "`MLFLOW_TRACKING_URI` or `<run_dir>/mlruns.db`; tracing runs every row through its agent "
        "loop, as verl does; null = no tracing")
    token2text: bool = h("traces also carry the decoded text of every token list")
    max_samples_per_step_per_worker: int | None = h(
        "each rank traces at most this many prompts per rollout (all their samples), drawn with "
        "the step as seed; null = all")


_SGLANG_ONLY = "read by verl's SGLang rollout only (compatibility only, see COMPAT)"


@dataclass(frozen=True)
class EngineKwargs:
    """verl's `rollout.engine_kwargs.*`: extra arguments of each inference engine."""

    vllm: dict[str, Any] = h(
        "extra vLLM engine arguments, passed as verl 0.9.1 passes them (`**engine_kwargs` over the "
        "engine's own, null values dropped, `compilation_config` merged), e.g. "
        "`engine_kwargs.vllm.swap_space=4`; the few this trainer's weight sync and rollout mesh depend on "
        "are refused naming the key that sets them")
    sglang: dict[str, Any] = h(_SGLANG_ONLY)
    trtllm: dict[str, Any] = h("read by verl's TensorRT-LLM rollout only (compatibility only, see COMPAT)")


@dataclass(frozen=True)
class RolloutCheckpointEngine:
    backend: Literal["naive", "nccl"] = h(
        "verl's checkpoint engine: how the weights reach the rollout (`naive`, verl's default; `nccl`, what "
        "verl's async configs set). Both act alike here (see COMPAT): a rollout pool of its own gets them "
        "by a collective broadcast (NCCL/RCCL between GPUs, gloo between CPUs) unless "
        "`async_training.checkpoint_engine.enable=false`, a colocated engine in memory")


@dataclass(frozen=True)
class RolloutConfig:
    name: Literal["hf", "vllm"] | None = h(
        "generation engine: `hf` (transformers generate) or `vllm`; null = `vllm` (verl's default) "
        "where vLLM is installed, else `hf` with a note saying so")
    temperature: float = h("sampling temperature")
    dtype: Dtype | None = h(f"dtype of the rollout engine's weights and compute (HF and vLLM); {ON_GPU_BF16}")
    top_k: int = h("top-k sampling; -1 = off")
    top_p: float = h("nucleus sampling")
    do_sample: bool = h("false = greedy in the batched single-turn rollout only; agent loops do not read "
                        "it, as verl's do not (`temperature: 0` is greedy everywhere)")
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
    data_parallel_size: int = h(
        "verl: data-parallel engines per rollout server (its replica is `tensor_model_parallel_size` x this "
        "many GPUs); here each of them is a replica of its own, the same engines with the batch's "
        "trajectories dealt out to all (`rollout.mode=async`) or its prompts split (`sync`), so it changes "
        "no number; `tensor_model_parallel_size` x this must divide the world size, as verl requires")
    max_num_seqs: int = h("vLLM: sequences per scheduler step")
    max_model_len: int | None = h("vLLM: context length; null = the model's `max_position_embeddings` (as verl)")
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
    mode: Literal["sync", "async"] = h(
        "vLLM's engine: `sync` (default here, the faster for single-turn rows) one in-process engine per "
        "rank, every live trajectory's turn batched into one call; `async` (verl's default) a "
        "server-mode replica per engine (AsyncLLM, its engine core in a process of its own; over "
        "`tensor_model_parallel_size` GPUs of one node, started by the engine's first rank) serving "
        "turns as they come, the faster for multi-turn rows (`bench/README.md`). Every row runs through "
        "its agent loop either way")
    load_format: str = h("verl: how the rollout engine loads its first weights (compatibility only, see COMPAT)")
    layered_summon: bool = h("verl: gather LoRA weights layer by layer for the sync (compatibility only)")
    enable_prefix_caching: bool = h("vLLM's prefix cache (compatibility only, see COMPAT)")
    profiler: dict[str, Any] = h("verl's per-role profiler settings (compatibility only, see COMPAT)")
    checkpoint_engine: RolloutCheckpointEngine = h("verl's weight-sync engine")
    multi_turn: MultiTurnConfig = h("verl's tool agent loop settings")
    agent: AgentConfig = h("verl's agent-loop settings")
    trace: TraceConfig = h("verl's rollout tracing")
    over_sample_rate: float = h("verl: declared, read by no code (compatibility only, see COMPAT)")
    multi_stage_wake_up: bool = h("verl: SGLang's staged wake-up (compatibility only, see COMPAT)")
    engine_kwargs: EngineKwargs = h("extra arguments of the inference engine (verl's `engine_kwargs`)")
    sglang_rollout_mode: str | None = h(f"verl: SGLang's `engine` or `server` mode; {_SGLANG_ONLY}")
    server: dict[str, Any] = h(f"verl: SGLang's HTTP server settings (timeouts, retries); {_SGLANG_ONLY}")


#: vLLM engine arguments this trainer sets and depends on, which `engine_kwargs.vllm` may not
#: replace (verl 0.9.1 lets its `engine_kwargs` replace any argument it sets, `**engine_kwargs`
#: last; these carry the rollout mesh, the weight sync and the context here), with the fix.
ENGINE_KWARGS_REFUSED: dict[str, str] = {
    "model": "set `actor_rollout_ref.model.path`",
    "tokenizer": "the tokenizer is the model's; set `actor_rollout_ref.model.path`",
    "tensor_parallel_size": "set `actor_rollout_ref.rollout.tensor_model_parallel_size`",
    "pipeline_parallel_size": "pipeline-parallel rollout engines are not supported; remove it",
    "data_parallel_size": "one engine per `tensor_model_parallel_size` ranks is the data parallelism here; remove it",
    "max_model_len": "set `actor_rollout_ref.rollout.max_model_len`",
    "load_format": "the engine starts with dummy weights and gets the actor's at every sync; remove it",
    "enable_sleep_mode": "set `actor_rollout_ref.rollout.free_cache_engine`",
    "distributed_executor_backend": "the executor follows the rollout mode here; remove it",
}


def validate_engine_kwargs(rollout: RolloutConfig) -> None:
    """`rollout.engine_kwargs.vllm` names no argument of :data:`ENGINE_KWARGS_REFUSED`."""
    given = [k for k, v in rollout.engine_kwargs.vllm.items() if v is not None and k in ENGINE_KWARGS_REFUSED]
    require(not given, "; ".join(
        f"`actor_rollout_ref.rollout.engine_kwargs.vllm.{k}` is an engine argument this trainer sets itself "
        f"(verl lets `engine_kwargs` replace it; here the rollout depends on it). Fix: {ENGINE_KWARGS_REFUSED[k]}"
        for k in given))


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
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": (
        "a custom agent-loop manager (the rollout's rows run through `trainer.agent.manager` here); "
        "custom loops go in `actor_rollout_ref.rollout.agent.agent_loop_config_path`"),
    "actor_rollout_ref.rollout.agent.custom_async_server": (
        "custom async rollout servers (the rollout engine runs inside the trainer's workers here)"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        "deprecated in verl; use `actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`"
    ),
    "actor_rollout_ref.rollout.prompt_length": DERIVED_HINT.format("data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": DERIVED_HINT.format("data.max_response_length"),
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "actor_rollout_ref.rollout.ignore_eos": False,
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": None,
    "actor_rollout_ref.rollout.agent.custom_async_server.path": None,
    "actor_rollout_ref.rollout.agent.custom_async_server.name": None,
}

_SGLANG_NOTE = ("only verl's SGLang rollout reads it; under vLLM (or HF) it changes nothing, in verl as "
                "here")

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "actor_rollout_ref.rollout.checkpoint_engine.backend": (
        "`naive` and `nccl` move the same weights: a colocated engine gets them in memory, a rollout pool "
        "of its own by a collective broadcast (NCCL/RCCL between GPUs, gloo between CPUs; "
        "`async_training.checkpoint_engine.enable=false`: through host memory) whichever is named"),
    "actor_rollout_ref.rollout.load_format": ("the rollout engine gets the actor's weights at every "
                                              "sync here, whatever it loaded first"),
    "actor_rollout_ref.rollout.layered_summon": ("LoRA weights are merged and synced in buckets here; "
                                                 "verl's layer-by-layer gather only lowers peak memory"),
    "actor_rollout_ref.rollout.enable_prefix_caching": (
        "vLLM's prefix cache is always on here (verl's default); it reuses the KV of identical prompt "
        "prefixes, the sampled responses follow the same distribution"),
    "actor_rollout_ref.rollout.profiler": PROFILER,
    "actor_rollout_ref.rollout.multi_turn.enable": (
        "verl chooses the agent loop by each data row's `agent_name`, not by this key, which only "
        "tags the batch (no loss reads the tag); so does this trainer"),
    **{f"actor_rollout_ref.rollout.multi_turn.{name}": _UNUSED_HERE
       for name in ("use_inference_chat_template", "tokenization_sanity_check_mode", "num_repeat_rollouts")},
    "actor_rollout_ref.rollout.agent.num_workers": (
        "verl's agent-loop workers only share out the rollout's requests; which worker generates a "
        "response changes no number"),
    "actor_rollout_ref.rollout.over_sample_rate": (
        "verl declares it in its rollout config, but no code of verl reads it (checked at verl "
        "b178a3c): it changes nothing there either"),
    "actor_rollout_ref.rollout.engine_kwargs.sglang": _SGLANG_NOTE,
    "actor_rollout_ref.rollout.engine_kwargs.trtllm": (
        "TensorRT-LLM's engine arguments; only verl's TensorRT-LLM rollout reads them (the rollout here is "
        "vLLM's or HF's)"),
    "actor_rollout_ref.rollout.sglang_rollout_mode": _SGLANG_NOTE,
    "actor_rollout_ref.rollout.server": _SGLANG_NOTE,
    "actor_rollout_ref.rollout.multi_stage_wake_up": (
        "SGLang's staged wake-up after training (refused engine here); it only lowers peak memory at "
        "the switch, and no code of verl reads it (checked at verl b178a3c)"),
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
    "actor_rollout_ref.rollout.trace.backend": {"weave": "rollout tracing to Weave"},
    "actor_rollout_ref.rollout.checkpoint_engine.backend": {
        "hccl": "the HCCL checkpoint engine (Ascend NPUs)", "nixl": "the NIXL checkpoint engine",
        "mooncake": "the Mooncake checkpoint engine", "kimi": "the Kimi checkpoint engine",
        "delta": "delta weight sync"},
}

#: The fix a refusal of `UNSUPPORTED_VALUES` names, by key.
UNSUPPORTED_VALUE_FIX: dict[str, str] = {
    "actor_rollout_ref.rollout.name": "set `actor_rollout_ref.rollout.name=vllm` (verl's default engine)",
    "actor_rollout_ref.rollout.trace.backend": "set `actor_rollout_ref.rollout.trace.backend=mlflow`",
    "actor_rollout_ref.rollout.checkpoint_engine.backend": (
        "set `actor_rollout_ref.rollout.checkpoint_engine.backend=nccl` (a collective broadcast: NCCL/RCCL "
        "between GPUs, gloo between CPUs)"),
}
