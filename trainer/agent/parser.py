"""Tool calls in the model's text, by verl's `multi_turn.format` names
(`verl/experimental/agent_loop/tool_parser.py`, verl b178a3cd).

A parser is a pure function from a turn's token ids to :class:`ParsedResponse`: the text left
once the calls are cut out, the calls (:class:`FunctionCall`, arguments as a JSON string), and
how many call blocks could not be decoded. verl only logs those (`logger.error("Failed to decode
tool call")`); here they are counted too, so the rollout can report a malformed-call rate.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["FunctionCall", "HermesToolParser", "ParsedResponse", "ToolParser", "ToolParserError",
           "get_tool_parser", "parser_formats"]

logger = logging.getLogger(__name__)


class ToolParserError(ValueError):
    """`multi_turn.format` names no parser built here; the message lists the known ones."""


@dataclass(frozen=True)
class FunctionCall:
    """One call the model asked for (verl's `FunctionCall`)."""

    name: str
    arguments: str
    """The arguments as JSON text (what the model wrote, re-serialised: `json.dumps(..., ensure_ascii=False)`)."""


@dataclass(frozen=True)
class ParsedResponse:
    """What one assistant turn says."""

    content: str
    """The decoded turn with the call blocks removed."""
    calls: list[FunctionCall]
    """The well-formed calls, in order."""
    malformed: int = 0
    """Call blocks that were found but could not be decoded (skipped, as verl skips them)."""


class ToolParser(ABC):
    """verl's `ToolParser`: registered by format name, built with the actor's tokenizer."""

    registry: ClassVar[dict[str, type[ToolParser]]] = {}

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def register(cls, name: str) -> Any:
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls.registry[name] = subclass
            return subclass
        return decorator

    @abstractmethod
    def parse(self, response_ids: list[int]) -> ParsedResponse:
        """The content and calls of one turn's tokens."""


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """verl's `HermesToolParser` (`tool_parser.py:75-106`, itself from vLLM 0.9.1's hermes parser):
    decode the turn (special tokens kept), take every `<tool_call>...</tool_call>` (non-greedy,
    across lines), JSON-decode each into `{"name": str, "arguments": ...}`; a block that fails
    (bad JSON, no `name`/`arguments`, a name that is not a string) is skipped. Nothing is parsed
    unless both markers are in the text. The content is the text with the blocks removed."""

    START, END = "<tool_call>", "</tool_call>"
    PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, response_ids: list[int]) -> ParsedResponse:
        text = self.tokenizer.decode(response_ids)
        if self.START not in text or self.END not in text:
            return ParsedResponse(text, [])
        calls: list[FunctionCall] = []
        malformed = 0
        for match in self.PATTERN.findall(text):
            call = _decode_call(match)
            if call is None:
                malformed += 1
            else:
                calls.append(call)
        return ParsedResponse(self.PATTERN.sub("", text), calls, malformed)


def _decode_call(block: str) -> FunctionCall | None:
    """One hermes block, or None where verl's `try` fails (verl's pydantic `FunctionCall` refuses
    a non-string `name`)."""
    try:
        decoded = json.loads(block)
        name, arguments = decoded["name"], decoded["arguments"]
        if not isinstance(name, str):
            raise TypeError(f"the name is {type(name).__name__}, not a string")
        return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
    except Exception as exc:  # verl catches everything here
        logger.warning("Failed to decode tool call: %s", exc)
        return None


# verl also registers `gpt-oss` (`tool_parser.py:109-161`), whose tool turns the loop formats by
# hand (`build_gpt_oss_tool_response_text`); not built here.
_REFUSED = {
    "gpt-oss": ("verl's `gpt-oss` tool format (harmony channels and hand-formatted tool turns) is not "
                "built here; use a model whose chat template speaks hermes `<tool_call>` JSON "
                "(Qwen2.5/Qwen3, SmolLM, ...) with `actor_rollout_ref.rollout.multi_turn.format=hermes`"),
}


def parser_formats() -> list[str]:
    """The `multi_turn.format` values built here."""
    return sorted(ToolParser.registry)


def get_tool_parser(name: str, tokenizer: Any) -> ToolParser:
    """The parser of `multi_turn.format=name` (verl's `ToolParser.get_tool_parser`)."""
    if name in _REFUSED:
        raise ToolParserError(f"`actor_rollout_ref.rollout.multi_turn.format={name}`: {_REFUSED[name]}")
    if name not in ToolParser.registry:
        raise ToolParserError(
            f"`actor_rollout_ref.rollout.multi_turn.format={name}` names no tool-call format; the known "
            f"ones are {parser_formats()} (verl's default is `hermes`)")
    return ToolParser.registry[name](tokenizer)
