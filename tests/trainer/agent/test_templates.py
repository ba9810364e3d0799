"""The tool agent loop's tokens against the chat template's rendering of the whole conversation
(the drift verl had: a `\\n` dropped at every assistant->tool boundary, verl#6501), on the tiny
tools tokenizer and on SmolLM2's ChatML template.

The documented difference (`trainer.agent.loops`' docstring): a trajectory ending on the model's
turn lacks the separator the template puts after the last EOS (`\\n` in both templates here); one
ending on a user turn equals the rendering with the generation prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.agent.fakes import ScriptedServer
from trainer import tiny
from trainer.agent.base import AgentContext, Interaction, Tool, ToolResponse
from trainer.agent.loops import (
    AgentLoopError,
    ChatTurns,
    ToolAgentLoop,
    system_prompt_ids,
    turn_separator_ids,
)
from trainer.config.rollout import MultiTurnConfig
from trainer.data import Example, chat_prompt_ids
from trainer.rollout.base import SamplingParams

QUESTION = [{"role": "user", "content": "what is 1 plus 2 plus 3?"}]
# Assistant turns as the model writes them: two calls at once, then one, then the answer.
TURNS = [
    'add the number <tool_call>\n{"name": "calc", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    '<tool_call>\n{"name": "echo", "arguments": {"text": "1 plus 2"}}\n</tool_call>',
    '<tool_call>\n{"name": "calc", "arguments": {"x": 3, "y": 3}}\n</tool_call>',
    "the answer is 6",
]


def schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


class Calc(Tool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        if self.name == "echo":
            return ToolResponse(text=parameters["text"]), None, {}
        return ToolResponse(text=str(parameters["x"] + parameters["y"])), None, {}


class Teacher(Interaction):
    def __init__(self, replies: list[str]) -> None:
        super().__init__({"name": "teacher"})
        self.replies = replies

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        reply = self.replies.pop(0)
        return not self.replies, reply, 0.0, {}


def token_list(encoded: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` gives a `BatchEncoding` in transformers 5, a list before."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def trajectory(tok: Any, turns: list[str], interactions: dict[str, Interaction] | None = None,
               extra: dict[str, Any] | None = None
               ) -> tuple[list[int], list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Run the tool loop; return its `prompt_ids + response_ids`, the tool schemas and the tool
    messages it added (in order)."""
    tools: dict[str, Tool] = {n: Calc({}, schema(n)) for n in ("calc", "echo")}
    mt = MultiTurnConfig(enable=True, max_assistant_turns=None, tool_config_path=None, max_user_turns=None,
                         max_parallel_calls=2, max_tool_response_length=256, tool_response_truncate_side="middle",
                         interaction_config_path=None, use_inference_chat_template=False,
                         tokenization_sanity_check_mode="strict", format="hermes", num_repeat_rollouts=None)
    server = ScriptedServer(tok, list(turns))
    loop = ToolAgentLoop(AgentContext(tokenizer=tok, server=server, response_length=1000, multi_turn=mt,
                                      tools=tools, interactions=interactions or {}))
    ex = Example(index=0, data_source="t", prompt=QUESTION, ability="", reward_model={}, extra_info=extra or {},
                 prompt_ids=chat_prompt_ids(tok, QUESTION), agent_name="tool_agent")
    data_messages: list[list[dict[str, Any]]] = []
    original = loop.turns.turn

    def spy(messages: list[dict[str, Any]]) -> list[int]:
        data_messages.append([dict(m) for m in messages])
        return original(messages)

    loop.turns.turn = spy  # type: ignore[method-assign]
    out = asyncio.run(loop.run(ex, SamplingParams(), "r"))
    assert len(server.requests) == len(turns)
    return out.prompt_ids + out.response_ids, [t.tool_schema for t in tools.values()], data_messages


def full_conversation(turns: list[str], added: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    messages = list(QUESTION)
    for i, text in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        if i < len(added):
            messages.extend(added[i])
    return messages


def assert_equal_but_final_separator(tok: Any) -> None:
    ids, schemas, added = trajectory(tok, TURNS)
    assert [[m["content"] for m in turn] for turn in added] == [["3", "1 plus 2"], ["6"]]
    full = token_list(tok.apply_chat_template(full_conversation(TURNS, added), tools=schemas, tokenize=True))
    separator = tok.encode("\n", add_special_tokens=False)
    assert ids + separator == full, (tok.decode(ids), tok.decode(full))


def assert_interaction_equals_rendering_with_generation_prompt(tok: Any) -> None:
    teacher = Teacher(["please repeat", "reply with only the number"])
    turns = ["the answer is 5", TURNS[1], "the answer is 6"]
    ids, schemas, added = trajectory(tok, turns, {"teacher": teacher}, {"interaction_kwargs": {"name": "teacher"}})
    assert [[m["role"] for m in turn] for turn in added] == [["user"], ["tool"], ["user"]]
    full = token_list(tok.apply_chat_template(full_conversation(turns, added), tools=schemas, tokenize=True,
                                              add_generation_prompt=True))
    assert ids == full, (tok.decode(ids), tok.decode(full))


# ----------------------------------------------------------------------------- tiny


def test_tiny_tools_tokenizer_keeps_the_default_ids_and_round_trips() -> None:
    default, tools = tiny.build_tokenizer(), tiny.build_tokenizer(tools=True)
    base = default.get_vocab()
    assert {k: v for k, v in tools.get_vocab().items() if k in base} == base
    assert sorted(tools.get_vocab().values())[len(base):] == list(range(len(base), len(tools)))
    for token in ("<|tool|>", "<tool_call>", "</tool_call>", "\n", "{", '"'):
        assert tools.get_vocab()[token] >= len(base)
    text = TURNS[0]
    ids = tools.encode(text, add_special_tokens=False)
    assert tools.unk_token_id not in ids and tools.decode(ids) == text
    assert tools.convert_ids_to_tokens(ids[5:7]) == [" ", "<tool_call>"]
    rendered = tools.apply_chat_template(QUESTION, tools=[schema("calc")], tokenize=False, add_generation_prompt=True)
    assert rendered == ('<|system|>\ntools:\n' + json.dumps(schema("calc")) + '\n</s>\n'
                        "<|user|>\nwhat is 1 plus 2 plus 3?</s>\n<|assistant|>\n")
    assert tools.apply_chat_template([{"role": "tool", "content": "3"}], tokenize=False) == "<|tool|>\n3</s>\n"


def test_tiny_system_prompt_and_separator() -> None:
    tok = tiny.build_tokenizer(tools=True)
    assert system_prompt_ids(tok, {}) == []
    assert turn_separator_ids(tok, {}) == tok.encode("\n", add_special_tokens=False)
    # The default tiny template separates turns with a space, which its tokenizer drops.
    assert turn_separator_ids(tiny.build_tokenizer(), {}) == []


def test_tiny_trajectory_equals_the_full_rendering_but_the_final_separator() -> None:
    assert_equal_but_final_separator(tiny.build_tokenizer(tools=True))


def test_tiny_interaction_trajectory_equals_the_rendering_with_generation_prompt() -> None:
    assert_interaction_equals_rendering_with_generation_prompt(tiny.build_tokenizer(tools=True))


def test_without_the_separator_each_boundary_loses_one_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl b178a3cd's tokens (no separator, verl#6501): one `\\n` short of the full rendering at
    every assistant->tool boundary (here two), which is what the separator restores."""
    from trainer.agent import loops

    monkeypatch.setattr(loops, "turn_separator_ids", lambda tokenizer, kwargs: [])
    tok = tiny.build_tokenizer(tools=True)
    ids, schemas, added = trajectory(tok, TURNS)
    full = token_list(tok.apply_chat_template(full_conversation(TURNS, added), tools=list(schemas),
                                              tokenize=True))
    newline, eos = tok.encode("\n", add_special_tokens=False), tok.eos_token_id
    dropped, i = [], 0  # positions of `full` missing from `ids`, aligned greedily
    for j, token in enumerate(full):
        if i < len(ids) and ids[i] == token:
            i += 1
        else:
            dropped.append(j)
    assert i == len(ids)
    # The `\n` after the EOS of each of the two assistant turns followed by tools, and the final one.
    assert [full[j - 1:j + 2] for j in dropped] == [[eos, *newline, tok.convert_tokens_to_ids("<|tool|>")]] * 2 \
        + [[eos, *newline]]
    assert dropped[-1] == len(full) - 1


def tiny_with_template(template: str) -> Any:
    tok = tiny.build_tokenizer(tools=True)
    tok.chat_template = template
    return tok


TURNS_JINJA = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def test_template_kwargs_reach_the_system_prompt_and_the_turns() -> None:
    """`data.apply_chat_template_kwargs` render the system prompt too (verl v0.9.0), so a default
    system prompt that depends on them is still cut from the tool turns."""
    tok = tiny_with_template("{% if greeting is defined %}{{ '<|system|>\\n' + greeting + '</s>\\n' }}{% endif %}"
                             + TURNS_JINJA)
    turns = ChatTurns(tok, {"greeting": "say"})
    assert turns.system_prompt == tok.encode("<|system|>\nsay</s>\n", add_special_tokens=False)
    assert tok.decode(turns.turn([{"role": "tool", "content": "3"}])) == "\n<|tool|>\n3</s>\n<|assistant|>\n"
    assert tok.decode(turns.prompt(QUESTION, [])).startswith("<|system|>\nsay</s>\n<|user|>")


def test_a_turn_not_rendered_after_the_system_prompt_is_refused() -> None:
    """verl cuts `len(system_prompt)` tokens blindly; a template whose default system prompt depends
    on the first message would lose the turn's own tokens, so it is refused."""
    tok = tiny_with_template("{{ '<|system|>\\n' + ('copy' if messages[0]['role'] == 'user' else 'say') + '</s>\\n' }}"
                             + TURNS_JINJA)
    turns = ChatTurns(tok, {})
    with pytest.raises(AgentLoopError, match=r"renders the tool turn .* not after the default system prompt .*"
                                             r"custom_chat_template"):
        turns.turn([{"role": "tool", "content": "3"}])


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_system_prompt_and_separator(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert system_prompt_ids(tok, {}) == tok.encode(system, add_special_tokens=False)
    assert turn_separator_ids(tok, {}) == tok.encode("\n", add_special_tokens=False)
    assert tok.eos_token == "<|im_end|>"


def test_smollm2_trajectory_equals_the_full_rendering_but_the_final_separator(smollm2_tokenizer: Any) -> None:
    assert_equal_but_final_separator(smollm2_tokenizer)


def test_smollm2_interaction_trajectory_equals_the_rendering_with_generation_prompt(smollm2_tokenizer: Any) -> None:
    assert_interaction_equals_rendering_with_generation_prompt(smollm2_tokenizer)
