"""verl's `Gsm8kTool` (`verl/tools/gsm8k_tool.py`, verl `b178a3cd`): the model submits its
answer to `calc_gsm8k_reward` and reads back the parsed answer and its reward."""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import uuid4

from trainer.agent.base import Tool, ToolResponse
from trainer.agent.tools.loading import check_config_keys, function_schema
from trainer.rewards.gsm8k import compute_score, extract_solution

__all__ = ["NOT_IMPROVED_PENALTY", "Gsm8kTool"]

NOT_IMPROVED_PENALTY = -0.05
"""The step reward of a submission whose reward is not above the previous one's
(`gsm8k_tool.py` line 94: `0.0 if reward > previous else -0.05`)."""


class Gsm8kTool(Tool):
    """Port of verl's `verl.tools.gsm8k_tool.Gsm8kTool`, the same texts and numbers:

    - `create(ground_truth=...)` or `create(create_kwargs={"ground_truth": ...})` (the loop's
      call) opens an instance with response `""` and reward 0.0 (lines 67-79);
    - `execute({"answer": a})` stores `a` as `"#### " + a` (unless it already starts with
      `#### `), scores it, answers `Current parsed answer='a' reward=R` and gives the step
      reward 0.0 when the reward went up, else -0.05 (lines 81-98);
    - `calc_reward`: verl's GSM8K score in `flexible` mode, `format_score=0.0`, `score=1.0`
      (lines 100-107), here :func:`trainer.rewards.gsm8k.compute_score`.
    """

    default_schema: ClassVar[dict[str, Any]] = function_schema(
        "calc_gsm8k_reward", "A tool for calculating the reward of gsm8k",
        {"answer": "The answer to the question"})
    """The schema in verl's `Gsm8kTool.__init__` docstring."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None = None) -> None:
        check_config_keys("`Gsm8kTool`", config, {})
        super().__init__(config, tool_schema or self.default_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else NOT_IMPROVED_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if extract_solution(state["response"], method="flexible") is None:
            # verl's `compute_score` returns the int 0 when no number is found, which its text
            # shows as `reward=0` (not `0.0`); keep that text.
            return 0
        return compute_score(state["response"], state["ground_truth"], method="flexible",
                             format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del self._instances[instance_id]
