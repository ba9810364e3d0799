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
    a distinct log-prob (-0.01, -0.02, ... over the server's life), so tests can follow them.
    With `per_trajectory`, the n-th turn of each trajectory (by `request_id`) gets the n-th
    scripted turn, whatever the order trajectories interleave in. With `max_model_len`, the
    context is limited as the vLLM replica limits it (`VLLMServer._request_params`): `max_tokens`
    cut to the room left, and a prompt that leaves none refused with `ValueError`."""

    tokenizer: Any
    turns: list[str | list[int]]
    log_probs: bool = False
    per_trajectory: bool = False
    max_model_len: int | None = None
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
        if self.per_trajectory:
            index = sum(r.request_id == request_id for r in self.requests) - 1
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(f"request `{request_id}`: a {len(prompt_ids)}-token prompt leaves {room} of the "
                                 f"{self.max_model_len} tokens of `max_model_len`")
            max_tokens = min(max_tokens, room)
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
