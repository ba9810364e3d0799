"""verl's interaction config file read by `load_interactions` (names, class-name rules) and the
port of verl's `Gsm8kInteraction` (`verl/interactions/gsm8k_interaction.py`): the same replies,
scores and stops."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer.agent.base import Interaction
from trainer.agent.interactions import (
    CORRECT,
    INCORRECT,
    PORTED_INTERACTIONS,
    Gsm8kInteraction,
    load_interactions,
)
from trainer.agent.tools import AgentConfigError

# verl's `examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml`
# (verl b178a3cd), byte for byte (it has no final newline).
VERL_GSM8K_INTERACTION_CONFIG = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}"""


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def write(tmp_path: Path, entries: list[dict[str, Any]] | str) -> Path:
    path = tmp_path / "interaction.yaml"
    path.write_text(entries if isinstance(entries, str) else yaml.safe_dump({"interaction": entries}))
    return path


class EchoInteraction(Interaction):
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        return True, str(messages[-1]["content"]), 0.5, {}


def test_verls_gsm8k_interaction_config_loads_unchanged(tmp_path: Path) -> None:
    interactions = load_interactions(write(tmp_path, VERL_GSM8K_INTERACTION_CONFIG))
    assert list(interactions) == ["gsm8k"]
    (it,) = interactions.values()
    assert isinstance(it, Gsm8kInteraction) and it.name == "gsm8k" and it.config == {"name": "gsm8k"}


def test_gsm8k_interaction_replies_and_scores_are_verls() -> None:
    async def go() -> list[tuple[bool, str, float, dict[str, Any]]]:
        it = Gsm8kInteraction({"name": "gsm8k"})
        # the loop passes the row's interaction_kwargs: name, query, ground_truth
        iid = await it.start_interaction("req-1", name="gsm8k", query="q", ground_truth="72")
        assert iid == "req-1"
        out = []
        for reply in ("It is 72", "#### 71", "#### 7,2", "#### 72"):
            messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "older turns are not read"}]
            out.append(await it.generate_response(iid, messages))
        assert await it.calculate_score(iid) == 1.0
        await it.finalize_interaction(iid)
        with pytest.raises(KeyError):
            await it.calculate_score(iid)
        return out

    assert run(go()) == [
        (False, INCORRECT, 0.0, {}),  # strict: no `#### `, no answer: 0
        (False, INCORRECT, 0.0, {}),  # wrong answer: format score 0.0
        (True, CORRECT, 1.0, {}),     # commas are dropped in strict mode
        (True, CORRECT, 1.0, {}),
    ]
    assert CORRECT == "Your response is correct!"
    assert INCORRECT == "Your response is incorrect! You need to reflect on your answer and try again."


def test_gsm8k_interaction_reads_the_last_assistant_message() -> None:
    async def go() -> tuple[bool, float]:
        it = Gsm8kInteraction({})
        iid = await it.start_interaction(ground_truth="3")
        messages = [{"role": "assistant", "content": "#### 3"}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "#### 4"}]
        stop, _, score, _ = await it.generate_response(iid, messages)
        none_stop, _, none_score, _ = await it.generate_response(iid, [{"role": "assistant", "content": None}])
        assert (none_stop, none_score) == (False, 0)
        assert len(iid) == 36  # verl's str(uuid4())
        return stop, score

    assert run(go()) == (False, 0.0)


def test_names_follow_verls_rule(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {"k": 1}},
        {"class_name": f"{__name__}.EchoInteraction", "config": {}},
        {"name": "mine", "class_name": f"{__name__}.EchoInteraction"},
    ])
    interactions = load_interactions(path)
    assert list(interactions) == ["gsm8k", "echo", "mine"]  # `Interaction` suffix dropped, lower-cased
    assert interactions["gsm8k"].config == {"k": 1, "name": "gsm8k"}
    assert type(interactions["echo"]) is EchoInteraction and interactions["mine"].name == "mine"
    assert run(interactions["mine"].generate_response("i", [{"content": "hi"}])) == (True, "hi", 0.5, {})


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, [{"class_name": f"{__name__}.EchoInteraction", "config": {}},
                            {"name": "echo", "class_name": f"{__name__}.EchoInteraction", "config": {}}])
    with pytest.raises(AgentConfigError, match=r"interaction\[1\].*name `echo` is used twice"):
        load_interactions(path)


def test_another_verl_interaction_is_refused_by_name(tmp_path: Path) -> None:
    path = write(tmp_path, [{"name": "weather", "config": {},
                             "class_name": "verl.interactions.weather_interaction.WeatherInteraction"}])
    with pytest.raises(AgentConfigError) as err:
        load_interactions(path)
    msg = str(err.value)
    assert "`verl.interactions.weather_interaction.WeatherInteraction` has no port here" in msg
    assert "`verl.interactions.gsm8k_interaction.Gsm8kInteraction`" in msg
    assert "subclass of `trainer.agent.base.Interaction`" in msg and str(path) in msg


@pytest.mark.parametrize(("entries", "problem"), [
    ([{"class_name": "trainer.agent.tools.calculator.CalculatorTool", "config": {}}],
     r"not a subclass of `trainer.agent.base.Interaction`"),
    ([{"class_name": f"{__name__}.EchoInteraction", "config": [1]}], r"`config` is a list"),
    ([{"class_name": f"{__name__}.EchoInteraction", "nam": "x"}], r"unknown key\(s\) \['nam'\]"),
    ("interactions:\n  - class_name: a.B\n", r"no `interaction:` list"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, entries: Any, problem: str) -> None:
    path = write(tmp_path, entries)
    with pytest.raises(AgentConfigError, match=problem) as err:
        load_interactions(path)
    assert str(path) in str(err.value)


def test_ported_names_are_verls() -> None:
    assert PORTED_INTERACTIONS == {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction}
