"""A scripted token server for the agent-loop tests: the one seam faked (generation); templates,
parsing, tools and the loop's bookkeeping run for real."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.agent.base import FinishReason, TokenOutput
from trainer.rollout.base import SamplingParams


@dataclass(frozen=True)
class Request:
    """One `generate` call the server received."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class ScriptedServer:
    """A :class:`~trainer.agent.base.TokenServer` that answers the n-th request with the n-th
    scripted turn: a text becomes the tokenizer's encoding of it followed by EOS (a model stops
    at EOS); a list of ids is returned as it is. A turn longer than `max_tokens` is cut there
    with `finish_reason="length"`, as a server stops. With `log_probs`, each returned token gets
    a distinct log-prob (-0.01, -0.02, ... over the server's life), so tests can follow them."""

    tokenizer: Any
    turns: list[str | list[int]]
    log_probs: bool = False
    requests: list[Request] = field(default_factory=list)
    _emitted: int = 0

    def turn_ids(self, turn: str | list[int]) -> list[int]:
        if isinstance(turn, list):
            return list(turn)
        return list(self.tokenizer.encode(turn, add_special_tokens=False)) + [self.tokenizer.eos_token_id]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        self.requests.append(Request(request_id, list(prompt_ids), max_tokens))
        index = len(self.requests) - 1
        if index >= len(self.turns):
            raise AssertionError(f"request {index + 1} but only {len(self.turns)} turns are scripted")
        ids = self.turn_ids(self.turns[index])
        finish: FinishReason = "length" if len(ids) > max_tokens else "stop"
        ids = ids[:max_tokens]
        log_probs = None
        if self.log_probs:
            log_probs = [-(self._emitted + k + 1) / 100 for k in range(len(ids))]
            self._emitted += len(ids)
        return TokenOutput(token_ids=ids, log_probs=log_probs, finish_reason=finish)
