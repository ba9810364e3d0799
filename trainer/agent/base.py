"""The seams of the agent-loop rollout, in verl's shapes (`verl/experimental/agent_loop/`,
`verl/tools/base_tool.py`, `verl/interactions/base.py`).

A :class:`TokenServer` turns prompt token ids into response token ids (one turn). An
:class:`AgentLoop` runs one trajectory against a server: it builds the prompt with the chat
template, asks for turns, calls :class:`Tool` s or an :class:`Interaction` between them, and
returns an :class:`AgentOutput`: the prompt, then every token after it (the model's turns and
the tool/user turns between them, in order) with `response_mask` 1 only on the model's tokens.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable
from uuid import uuid4

if TYPE_CHECKING:
    from trainer.data import Example
    from trainer.rollout.base import SamplingParams

__all__ = ["AgentContext", "AgentLoop", "AgentOutput", "FinishReason", "Interaction", "TokenOutput", "TokenServer", "Tool",
           "ToolResponse"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenOutput:
    """One turn a server generated."""

    token_ids: list[int]
    """The sampled tokens, up to and including the stop token when there is one."""
    log_probs: list[float] | None = None
    """The sampling log-prob of each token (after temperature), when the server was asked for them."""
    finish_reason: FinishReason = "stop"
    """`stop`: a stop token; `length`: `max_tokens` reached; `abort`: the request was aborted."""


@runtime_checkable
class TokenServer(Protocol):
    """Token-in/token-out generation of one turn (verl's `AsyncLLMServerManager.generate`).
    `request_id` names the trajectory: every turn of one trajectory carries the same id, so a
    server pool can keep them on one server, whose prefix cache holds the conversation so far."""

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        """Sample one response (`params.n` is ignored: one sample) of at most `max_tokens` tokens."""
        ...


@dataclass
class AgentOutput:
    """One finished trajectory (verl's `AgentLoopOutput`)."""

    prompt_ids: list[int]
    """The prompt the first turn saw (chat template applied, with the tool schemas when tools are on)."""
    response_ids: list[int]
    """Everything after the prompt: model turns and tool/user turns, at most the response length."""
    response_mask: list[int]
    """1 on the model's tokens, 0 on tool and user tokens; as long as `response_ids`."""
    response_logprobs: list[float] | None = None
    """Sampling log-probs of `response_ids`, 0.0 on tool and user tokens; None when not asked."""
    num_turns: int = 2
    """verl's `__num_turns__`: user turns + assistant turns + 1 (the prompt)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Seconds in `generate_sequences` and `tool_calls`, and counts (`tool_calls_made`,
    `tool_calls_malformed`): verl's `agent_loop/*` metrics are their min/max/mean over rows."""
    extra: dict[str, Any] = field(default_factory=dict)
    """verl's `extra_fields`: `turn_scores` (interaction rewards) and `tool_rewards` (both lists,
    empty for a single-turn row), and anything else a loop adds. The reward function receives them
    in `extra_info` (verl 0.9.1 `reward_loop/reward_manager/naive.py` `run_single`)."""
    aborted: bool = False
    """The server aborted the last turn before it ended (a partial rollout's pause at a weight
    sync): the response is partial, and the fully-async rollouter continues it under the new
    weights (:mod:`trainer.async_rl.partial`)."""
    reward_score: float | None = None
    """A score the loop computed itself (verl's `AgentLoopOutput.reward_score`): when set, the
    reward function is not called for this trajectory and this is its score (verl 0.9.1
    `AgentLoopWorker._compute_score` runs the reward only when it is None)."""


@dataclass
class ToolResponse:
    """What a tool gives back to the conversation (verl's `ToolResponse`, text only here)."""

    text: str | None = None


class Tool(ABC):
    """verl's `BaseTool`: one tool the model may call, with its OpenAI function schema. A tool
    keeps per-trajectory state under an instance id from :meth:`create` until :meth:`release`."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config = config
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict[str, Any]:
        """The schema the chat template renders (verl's `BaseTool.get_openai_tool_schema`)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Open an instance for one trajectory. The loop passes the row's
        `tools_kwargs[name]["create_kwargs"]` as `create_kwargs=` (verl's call)."""
        return instance_id or uuid4().hex, ToolResponse()

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        """Run one call with the parsed JSON arguments: the response text, a step reward (or
        None) and metrics. An exception becomes the tool's text (`Error when executing tool: ...`)."""

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class CallGate:
    """At most `slots` calls of a tool at once within the running event loop (a new loop, e.g.
    the next rollout's `asyncio.run`, gets a new semaphore)."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, int(slots))
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def __call__(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates = {loop: asyncio.Semaphore(self.slots)}
        return self._gates[loop]


class Interaction(ABC):
    """verl's `BaseInteraction`: a simulated user that answers the model between turns."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Open an instance for one trajectory (`kwargs`: the row's `interaction_kwargs`)."""
        return instance_id or uuid4().hex

    @abstractmethod
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        """(stop the trajectory, the user's reply, a turn score, metrics)."""

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None


@dataclass
class AgentContext:
    """What every agent loop of a rollout shares (verl's `AgentLoopBase.__init__` arguments)."""

    tokenizer: Any
    """The actor's tokenizer (its chat template builds every turn's tokens)."""
    server: TokenServer
    """Where turns are generated."""
    response_length: int
    """`data.max_response_length`: the budget of every token after the prompt, tool turns included."""
    multi_turn: Any
    """`actor_rollout_ref.rollout.multi_turn` (:class:`trainer.config.rollout.MultiTurnConfig`):
    turn limits, parallel calls, tool response length and truncation side, parser format."""
    tools: dict[str, Tool] = field(default_factory=dict)
    """Tools by name, from `multi_turn.tool_config_path`."""
    interactions: dict[str, Interaction] = field(default_factory=dict)
    """Interactions by name, from `multi_turn.interaction_config_path`."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """`data.apply_chat_template_kwargs` (e.g. `enable_thinking`)."""
    prompt_length: int | None = None
    """`data.max_prompt_length`: a prompt a loop renders is cut to it (verl's `rollout.prompt_length`,
    `AgentLoopBase._cap_text_prompt_length`); None: not cut."""
    config: Any = None
    """The run's config (:class:`trainer.config.Config`): loops written against verl's interface
    read it as verl's `trainer_config` (:mod:`trainer.agent.verl_compat`)."""


class AgentLoop(ABC):
    """One kind of trajectory, registered by verl's name (`agent_name` of a data row)."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    @abstractmethod
    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        """Run one trajectory for `example` (its `prompt` messages, `prompt_ids` after the data's
        chat template, `extra_info.tools_kwargs` / `interaction_kwargs`); `request_id` is unique
        per trajectory and goes with every turn to the server."""
