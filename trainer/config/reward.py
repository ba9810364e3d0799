"""`reward_model.*` and `custom_reward_function.*`: how responses are scored (rule-based; verl's
`reward_model` and `custom_reward_function` sections). Defaults: `trainer/config/reward.yaml`."""

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
class RewardModelConfig:
    enable: bool = h("a model-based reward model; must be false (rule-based rewards only)")
    reward_manager: Literal["naive", "dapo", "batch"] = h(
        "how the reward function is called: `naive` once per response, `batch` once per step with "
        "lists (`data_sources`, `solution_strs`, `ground_truths`, `extra_infos`), `dapo` per response "
        "plus the overlong penalty")
    launch_reward_fn_async: bool = h("score the responses in a thread while the log-probs are computed")
    overlong_buffer: OverlongBufferConfig = h("DAPO's soft overlong punishment")
    reward_kwargs: dict[str, Any] = h(
        "keywords of the reward manager (verl's): `batch` passes them to the reward function; `dapo` "
        "takes `overlong_buffer_cfg.{enable,len,penalty_factor,log}` (verl's current spelling of "
        "`overlong_buffer`, set into it) and `max_resp_len` (the length the penalty counts to; "
        "default `data.max_response_length`); `naive` takes none")


REWARD_MODEL_WORKER = ("model-based reward models (the reward model worker) are not supported; "
                       "rule-based rewards via `data_source` and `custom_reward_function` are")

#: verl's reward keys this trainer does not implement (any other unknown `reward_model.*` key
#: belongs to the reward model worker: `REWARD_MODEL_WORKER`).
NOT_SUPPORTED: dict[str, str] = {}

#: Newer verl spellings read as this trainer's key: verl 0.9.1's `reward.*` section (its
#: `migrate_legacy_reward_impl` reads the older keys into it).
ALIASES: dict[str, str] = {
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
}

#: What each reward manager accepts in `reward_model.reward_kwargs` (verl passes them to the
#: manager's constructor: `batch` forwards any to the reward function, `naive` takes none).
MANAGER_KWARGS: dict[str, tuple[str, ...] | None] = {
    "naive": (), "dapo": ("overlong_buffer_cfg", "max_resp_len"), "batch": None}
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
