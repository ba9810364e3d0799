"""A loop written against verl 0.9.1's public interface only (imports verl: used by
test_verl_compat.py where verl is installed). It asks for `turns` model turns, each from the
prompt plus the turns so far, with verl's Continuous Token helpers building the prompt."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.utils.profiler import simple_timer

BUILT: list[Any] = []
"""Every instance, in the order they were built."""


class RepeatAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, turns: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turns = turns
        self.response_length = self.rollout_config.response_length
        self.kwargs_seen: dict[str, Any] = {}
        BUILT.append(self)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        self.kwargs_seen = kwargs
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex
        metrics: dict[str, Any] = {}
        ids: list[int] = []
        log_probs: list[float] = []
        for _ in range(self.turns):
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + ids,
                                                         sampling_params=sampling_params)
            ids += out.token_ids
            log_probs += out.log_probs or []
        n = min(len(ids), self.response_length)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[:n], response_mask=[1] * n,
                               response_logprobs=log_probs[:n] or None, num_turns=1 + self.turns,
                               metrics=AgentLoopMetrics(**metrics), extra_fields={"turn_scores": [1.0]})
