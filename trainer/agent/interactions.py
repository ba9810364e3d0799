"""verl's interaction config file (`multi_turn.interaction_config_path`) and the interactions
shipped here. The file is verl's, unchanged
(`examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml`)::

    interaction:
      - name: gsm8k                                                  # optional
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

`class_name` follows the tools' rules (:func:`trainer.agent.tools.loading.resolve_class`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from trainer.agent.base import Interaction
from trainer.agent.tools.loading import AgentConfigError, read_entries, resolve_class
from trainer.rewards.gsm8k import compute_score

__all__ = ["CORRECT", "GSM8K_INTERACTION_CONFIG", "INCORRECT", "PORTED_INTERACTIONS", "Gsm8kInteraction",
           "load_interactions", "with_gsm8k_interaction"]

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."
"""verl's replies (`verl/interactions/gsm8k_interaction.py` lines 69 and 72)."""


class Gsm8kInteraction(Interaction):
    """Port of verl's `verl.interactions.gsm8k_interaction.Gsm8kInteraction`: the user checks the
    last assistant message with verl's GSM8K score in `strict` mode (`#### <answer>`,
    `format_score=0.0`, `score=1.0`, lines 77-84); a score of 1.0 ends the trajectory with
    "Your response is correct!", anything else asks to try again (lines 55-75). The turn score
    is that score. `start_interaction` takes the row's `interaction_kwargs` (`ground_truth`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        content = ""
        for item in reversed(messages):
            if item.get("role") == "assistant":
                # verl takes `item.get("content")` as is and fails on None later; "" scores 0
                content = item.get("content") or ""
                break
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return compute_score(state["response"], state["ground_truth"], method="strict",
                             format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        del self._instances[instance_id]


PORTED_INTERACTIONS: dict[str, type[Interaction]] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction}
"""verl's interaction classes by verl's `class_name`, and their ports here."""


def _name(entry: Mapping[str, Any]) -> str:
    """verl's rule (`interaction_registry.py`): `name`, else the class name without its
    `Interaction` suffix, lower-cased."""
    if entry.get("name") is not None:
        return str(entry["name"])
    simple = entry["class_name"].rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interactions(path: str | Path) -> dict[str, Interaction]:
    """The interactions of verl's interaction config file `path`, by name (verl's
    `initialize_interactions_from_config`); each gets its name in `config["name"]`."""
    out: dict[str, Interaction] = {}
    for i, entry in enumerate(read_entries(path, "interaction")):
        where = f"`{path}` interaction[{i}] (`{entry['class_name']}`)"
        known = {"name", "class_name", "config"}
        if set(entry) - known:
            raise AgentConfigError(f"{where}: unknown key(s) {sorted(set(entry) - known)}; an "
                                   f"entry has {sorted(known)}")
        cls = resolve_class(entry["class_name"], PORTED_INTERACTIONS, Interaction, where)
        config = entry.get("config")
        config = {} if config is None else config
        if not isinstance(config, Mapping):
            raise AgentConfigError(f"{where}: `config` is a {type(config).__name__}, not a mapping")
        name = _name(entry)
        if name in out:
            raise AgentConfigError(f"{where}: interaction name `{name}` is used twice; give each "
                                   f"entry its own `name` (rows pick one by "
                                   f"`interaction_kwargs.name`)")
        out[name] = cls(config={**config, "name": name})
    return out


def with_gsm8k_interaction(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` (verl's format) made for verl's tool agent loop with its gsm8k interaction, as
    verl's `examples/data_preprocess/gsm8k_multiturn_w_interaction.py` writes them:
    `agent_name=tool_agent` and `extra_info.interaction_kwargs` (`name`, the question, the ground
    truth), so a user answers each model turn until the answer is right."""
    return [{**r, "agent_name": "tool_agent", "extra_info": {
        **dict(r.get("extra_info") or {}), "index": i,
        "interaction_kwargs": {"name": "gsm8k", "query": r["prompt"][-1]["content"],
                               "ground_truth": str(r["reward_model"]["ground_truth"])}}}
            for i, r in enumerate(rows)]


#: An interaction config file (`multi_turn.interaction_config_path`) with verl's gsm8k interaction.
GSM8K_INTERACTION_CONFIG = {"interaction": [{
    "name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {}}]}
