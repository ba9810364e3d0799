"""`reward_model.*` and `custom_reward_function.*`: how responses are scored (rule-based; verl's
`reward_model` and `custom_reward_function` sections). Defaults: `trainer/config/reward.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.base import h


@dataclass(frozen=True)
class CustomRewardConfig:
    path: str | None = h("Python file holding a reward function; null = built-in scorers")
    name: str = h("name of the function in that file")


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


REWARD_MODEL_WORKER = ("model-based reward models (the reward model worker) are not supported; "
                       "rule-based rewards via `data_source` and `custom_reward_function` are")

#: verl's reward keys this trainer does not implement (any other unknown `reward_model.*` key
#: belongs to the reward model worker: `REWARD_MODEL_WORKER`).
NOT_SUPPORTED: dict[str, str] = {
    "custom_reward_function.reward_kwargs": "",
}
