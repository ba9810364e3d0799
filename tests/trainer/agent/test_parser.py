"""verl's hermes tool-call parser: calls found, malformed ones skipped and counted, formats by name."""

from __future__ import annotations

import json

import pytest

from trainer import tiny
from trainer.agent.parser import (
    FunctionCall,
    HermesToolParser,
    ToolParserError,
    get_tool_parser,
    parser_formats,
)


class CharTokenizer:
    """One token per character, so any text round-trips (the parser's only use of a tokenizer
    is `decode`)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def parse(text: str):  # noqa: ANN201
    return HermesToolParser(CharTokenizer()).parse(ids(text))


def test_text_without_markers_is_content_only() -> None:
    out = parse("the answer is 7")
    assert (out.content, out.calls, out.malformed) == ("the answer is 7", [], 0)


def test_one_call_is_parsed_and_cut_from_the_content() -> None:
    out = parse('let me add <tool_call>\n{"name": "calc", "arguments": {"x": 1,"y":2}}\n</tool_call> ok')
    assert out.calls == [FunctionCall(name="calc", arguments='{"x": 1, "y": 2}')]
    assert out.content == "let me add  ok"
    assert out.malformed == 0


def test_arguments_are_reserialised_as_verl_does() -> None:
    """`json.dumps(arguments, ensure_ascii=False)`: non-ASCII kept, a string argument stays a
    JSON string (verl hands its decoded value to the tool)."""
    out = parse('<tool_call>{"name": "echo", "arguments": {"text": "café"}}</tool_call>'
                '<tool_call>{"name": "echo", "arguments": "raw"}</tool_call>')
    assert [c.arguments for c in out.calls] == ['{"text": "café"}', '"raw"']
    assert json.loads(out.calls[1].arguments) == "raw"


@pytest.mark.parametrize("block", [
    '{"name": "calc", "arguments": {"x": 1}',      # bad JSON
    '{"name": "calc"}',                             # no arguments
    '{"arguments": {}}',                            # no name
    '{"name": 3, "arguments": {}}',                 # a name that is not a string
    '["calc", {}]',                                 # not an object
])
def test_malformed_blocks_are_skipped_and_counted(block: str) -> None:
    good = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    out = parse(f"{good} <tool_call>{block}</tool_call> {good}")
    assert out.calls == [FunctionCall("calc", "{}"), FunctionCall("calc", "{}")]
    assert out.malformed == 1
    assert out.content == "  "


def test_nothing_is_parsed_without_both_markers() -> None:
    """verl returns the text unparsed unless both markers are present (an unclosed call is no call,
    and not counted as malformed)."""
    text = '<tool_call>{"name": "calc", "arguments": {}}'
    out = parse(text)
    assert (out.content, out.calls, out.malformed) == (text, [], 0)


def test_calls_span_lines_and_match_non_greedily() -> None:
    out = parse('<tool_call>\n{"name": "a",\n "arguments": {}}\n</tool_call>\n'
                '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in out.calls] == ["a", "b"]
    assert out.content == "\n"


def test_tiny_tools_tokenizer_decodes_calls_back() -> None:
    tok = tiny.build_tokenizer(tools=True)
    text = 'add the <tool_call>\n{"name": "calc", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    parser = get_tool_parser("hermes", tok)
    out = parser.parse(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
    assert out.calls == [FunctionCall("calc", '{"x": 1, "y": 2}')]
    assert out.content == "add the </s>"  # verl decodes with special tokens kept


def test_unknown_format_names_the_known_ones() -> None:
    assert parser_formats() == ["hermes"]
    with pytest.raises(ToolParserError, match=r"format=pythonic` names no tool-call format.*\['hermes'\]"):
        get_tool_parser("pythonic", CharTokenizer())


def test_gpt_oss_is_refused_by_name_with_the_fix() -> None:
    with pytest.raises(ToolParserError, match=r"format=gpt-oss`: verl's `gpt-oss` tool format .* not built.*"
                                              r"multi_turn.format=hermes"):
        get_tool_parser("gpt-oss", CharTokenizer())
