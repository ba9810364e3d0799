"""`reward_model.*` and `custom_reward_function.*`: how responses are scored (rule rewards, and a
discriminative reward model; verl's `reward_model` and `custom_reward_function` sections, and
verl 0.9.1's `reward.*`, read as them). Defaults: `trainer/config/reward.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import ConfigError, h, require


@dataclass(frozen=True)
class CustomRewardConfig:
    path: str | None = h("Python file holding a reward function; null = built-in scorers")
    name: str = h("name of the function in that file")
    reward_kwargs: dict[str, Any] = h(
        "keywords added to every call of that function (`custom_reward_function.reward_kwargs.x=1`)")


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = h("dapo: penalise responses that run into the last `len` tokens of the limit")
    len: int = h("dapo: tokens before `data.max_response_length` where the penalty starts")
    penalty_factor: float = h("dapo: penalty at the limit (rising linearly over the buffer)")
    log: bool = h("dapo: report the penalty and whether the response was overlong as metrics")


@dataclass(frozen=True)
class RewardModelModelConfig:
    path: str | None = h(
        "local directory of an `AutoModelForSequenceClassification` reward model (verl 0.9.1: "
        "`reward.reward_model.model_path`); with `reward_model.enable=true` and no "
        "`custom_reward_function.path` its score is the reward (verl's reward loop `compute_score_disrm`)")
    use_remove_padding: bool = h("verl's padding-free forward of the reward model (compatibility only, see COMPAT)")
    fsdp_config: dict[str, Any] = h("verl's FSDP settings of the reward model worker (compatibility only, see COMPAT)")


@dataclass(frozen=True)
class SandboxFusionConfig:
    url: str | None = h(
        "a SandboxFusion service's `run_code` URL: the built-in scorer of the code data sources "
        "(`codecontests`, `apps`, `codeforces`, `taco`) runs each response's code on the row's test "
        "cases there, as verl does (`trainer/rewards/sandbox_fusion.py`); null = no sandbox")
    max_concurrent: int | None = h("requests to the service in flight at once, over the whole scoring "
                                   "(null: verl's 64)")
    memory_limit_mb: int | None = h("memory limit of each run, in MB, sent to the service (null: verl's 1024)")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = h(
        "a discriminative reward model (`reward_model.model.path`) scores each response; verl's reward "
        "loop uses it only where `custom_reward_function.path` is null, and then instead of the rule reward")
    model: RewardModelModelConfig = h("the reward model's weights")
    rollout: dict[str, Any] = h(
        "verl's serving settings of the reward model (vLLM engine, memory, TP, lengths; compatibility "
        "only, see COMPAT)")
    num_workers: int | None = h("verl's reward-loop workers (compatibility only, see COMPAT)")
    micro_batch_size_per_gpu: int | None = h(
        "rows of one reward model forward, as verl's reward model micro-batch (null: any, up to 16384 "
        "padded tokens a forward); changes no score beyond rounding")
    use_reward_loop: bool = h(
        "false: score as verl's legacy reward model worker (`RewardModelWorker`) does: the rendered "
        "chat tokenized as its template writes it (no special tokens added), cut to "
        "`reward_model.max_length` tokens, in bf16; true: as verl's reward loop")
    max_length: int | None = h(
        "with `reward_model.use_reward_loop=false`: the reward model's input is cut to this many "
        "tokens, keeping the head (null: `data.max_prompt_length + data.max_response_length`, the width of "
        "verl's padded batch, its legacy default)")
    reward_manager: Literal["naive", "dapo", "batch", "prime"] = h(
        "how the reward function is called: `naive` once per response, `batch` once per step with "
        "lists (`data_sources`, `solution_strs`, `ground_truths`, `extra_infos`), `dapo` per response "
        "plus the overlong penalty, `prime` per response in up to 64 processes under one 300 s "
        "deadline (a failure or a timeout scores 0)")
    launch_reward_fn_async: bool = h("score the responses in a thread while the log-probs are computed")
    overlong_buffer: OverlongBufferConfig = h("DAPO's soft overlong punishment")
    reward_kwargs: dict[str, Any] = h(
        "keywords of the reward manager (verl's): `batch` passes them to the reward function; `dapo` "
        "takes `overlong_buffer_cfg.{enable,len,penalty_factor,log}` (verl's current spelling of "
        "`overlong_buffer`, set into it) and `max_resp_len` (the length the penalty counts to; "
        "default `data.max_response_length`); `naive` takes none")
    sandbox_fusion: SandboxFusionConfig = h(
        "verl's SandboxFusion service for code rewards (verl 0.9.1: `reward.sandbox_fusion.*`, and its "
        "older top-level `sandbox_fusion.*`)")


RM_TOKENS_PER_FORWARD = 16384
"""Padded tokens in one forward of a discriminative reward model (one micro-batch's activations;
`trainer.rewards.model`, and the memory plan's `reward model forward`)."""

REWARD_MODEL_WORKER = ("this setting belongs to the reward model worker of verl, not built here; the reward "
                       "model (`reward_model.enable`, `reward_model.model.path`) runs in the trainer's process")

_OWN_POOL = ("a reward model on a resource pool of its own (the reward model is placed with the trainer "
             "here, scoring between rollout and training, as verl's colocated mode)")
#: verl's reward keys this trainer does not implement (any other unknown `reward_model.*` key
#: belongs to the reward model worker: `REWARD_MODEL_WORKER`).
NOT_SUPPORTED: dict[str, str] = {
    f"{section}.{key}": _OWN_POOL for section in ("reward_model", "reward.reward_model")
    for key in ("enable_resource_pool", "nnodes", "n_gpus_per_node")}

_SERVING = ("a discriminative reward model is served here by an HF forward on the actor's ranks, in "
            "`dtype`, which the other vLLM settings do not shape; a generative one's vLLM server takes "
            "`gpu_memory_utilization`, "
            "`tensor_model_parallel_size` and `prompt_length + response_length` as its context, and no "
            "setting changes the score it returns")
#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "reward_model.rollout": _SERVING,
    "reward_model.num_workers": "verl's reward-loop workers only share out the scoring",
    "reward_model.model.use_remove_padding": "the responses are scored in left-padded micro-batches with "
                                             "their padding masked: a row's score is its unpadded "
                                             "forward's up to rounding",
    "reward_model.model.fsdp_config": "the reward model is not sharded here; it is offloaded to the CPU "
                                      "between scorings",
}

#: Newer verl spellings read as this trainer's key: verl 0.9.1's `reward.*` section (its
#: `migrate_legacy_reward_impl` reads the older keys into it).
ALIASES: dict[str, str] = {
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.num_workers": "reward_model.num_workers",
    **{f"{section}.{key}": f"reward_model.sandbox_fusion.{key}" for section in ("reward.sandbox_fusion", "sandbox_fusion")
       for key in ("url", "max_concurrent", "memory_limit_mb")},
    **{f"reward.reward_model.rollout.{key}": f"reward_model.rollout.{key}" for key in (
        "name", "dtype", "gpu_memory_utilization", "tensor_model_parallel_size", "prompt_length",
        "response_length")},
}

#: What each reward manager accepts in `reward_model.reward_kwargs` (verl passes them to the
#: manager's constructor: `batch` forwards any to the reward function, `naive` takes none).
MANAGER_KWARGS: dict[str, tuple[str, ...] | None] = {
    "naive": (), "dapo": ("overlong_buffer_cfg", "max_resp_len"), "batch": None, "prime": ()}
OVERLONG_FIELDS = ("enable", "len", "penalty_factor", "log")


def derive_overlong(reward_model: dict[str, Any]) -> None:
    """`dapo`: verl's current `reward_model.reward_kwargs.overlong_buffer_cfg.*` set into
    `reward_model.overlong_buffer` (the same four keys, which they replace), in the raw tree."""
    kwargs = reward_model["reward_kwargs"]
    if reward_model["reward_manager"] != "dapo" or "overlong_buffer_cfg" not in kwargs:
        return
    given = kwargs.pop("overlong_buffer_cfg")
    if not isinstance(given, dict):
        raise ConfigError(
            f"`reward_model.reward_kwargs.overlong_buffer_cfg={given!r}` must be a mapping of "
            f"{', '.join(f'`{k}`' for k in OVERLONG_FIELDS)}")
    unknown = sorted(set(given) - set(OVERLONG_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'`reward_model.reward_kwargs.overlong_buffer_cfg.{k}`' for k in unknown)}; "
            f"valid: {', '.join(f'`{k}`' for k in OVERLONG_FIELDS)}")
    reward_model["overlong_buffer"] = {**reward_model["overlong_buffer"], **given}


def validate_reward_kwargs(rm: RewardModelConfig, max_response_length: int) -> int:
    """Refuse `reward_model.reward_kwargs` the manager would not take (verl passes them to its
    constructor); return the length the overlong penalty counts to."""
    allowed = MANAGER_KWARGS[rm.reward_manager]
    unknown = [] if allowed is None else sorted(set(rm.reward_kwargs) - set(allowed))
    require(not unknown, (
        f"`reward_model.reward_kwargs` has {', '.join(f'`{k}`' for k in unknown)}, which the "
        f"`{rm.reward_manager}` reward manager does not take (verl passes these keywords to the "
        "manager): " + ("it takes " + ", ".join(f"`{k}`" for k in allowed) if allowed else "it takes none")
        + ". Fix: remove them, pass keywords to your function with "
        "`custom_reward_function.reward_kwargs.<name>=...`, or use `reward_model.reward_manager=batch`"))
    max_len = rm.reward_kwargs.get("max_resp_len", max_response_length)
    require(isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 1,
            f"`reward_model.reward_kwargs.max_resp_len={max_len!r}` must be a whole number of tokens >= 1")
    return int(max_len)


def validate_sandbox_fusion(rm: RewardModelConfig, custom: CustomRewardConfig) -> None:
    """`reward_model.sandbox_fusion.*`: verl hands the service to its built-in scorer only."""
    sf = rm.sandbox_fusion
    for key in ("max_concurrent", "memory_limit_mb"):
        value = getattr(sf, key)
        require(value is None or value >= 1, f"`reward_model.sandbox_fusion.{key}={value}` must be 1 or more")
    if sf.url is None:
        return
    require(sf.url.startswith(("http://", "https://")), (
        f"`reward_model.sandbox_fusion.url={sf.url}` must be the SandboxFusion service's `run_code` URL "
        "(`http://HOST:PORT/run_code`)"))
    require(custom.path is None and not rm.enable, (
        f"`reward_model.sandbox_fusion.url={sf.url}` with "
        + ("`custom_reward_function.path`" if custom.path is not None else "`reward_model.enable=true`")
        + ": verl gives the sandbox to its built-in scorer only, which a reward function or a reward model "
        "replaces. Fix: remove the URL, or pass it to your function with "
        "`custom_reward_function.reward_kwargs.sandbox_fusion_url=...`"))


def validate_reward_model(rm: RewardModelConfig, custom: CustomRewardConfig) -> None:
    """`reward_model.enable=true` asks for what verl 0.9.1's reward loop does with it
    (`RewardLoopWorker.compute_score`): without `custom_reward_function.path`, the discriminative
    model of `reward_model.model.path` scores every response; with one, the function is called
    with the address of a server of that model (a generative reward model)."""
    require(rm.max_length is None or (not rm.use_reward_loop and rm.max_length >= 1), (
        f"`reward_model.max_length={rm.max_length}`: it cuts the input of verl's legacy reward model "
        "worker and must be a whole number of tokens >= 1; the reward loop (`reward_model.use_reward_loop=true`, "
        "the default) reads it not. Fix: set `reward_model.use_reward_loop=false` with it, or remove it"))
    if not rm.enable:
        return
    require(rm.model.path is not None, (
        "`reward_model.enable=true` needs the reward model, and `reward_model.model.path` is null. Fix: "
        "set `reward_model.model.path=<dir>` (verl 0.9.1: `reward.reward_model.model_path`): a local "
        "`AutoModelForSequenceClassification` directory, or with `custom_reward_function.path` the "
        "generative model its server serves"))
    require(custom.path is not None or not rm.launch_reward_fn_async, (
        "`reward_model.launch_reward_fn_async=true` with a discriminative reward model: the model "
        "scores on the actor's ranks, which compute the log-probs meanwhile (verl scores with its "
        "reward model before launching the reward function). Fix: set "
        "`reward_model.launch_reward_fn_async=false`"))
    require(rm.use_reward_loop or custom.path is None, (
        "`reward_model.use_reward_loop=false` with `custom_reward_function.path`: verl's legacy reward "
        "model worker scores with the discriminative model only, and its score replaces the reward "
        "function's (a generative reward model needs the reward loop). Fix: remove "
        "`reward_model.use_reward_loop=false`, or `custom_reward_function.path` to score with the model"))
    engine = rm.rollout.get("name")
    require(custom.path is None or engine in (None, "vllm"), (
        f"`reward_model.rollout.name={engine}`: a generative reward model is served here by vLLM's "
        "OpenAI-compatible server only. Fix: set `reward_model.rollout.name=vllm`"))
