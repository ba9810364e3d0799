"""verl's agent loops by name: `single_turn_agent` and `tool_agent`, and custom loops from verl's
`agent_loop_config_path` (verl b178a3cd, `verl/experimental/agent_loop/`: `agent_loop.py`,
`single_turn_agent_loop.py`, `tool_agent_loop.py`; line numbers below are of that commit).

**Layout** (verl's `AgentLoopOutput`, padding-free): `prompt_ids` is what the first turn saw;
`response_ids` is every token after it, model turns and tool/user turns in order, cut to
`response_length`; `response_mask` is 1 on the model's tokens and 0 on tool/user tokens;
`response_logprobs` (when the server gave log-probs) holds the server's values on model tokens
and 0.0 on tool/user tokens. The manager pads (prompts left, responses right) as verl's
`_agent_loop_postprocess` does.

**Token equality with the full conversation.** A tool/user turn's tokens are the chat
template's rendering of the new messages with the generation prompt, minus the tokens of the
template's default system prompt (verl's `apply_chat_template(..., remove_system_prompt=True)`,
`agent_loop.py:247-310`; its system prompt: `agent_loop.py:223`,
`verl/utils/chat_template.py:9-28`), preceded by the template's turn separator (the tokens after
a turn's closing token: ChatML's `\\n` after `<|im_end|>`), which the model does not generate
since it stops at the closing token. With that, for a trajectory ending on a model turn that
stopped at EOS, `prompt_ids + response_ids` equals `apply_chat_template(messages, tools=...,
tokenize=True)` of the whole conversation (assistant messages as their text, then the tool/user
messages) but for one thing: the full rendering also has the separator after the last EOS
(ChatML: a final `\\n`), which no turn generated. A trajectory ending on a user turn (an
interaction said stop) equals the full rendering with `add_generation_prompt=True`. This holds
where the model's tokens are the tokenizer's own encoding of its text (a model may sample another
tokenization of the same text: then only the model's tokens differ, and they are what it sampled).

verl b178a3cd (and v0.7.x) drops the separator at every assistant->tool and assistant->user
boundary (verl#6501): one `\\n` fewer than the full rendering per tool/user turn. verl v0.9.0
restores it at tool turns (#6921: `initialize_turn_separator`,
`verl/utils/tokenizer/chat_template.py:42-111`, prepended at `tool_agent_loop.py:431`; ported as
:func:`turn_separator_ids`); v0.9.0 has no interactions any more. Here it is restored at both, by
the one helper that renders tool and user turns (:meth:`ChatTurns.turn`).

**Other differences from verl b178a3cd.** These change no sampled token's distribution:
- each turn asks the server for at most the response budget left (`response_length -
  len(response_mask)`); verl passes its full sampling parameters and cuts at the end, so the
  tokens it sampled past the budget were dropped anyway. A turn reached with no budget left (after
  an interaction turn filled it; verl checks no budget there) is counted as verl counts it, without
  asking the server for tokens the cut would drop;
- `finalize_interaction` is called when a trajectory ends (verl's loop never calls it);
- `tool_calls_made` and `tool_calls_malformed` are counted (verl only logs malformed calls); verl's
  `num_preempted` is not reported (the servers here give no such count);
- the template is rendered and the turn parsed in the event loop's thread (verl uses an executor).
These refuse what verl would do silently wrong, or fix an edge verl gets wrong:
- the system prompt is rendered with `data.apply_chat_template_kwargs` (as verl v0.9.0; b178a3cd
  takes them and ignores them), and a tool/user rendering that does not start with it is refused
  instead of being cut blindly;
- a trajectory with no response token gives an empty response (verl's
  `prompt_ids[-len(response_mask):]` would give the whole prompt);
- `tool_response_truncate_side` other than left/right/middle is refused (verl treats it as middle);
  left/right keep b178a3cd's meaning (left keeps the head), which verl v0.8.0 swapped (#6313).
Not built: multimodal inputs and tool responses (images, videos), verl's `gpt-oss` tool format,
constructor arguments for :class:`AgentLoop` subclasses (loops written against verl's interface get
theirs: :mod:`trainer.agent.verl_compat`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer.agent import verl_compat
from trainer.agent.base import AgentContext, AgentLoop, AgentOutput, Interaction, ToolResponse
from trainer.agent.parser import FunctionCall, get_tool_parser
from trainer.agent.tools.loading import check_schema
from trainer.data import chat_prompt_ids

if TYPE_CHECKING:
    from trainer.data import Example
    from trainer.rollout.base import SamplingParams

__all__ = ["AgentData", "AgentLoopError", "ChatTurns", "SingleTurnAgentLoop", "ToolAgentLoop", "cap_prompt",
           "load_agent_loops", "loop_class", "register", "registered", "system_prompt_ids",
           "truncate_tool_text", "turn_separator_ids"]

logger = logging.getLogger(__name__)


class AgentLoopError(ValueError):
    """An agent loop cannot be chosen, loaded or run as configured; the message says the fix."""


# ----------------------------------------------------------------------------- registry

_LOOPS: dict[str, type[AgentLoop]] = {}


def register(name: str) -> Any:
    """Register an agent loop class under verl's `agent_name` (verl's `register`, `agent_loop.py:334-342`)."""
    def decorator(cls: type[AgentLoop]) -> type[AgentLoop]:
        _LOOPS[name] = cls
        return cls
    return decorator


def registered() -> list[str]:
    return sorted(_LOOPS)


def loop_class(name: str) -> type[AgentLoop]:
    """The loop a row's `agent_name` names (verl asserts it is registered, `agent_loop.py:504`)."""
    if name not in _LOOPS:
        raise AgentLoopError(
            f"`agent_name={name}` names no agent loop; registered: {registered()}. A row's "
            "`agent_name` picks its loop (rows without one run "
            "`actor_rollout_ref.rollout.agent.default_agent_loop`); add a loop of your own with "
            "`actor_rollout_ref.rollout.agent.agent_loop_config_path`")
    return _LOOPS[name]


# ----------------------------------------------------------------------------- chat template


def _rendered_ids(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any]) -> list[int]:
    """`messages` rendered without the generation prompt, tokenised as `chat_prompt_ids` does."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                         **dict(template_kwargs))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def system_prompt_ids(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> list[int]:
    """The tokens a template puts before the first message of any conversation (a default system
    prompt): verl's `initialize_system_prompt` (`verl/utils/chat_template.py:9-28`), one empty
    user turn rendered, minus the length one more adds."""
    one = _rendered_ids(tokenizer, [{"role": "user", "content": ""}], template_kwargs)
    two = _rendered_ids(tokenizer, [{"role": "user", "content": ""}] * 2, template_kwargs)
    return one[: -(len(two) - len(one))]


def turn_separator_ids(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> list[int]:
    """The tokens a template puts after a turn's closing token (ChatML: `\\n` after `<|im_end|>`):
    verl v0.9.0's `initialize_turn_separator` (`verl/utils/tokenizer/chat_template.py`, #6921).
    A user turn rendered empty and with text shares a trailing run, `[close, *separator]`; the
    separator is what follows the last EOS id in that run (all but its first token when no EOS is
    there); [] for a template without one. (verl's retry with list-of-parts content is for
    multimodal processors, not built here.)"""
    empty = _rendered_ids(tokenizer, [{"role": "user", "content": ""}], template_kwargs)
    filled = _rendered_ids(tokenizer, [{"role": "user", "content": "x"}], template_kwargs)
    common = 0
    while common < min(len(empty), len(filled)) and empty[-1 - common] == filled[-1 - common]:
        common += 1
    suffix = empty[len(empty) - common:]
    if not suffix:
        return []
    eos = tokenizer.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    closes = [i for i, tok in enumerate(suffix) if tok in eos_ids]
    return suffix[closes[-1] + 1:] if closes else suffix[1:]


class ChatTurns:
    """The one place the agent loops render the chat template: the first prompt (with the tool
    schemas) and the tool/user turns appended between model turns."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.system_prompt = system_prompt_ids(tokenizer, self.template_kwargs)
        self.separator = turn_separator_ids(tokenizer, self.template_kwargs)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """verl's `_handle_pending_state` (`tool_agent_loop.py:211-220`): `tools=[schemas]` (an
        empty list when no tool is configured, as verl passes it) and the generation prompt."""
        return chat_prompt_ids(self.tokenizer, messages, {**self.template_kwargs, "tools": tools})

    def turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """Tokens of tool or user `messages` appended after a model turn: the separator, then their
        rendering (with the generation prompt, without tools) minus the system prompt."""
        ids = chat_prompt_ids(self.tokenizer, messages, self.template_kwargs)
        start = len(self.system_prompt)
        if ids[:start] != self.system_prompt:
            raise AgentLoopError(
                f"the chat template renders the {messages[0]['role']} turn {ids[:start + 8]}... not after "
                f"the default system prompt {self.system_prompt} it puts before any conversation, so the "
                "turn's tokens cannot be cut out of a rendering (verl's `remove_system_prompt`); use a "
                "template whose rendering of a conversation is its system prompt followed by its turns "
                "(`actor_rollout_ref.model.custom_chat_template`)")
        return self.separator + ids[start:]


# ----------------------------------------------------------------------------- metrics


def _new_metrics() -> dict[str, float]:
    """verl's `AgentLoopMetrics` defaults (`agent_loop.py:125-130`) and the counts added here."""
    return {"generate_sequences": 0.0, "tool_calls": 0.0, "tool_calls_made": 0, "tool_calls_malformed": 0}


@contextmanager
def _timed(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent inside to `metrics[name]` (verl's `simple_timer` accumulates)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[name] = metrics.get(name, 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------- single turn


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """verl's `SingleTurnAgentLoop` (`single_turn_agent_loop.py:27-84`): one generation of at most
    `response_length` tokens, every response token the model's (mask 1), `num_turns` 2.

    The prompt is the row's `prompt_ids` (the data's chat template and truncation); verl renders
    the row's messages again, with `data.tool_config_path`'s schemas when set."""

    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        prompt_ids = list(example.prompt_ids)
        metrics = _new_metrics()
        length = self.ctx.response_length
        with _timed("generate_sequences", metrics):
            out = await self.ctx.server.generate(request_id, prompt_ids, params, length)
        response = list(out.token_ids[:length])
        return AgentOutput(
            prompt_ids=prompt_ids, response_ids=response, response_mask=[1] * len(response),
            response_logprobs=list(out.log_probs[:length]) if out.log_probs else None,
            num_turns=2, metrics=metrics, aborted=out.finish_reason == "abort",
            # verl 0.9.1 `single_turn_agent_loop.py`: "keeping the schema consistent with tool_agent_loop"
            extra={"turn_scores": [], "tool_rewards": []})


# ----------------------------------------------------------------------------- tool agent


class _State(Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class AgentData:
    """One trajectory's state (verl's `AgentData`, `tool_agent_loop.py:54-92`); tools get it as
    `agent_data=` in `execute`. `prompt_ids` grows with every turn; the response is its tail,
    as long as `response_mask`."""

    messages: list[dict[str, Any]]
    request_id: str
    tools_kwargs: dict[str, Any]
    interaction: Interaction | None = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=_new_metrics)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    """The last model turn's tokens."""
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    user_turns: int = 0
    assistant_turns: int = 0
    tool_calls: list[FunctionCall] = field(default_factory=list)
    extra_fields: dict[str, Any] = field(default_factory=dict)


_TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_tool_text(text: str | None, max_length: int, side: str) -> str | None:
    """verl's cut of a long tool response (`tool_agent_loop.py:444-452`), in characters: `left`
    keeps the head, `right` the tail, `middle` half of each (verl v0.8.0+ swapped left and right,
    #6313; this is b178a3cd's). `max_length // 2 == 0` keeps the whole tail, as verl's
    `text[-0:]` does."""
    if not text or len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@register("tool_agent")
class ToolAgentLoop(AgentLoop):
    """verl's `ToolAgentLoop` (`tool_agent_loop.py:95-475`): a state machine PENDING ->
    GENERATING -> (PROCESSING_TOOLS | INTERACTING) -> GENERATING ... -> TERMINATED.

    - PENDING: the row's messages through the chat template with the tool schemas, cut to the
      prompt length (:func:`cap_prompt`, verl's `_cap_text_prompt_length`).
    - GENERATING: one model turn (mask 1, its log-probs). Then, in verl's order: stop when the
      response reached `response_length`, when `max_assistant_turns` or `max_user_turns` (when
      set) is reached; else parse the tool calls; with an interaction, the decoded turn joins the
      messages. Calls -> PROCESSING_TOOLS; no calls and an interaction -> INTERACTING; else stop.
    - PROCESSING_TOOLS: the first `max_parallel_calls` calls run concurrently; each response
      (cut to `max_tool_response_length` characters) becomes a `tool` message; a failing call
      (bad JSON arguments, unknown tool, an exception) becomes `Error when executing tool: ...`
      with reward 0.0. Stop when the tool turn would reach `response_length`; else append it
      (mask 0, log-prob 0.0), one more user turn, generate again.
    - INTERACTING: the interaction answers as the user (a turn score when not None); the turn is
      appended (mask 0; verl checks no budget here); stop when the interaction says so.
    """

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        mt = ctx.multi_turn
        self.max_user_turns: int | None = mt.max_user_turns
        self.max_assistant_turns: int | None = mt.max_assistant_turns
        self.max_parallel_calls: int = mt.max_parallel_calls
        self.max_tool_response_length: int = mt.max_tool_response_length
        self.truncate_side: str = mt.tool_response_truncate_side
        if self.truncate_side not in _TRUNCATE_SIDES:
            raise AgentLoopError(
                f"`actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={self.truncate_side}` "
                f"is none of {list(_TRUNCATE_SIDES)}; set one of them (verl's default is `middle`)")
        # verl renders `tool_schema.model_dump(exclude_unset=True, exclude_none=True)`
        # (`ToolAgentLoop.__init__`, verl 0.9.1): the same keys, in the same order
        self.tool_schemas = [check_schema(tool.tool_schema, f"tool `{name}`") for name, tool in ctx.tools.items()]
        self.parser = get_tool_parser(mt.format, ctx.tokenizer)
        self.turns = ChatTurns(ctx.tokenizer, ctx.chat_template_kwargs)

    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        extra = example.extra_info or {}
        data = AgentData(messages=[dict(m) for m in example.prompt], request_id=request_id,
                         tools_kwargs=dict(extra.get("tools_kwargs") or {}))
        data.interaction, data.interaction_kwargs = await self._start_interaction(example, request_id)
        try:
            state = _State.PENDING
            while state != _State.TERMINATED:
                state = await self._step(state, data, params)
        finally:
            if data.interaction is not None:
                await data.interaction.finalize_interaction(request_id)
        return self._output(data)

    async def _step(self, state: _State, data: AgentData, params: SamplingParams) -> _State:
        if state == _State.PENDING:
            data.prompt_ids = cap_prompt(self.turns.prompt(data.messages, self.tool_schemas), self.ctx.prompt_length)
            return _State.GENERATING
        if state == _State.GENERATING:
            return await self._generate(data, params)
        if state == _State.PROCESSING_TOOLS:
            return await self._process_tools(data)
        return await self._interact(data)

    async def _start_interaction(self, example: Example, request_id: str
                                 ) -> tuple[Interaction | None, dict[str, Any]]:
        """verl's interaction lookup (`tool_agent_loop.py:145-160`): with interactions configured,
        each row names its own in `extra_info.interaction_kwargs.name`."""
        if not self.ctx.interactions:
            return None, {}
        kwargs = dict((example.extra_info or {}).get("interaction_kwargs") or {})
        known = sorted(self.ctx.interactions)
        name = kwargs.get("name")
        if name is None:
            raise AgentLoopError(
                f"row {example.index}: `extra_info.interaction_kwargs` has no `name`; with "
                "`actor_rollout_ref.rollout.multi_turn.interaction_config_path` set, each row names the "
                f"interaction that answers it: add `name` (one of {known}) to every row's interaction_kwargs")
        if name not in self.ctx.interactions:
            raise AgentLoopError(
                f"row {example.index}: `extra_info.interaction_kwargs.name={name}` is not an interaction "
                f"of `multi_turn.interaction_config_path` (those are {known}); fix the row or the file")
        interaction = self.ctx.interactions[name]
        await interaction.start_interaction(request_id, **kwargs)
        return interaction, kwargs

    async def _generate(self, data: AgentData, params: SamplingParams) -> _State:
        """verl's `_handle_generating_state` (`tool_agent_loop.py:222-278`)."""
        budget = self.ctx.response_length - len(data.response_mask)
        if budget <= 0:
            # Only after an interaction turn filled the budget: verl generates this turn and its
            # final cut drops every token of it, then stops on the length check below.
            data.assistant_turns += 1
            return _State.TERMINATED
        # verl passes its sampling parameters unchanged (the server's own limit applies); asking
        # for the budget left samples the same first tokens and none that the final cut drops.
        with _timed("generate_sequences", data.metrics):
            out = await self.ctx.server.generate(data.request_id, data.prompt_ids, params, budget)
        data.assistant_turns += 1
        data.response_ids = list(out.token_ids)
        data.prompt_ids += data.response_ids
        data.response_mask += [1] * len(data.response_ids)
        if out.log_probs:
            data.response_logprobs += list(out.log_probs)
        if len(data.response_mask) >= self.ctx.response_length:
            return _State.TERMINATED
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return _State.TERMINATED
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return _State.TERMINATED
        parsed = self.parser.parse(data.response_ids)
        data.tool_calls = parsed.calls
        data.metrics["tool_calls_malformed"] += parsed.malformed
        if data.interaction is not None:
            text = self.ctx.tokenizer.decode(data.response_ids, skip_special_tokens=True)
            data.messages.append({"role": "assistant", "content": text})
        if data.tool_calls:
            return _State.PROCESSING_TOOLS
        return _State.INTERACTING if data.interaction is not None else _State.TERMINATED

    async def _process_tools(self, data: AgentData) -> _State:
        """verl's `_handle_processing_tools_state` (`tool_agent_loop.py:280-377`), text tools."""
        calls = data.tool_calls[: self.max_parallel_calls]
        with _timed("tool_calls", data.metrics):
            responses = await asyncio.gather(*(self._call_tool(call, data) for call in calls))
        data.metrics["tool_calls_made"] += len(calls)
        add_messages = []
        for response, reward, _ in responses:
            add_messages.append({"role": "tool", "content": response.text or ""})
            if reward is not None:
                data.tool_rewards.append(reward)
        data.messages.extend(add_messages)
        ids = self.turns.turn(add_messages)
        if len(data.response_mask) + len(ids) >= self.ctx.response_length:
            return _State.TERMINATED
        _append_context(data, ids)
        data.user_turns += 1
        return _State.GENERATING

    async def _interact(self, data: AgentData) -> _State:
        """verl's `_handle_interacting_state` (`tool_agent_loop.py:379-414`)."""
        assert data.interaction is not None
        stop, text, reward, _ = await data.interaction.generate_response(
            data.request_id, data.messages, **data.interaction_kwargs)
        data.user_turns += 1
        add_messages = [{"role": "user", "content": text}]
        data.messages.extend(add_messages)
        if reward is not None:
            data.turn_scores.append(reward)
        _append_context(data, self.turns.turn(add_messages))
        return _State.TERMINATED if stop else _State.GENERATING

    async def _call_tool(self, call: FunctionCall, data: AgentData) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        """verl's `_call_tool` (`tool_agent_loop.py:416-464`): arguments decoded, then the tool looked
        up, created with the row's `tools_kwargs[name].create_kwargs`, executed, released; any
        exception there becomes the tool's text, with reward 0.0."""
        tool, instance_id = None, None
        try:
            arguments = json.loads(call.arguments)
            tool = self.ctx.tools[call.name]
            kwargs = data.tools_kwargs.get(call.name, {})
            instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
            response, reward, metrics = await tool.execute(instance_id, arguments, agent_data=data)
        except Exception as exc:  # verl turns every failure into the tool's text
            logger.warning("Error when executing tool: %s", exc)
            return ToolResponse(text=f"Error when executing tool: {exc}"), 0.0, {}
        finally:
            if tool and instance_id:
                await tool.release(instance_id)
        text = truncate_tool_text(response.text, self.max_tool_response_length, self.truncate_side)
        return ToolResponse(text=text), reward, metrics

    def _output(self, data: AgentData) -> AgentOutput:
        """verl's final cut (`tool_agent_loop.py:188-209`): the response is the tail of
        `prompt_ids` as long as the mask, everything cut to `response_length`."""
        length = self.ctx.response_length
        split = len(data.prompt_ids) - len(data.response_mask)
        return AgentOutput(
            prompt_ids=data.prompt_ids[:split],
            response_ids=data.prompt_ids[split:][:length],
            response_mask=data.response_mask[:length],
            response_logprobs=data.response_logprobs[:length] if data.response_logprobs else None,
            num_turns=data.user_turns + data.assistant_turns + 1,
            metrics=data.metrics,
            extra={"turn_scores": data.turn_scores, "tool_rewards": data.tool_rewards})


def cap_prompt(prompt_ids: list[int], prompt_length: int | None) -> list[int]:
    """A rendered prompt cut to its last `prompt_length` tokens, with a warning (verl 0.9.1
    `AgentLoopBase._cap_text_prompt_length`, `agent_loop.py`, applied to every prompt its loops
    render). Every later turn then fits the engine's context: a turn asks for at most the response
    budget left, so prompt and turns stay within prompt + response length."""
    if prompt_length is None or len(prompt_ids) <= prompt_length:
        return prompt_ids
    logger.warning("Prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating.", len(prompt_ids),
                   prompt_length)
    return prompt_ids[-prompt_length:]


def _append_context(data: AgentData, ids: list[int]) -> None:
    """Tool or user tokens: in the sequence, not trained on (mask 0, log-prob 0.0 when kept)."""
    data.prompt_ids += ids
    data.response_mask += [0] * len(ids)
    if data.response_logprobs:
        data.response_logprobs += [0.0] * len(ids)


# ----------------------------------------------------------------------------- custom loops

#: verl's own loops, by the `_target_` its `agent_loop_config_path` files may name.
VERL_TARGETS = {
    "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop": "single_turn_agent",
    "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop": "tool_agent",
}
_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"


def load_agent_loops(path: str | Path) -> dict[str, type[AgentLoop]]:
    """Register the loops of verl's `agent_loop_config_path` file (`agent_loop.py:375-380`): a
    YAML list of `{name, _target_}`, `_target_` the dotted path of an :class:`AgentLoop`
    subclass, or of a loop written against verl's interface (with its constructor arguments
    beside `_target_`; run by :mod:`trainer.agent.verl_compat`); a name already registered is
    replaced, as in verl. verl's own two loops map to theirs here; another `verl.*` loop needs
    verl installed. The whole file is checked before anything
    is registered. A relative path is read from the current directory (verl also tries its own
    installation directory)."""
    file = Path(path)
    if not file.is_file():
        raise AgentLoopError(f"`{_KEY}={path}`: no such file (from {Path.cwd()}); give the path of verl's "
                             "agent loop YAML (`- name: my_agent` / `  _target_: my_pkg.loops.MyLoop`)")
    entries = yaml.safe_load(file.read_text())
    if not isinstance(entries, list) or not entries:
        raise AgentLoopError(f"`{_KEY}={path}`: expected a YAML list of `{{name, _target_}}` entries, "
                             f"got {type(entries).__name__}")
    loaded: dict[str, type[AgentLoop]] = {}
    for i, entry in enumerate(entries):
        where = f"`{_KEY}={path}`, entry {i}"
        if not isinstance(entry, dict) or not {"name", "_target_"} <= set(entry):
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise AgentLoopError(f"{where}: expected a mapping with `name` and `_target_` (and, for a loop "
                                 f"written against verl's interface, its constructor arguments), got {keys}")
        cls = _target_class(str(entry["_target_"]), where)
        if verl_compat.is_verl_loop(cls):  # verl's interface: built as verl builds it, any arguments
            loaded[str(entry["name"])] = verl_compat.verl_loop(cls, entry)
            continue
        if set(entry) != {"name", "_target_"}:
            raise AgentLoopError(
                f"{where}: expected exactly the keys `name` and `_target_`, got {sorted(entry)}; constructor "
                "arguments beside `_target_` (hydra's instantiate) go to loops written against verl's interface "
                "(`async run(self, sampling_params, **kwargs)`) only: a `trainer.agent.base.AgentLoop` gets the "
                "rollout's `AgentContext`, so read any setting of your own inside the loop")
        loaded[str(entry["name"])] = cls
    _LOOPS.update(loaded)
    return loaded


def _target_class(target: str, where: str) -> type:
    """The class `_target_` names: verl's two loops map to their ports here; any other class is
    imported and must subclass :class:`AgentLoop` or be written against verl's interface (then
    :mod:`trainer.agent.verl_compat` runs it; a `verl.*` one needs verl installed)."""
    if target in VERL_TARGETS:
        return _LOOPS[VERL_TARGETS[target]]
    module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as exc:
        if target.startswith("verl."):
            raise AgentLoopError(
                f"{where}: `_target_: {target}` is a verl class that cannot be imported here ({exc}); verl's "
                f"own agent loops have counterparts here ({', '.join(f'{k} -> {v}' for k, v in VERL_TARGETS.items())}); "
                "install verl where the rollout runs to run another of its loops unchanged, or port it as a "
                "subclass of `trainer.agent.base.AgentLoop`") from exc
        raise AgentLoopError(
            f"{where}: `_target_: {target}` cannot be imported ({exc}); make its module importable "
            "where the rollout runs (installed, or on PYTHONPATH)") from exc
    if not (isinstance(obj, type) and (issubclass(obj, AgentLoop) or verl_compat.is_verl_loop(obj))):
        raise AgentLoopError(
            f"{where}: `_target_: {target}` is {obj!r}, not a subclass of `trainer.agent.base.AgentLoop` "
            "(`__init__(ctx)`, `async run(example, params, request_id) -> AgentOutput`) nor a loop written "
            "against verl's interface (verl's `AgentLoopBase` constructor, `async run(self, sampling_params, "
            "**kwargs) -> AgentLoopOutput`)")
    return obj
