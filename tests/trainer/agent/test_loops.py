"""verl's agent loops against a scripted server: the layout of what they return, the turn and
budget limits, tool calls (errors, truncation, the parallel cap), interactions, and the registry
with verl's `agent_loop_config_path`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.trainer.agent.fakes import ScriptedServer
from trainer import tiny
from trainer.agent import loops
from trainer.agent.base import AgentContext, AgentLoop, AgentOutput, Interaction, Tool, ToolResponse
from trainer.agent.loops import (
    AgentData,
    AgentLoopError,
    SingleTurnAgentLoop,
    ToolAgentLoop,
    load_agent_loops,
    loop_class,
    truncate_tool_text,
)
from trainer.agent.parser import FunctionCall
from trainer.config.rollout import MultiTurnConfig
from trainer.data import Example, chat_prompt_ids
from trainer.rollout.base import SamplingParams

TOK = tiny.build_tokenizer(tools=True)
EOS = TOK.eos_token_id
QUESTION = [{"role": "user", "content": "what is 1 plus 2?"}]


def multi_turn(**overrides: Any) -> MultiTurnConfig:
    """`rollout.multi_turn` at the trainer's defaults (verl's), with `overrides`."""
    defaults = yaml.safe_load((REPO / "trainer/config/rollout.yaml").read_text())
    return MultiTurnConfig(**{**defaults["actor_rollout_ref"]["rollout"]["multi_turn"], **overrides})


def schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": "add", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"]}}}


class CalcTool(Tool):
    """Adds `x` and `y`; records its lifecycle."""

    def __init__(self, name: str = "calc", reward: float | None = 0.5) -> None:
        super().__init__({}, schema(name))
        self.reward = reward
        self.log: list[tuple[Any, ...]] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        self.log.append(("create", kwargs))
        return f"inst{len(self.log)}", ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        assert isinstance(kwargs["agent_data"], AgentData)
        self.log.append(("execute", instance_id, parameters))
        return ToolResponse(text=str(parameters["x"] + parameters["y"])), self.reward, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("release", instance_id))


class TextTool(CalcTool):
    """Answers a fixed text."""

    def __init__(self, text: str, name: str = "echo") -> None:
        super().__init__(name)
        self.text = text

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        self.log.append(("execute", instance_id, parameters))
        return ToolResponse(text=self.text), None, {}


class FailingTool(CalcTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        self.log.append(("execute", instance_id, parameters))
        raise RuntimeError("a digit")


def call(name: str = "calc", **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def example(extra: dict[str, Any] | None = None, messages: list[dict[str, str]] = QUESTION) -> Example:
    return Example(index=7, data_source="t", prompt=messages, ability="math", reward_model={},
                   extra_info=extra or {}, prompt_ids=chat_prompt_ids(TOK, messages), agent_name="tool_agent")


def make(turns: list[str | list[int]], tools: tuple[Tool, ...] = (), *, log_probs: bool = False,
         response_length: int = 200, interactions: dict[str, Interaction] | None = None,
         loop: type[AgentLoop] = ToolAgentLoop, **mt: Any) -> tuple[AgentLoop, ScriptedServer]:
    server = ScriptedServer(TOK, turns, log_probs=log_probs)
    ctx = AgentContext(tokenizer=TOK, server=server, response_length=response_length,
                       multi_turn=multi_turn(**mt), tools={t.name: t for t in tools},
                       interactions=interactions or {})
    return loop(ctx), server


def run(loop: AgentLoop, ex: Example | None = None, request_id: str = "traj-0") -> AgentOutput:
    return asyncio.run(loop.run(ex or example(), SamplingParams(), request_id))


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def prompt_with_tools(tools: tuple[Tool, ...]) -> list[int]:
    text = TOK.apply_chat_template(QUESTION, tools=[t.tool_schema for t in tools], add_generation_prompt=True,
                                   tokenize=False)
    return ids(str(text))


# ----------------------------------------------------------------------------- single turn


@pytest.mark.parametrize("log_probs", [False, True])
def test_single_turn_generates_once_from_the_rows_prompt_ids(log_probs: bool) -> None:
    loop, server = make(["the answer is 3"], loop=SingleTurnAgentLoop, log_probs=log_probs, response_length=10)
    ex = example()
    out = run(loop, ex)
    assert [(r.request_id, r.prompt_ids, r.max_tokens) for r in server.requests] == [("traj-0", ex.prompt_ids, 10)]
    assert out.prompt_ids == ex.prompt_ids
    assert out.response_ids == ids("the answer is 3") + [EOS]
    assert out.response_mask == [1] * len(out.response_ids)
    assert out.response_logprobs == ([-(k + 1) / 100 for k in range(len(out.response_ids))] if log_probs else None)
    assert out.num_turns == 2
    assert set(out.metrics) == {"generate_sequences", "tool_calls", "tool_calls_made", "tool_calls_malformed"}
    assert out.metrics["generate_sequences"] > 0 and out.metrics["tool_calls"] == 0.0


def test_single_turn_response_is_cut_to_the_response_length() -> None:
    loop, server = make(["the answer is 3 and 4"], loop=SingleTurnAgentLoop, response_length=4)
    out = run(loop)
    assert out.response_ids == ids("the answer is 3 and 4")[:4] and out.response_mask == [1] * 4


# ----------------------------------------------------------------------------- tool agent


def test_tool_turn_layout_masks_and_prompts() -> None:
    calc = CalcTool()
    first, last = f"let me add {call(x=1, y=2)}", "the answer is 3"
    loop, server = make([first, last], (calc,))
    out = run(loop, example({"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "3"}}}}))

    prompt = prompt_with_tools((calc,))
    tool_turn = ids("\n") + [TOK.convert_tokens_to_ids("<|tool|>")] + ids("\n3") + [EOS] + ids("\n") \
        + [TOK.convert_tokens_to_ids("<|assistant|>")] + ids("\n")
    model1, model2 = ids(first) + [EOS], ids(last) + [EOS]
    assert out.prompt_ids == prompt
    assert out.response_ids == model1 + tool_turn + model2
    assert out.response_mask == [1] * len(model1) + [0] * len(tool_turn) + [1] * len(model2)
    assert TOK.decode(tool_turn) == "\n<|tool|>\n3</s>\n<|assistant|>\n"
    assert [r.prompt_ids for r in server.requests] == [prompt, prompt + model1 + tool_turn]
    assert [r.max_tokens for r in server.requests] == [200, 200 - len(model1) - len(tool_turn)]
    assert {r.request_id for r in server.requests} == {"traj-0"}
    assert out.response_logprobs is None
    assert out.num_turns == 4  # one tool turn + two model turns + the prompt
    assert out.extra == {"turn_scores": [], "tool_rewards": [0.5]}
    assert calc.log == [("create", {"create_kwargs": {"ground_truth": "3"}}), ("execute", "inst1", {"x": 1, "y": 2}),
                        ("release", "inst1")]
    assert out.metrics["tool_calls_made"] == 1 and out.metrics["tool_calls_malformed"] == 0
    assert out.metrics["tool_calls"] > 0 and out.metrics["generate_sequences"] > 0


def test_log_probs_are_the_servers_on_model_tokens_and_zero_on_tool_tokens() -> None:
    loop, _ = make([call(x=1, y=2), "the answer is 3"], (CalcTool(),), log_probs=True)
    out = run(loop)
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)
    model = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m]
    context = [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if not m]
    assert model == [-(k + 1) / 100 for k in range(sum(out.response_mask))]
    assert context and set(context) == {0.0}


def test_no_call_ends_the_trajectory_after_one_turn() -> None:
    loop, server = make(["the answer is 3"], (CalcTool(),))
    out = run(loop)
    assert len(server.requests) == 1 and out.num_turns == 2 and out.response_mask == [1] * len(out.response_ids)
    assert out.extra == {"turn_scores": [], "tool_rewards": []}


def test_max_assistant_turns_stops_before_the_calls_run() -> None:
    calc = CalcTool()
    loop, server = make([call(x=1, y=2)], (calc,), max_assistant_turns=1)
    out = run(loop)
    assert len(server.requests) == 1 and calc.log == [] and out.num_turns == 2
    assert out.metrics["tool_calls_made"] == 0


def test_max_user_turns_stops_after_that_many_tool_turns() -> None:
    calc = CalcTool()
    loop, server = make([call(x=1, y=2), call(x=2, y=2), call(x=3, y=3)], (calc,), max_user_turns=1)
    out = run(loop)
    assert len(server.requests) == 2 and out.num_turns == 4
    assert [e[2] for e in calc.log if e[0] == "execute"] == [{"x": 1, "y": 2}]
    assert out.response_mask[-1] == 1  # ends on the model's turn, whose call never ran


def test_model_turn_reaching_the_budget_ends_and_is_asked_for_no_more() -> None:
    first = call(x=1, y=2)
    loop, server = make([first, "the answer is 3 and the answer is 3"], (CalcTool(),), response_length=60)
    out = run(loop)
    used = len(server.requests[1].prompt_ids) - len(server.requests[0].prompt_ids)
    assert server.requests[1].max_tokens == 60 - used > 0
    assert len(out.response_ids) == len(out.response_mask) == 60
    assert out.response_ids[used:] == ids("the answer is 3 and the answer is 3")[: 60 - used]
    assert out.num_turns == 4


def test_the_prompt_renders_tool_schemas_as_verls_models_dump_them() -> None:
    """verl renders `model_dump(exclude_unset=True, exclude_none=True)` of its schema models: a
    property's `items` and `minimum` are gone and keys come in the models' order, so a tool built
    in code with a loose schema is rendered as verl renders it, not as given."""
    loose = CalcTool()
    loose.tool_schema = {"function": {"parameters": {"properties": {
        "x": {"minimum": 0, "type": "integer"}, "y": {"type": "array", "items": {"type": "integer"}}},
        "type": "object"}, "description": "add", "name": "calc"}, "type": "function"}
    loop, server = make(["done"], (loose,))
    run(loop)
    dumped = {"type": "function", "function": {"name": "calc", "description": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "array"}}}}}
    as_verl = ids(str(TOK.apply_chat_template(QUESTION, tools=[dumped], add_generation_prompt=True, tokenize=False)))
    as_given = ids(str(TOK.apply_chat_template(QUESTION, tools=[loose.tool_schema], add_generation_prompt=True,
                                               tokenize=False)))
    assert server.requests[0].prompt_ids == as_verl != as_given


@pytest.mark.parametrize("spare", [0, 1])
def test_tool_turn_that_would_reach_the_budget_is_not_appended(spare: int) -> None:
    """verl's `len(response_mask) + len(tool ids) >= response_length`: the tool ran (its reward
    counts) but its turn is not appended and no further turn is asked for."""
    first = ids(call(x=1, y=2)) + [EOS]
    tool_turn = len(TOK("\n<|tool|>\n3</s>\n<|assistant|>\n", add_special_tokens=False)["input_ids"])
    length = len(first) + tool_turn + spare
    loop, server = make([first, "the answer is 3"], (CalcTool(),), response_length=length)
    out = run(loop)
    if spare == 0:
        assert len(server.requests) == 1 and out.response_ids == first and out.num_turns == 2
        assert out.extra["tool_rewards"] == [0.5] and out.metrics["tool_calls_made"] == 1
    else:
        assert len(server.requests) == 2 and server.requests[1].max_tokens == 1
        assert out.response_mask == [1] * len(first) + [0] * tool_turn + [1]


def test_tool_failures_become_the_tools_text() -> None:
    failing, calc = FailingTool("add"), CalcTool()
    turn = call("add", x=1, y=2) + call("sum", x=1, y=2) + call(x=1, y=2)
    loop, server = make([turn, "the answer is 3"], (failing, calc), max_parallel_calls=3)
    out = run(loop)
    tool_turn = TOK.decode(out.prompt_ids + out.response_ids)
    assert "<|tool|>\nerror when executing tool: a digit</s>" in tool_turn  # the tiny tokenizer lower-cases
    assert "<|tool|>\nerror when executing tool: 'sum'</s>" in tool_turn  # verl's KeyError text
    assert "<|tool|>\n3</s>" in tool_turn
    assert out.extra["tool_rewards"] == [0.0, 0.0, 0.5]
    assert failing.log == [("create", {"create_kwargs": {}}), ("execute", "inst1", {"x": 1, "y": 2}),
                           ("release", "inst1")]
    assert out.metrics["tool_calls_made"] == 3


def test_bad_json_arguments_are_a_tool_error() -> None:
    """Hermes re-serialises the arguments, so bad JSON comes only from another parser; verl
    decodes them before looking the tool up."""
    calc = CalcTool()
    loop, _ = make([], (calc,))
    assert isinstance(loop, ToolAgentLoop)
    data = AgentData(messages=[], request_id="r", tools_kwargs={})
    try:
        json.loads("{bad")
    except json.JSONDecodeError as exc:
        expected = f"Error when executing tool: {exc}"
    response, reward, metrics = asyncio.run(loop._call_tool(FunctionCall("nope", "{bad"), data))
    assert (response.text, reward, metrics) == (expected, 0.0, {})
    assert calc.log == []


def test_parallel_calls_are_capped_and_run_concurrently() -> None:
    started: list[str] = []
    both = asyncio.Event()

    class Barrier(CalcTool):
        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                          ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
            started.append(instance_id)
            if len(started) == 2:
                both.set()
            await both.wait()  # the first call returns only once the second has started
            return ToolResponse(text=str(parameters["x"])), None, {}

    barrier = Barrier()
    loop, _ = make([call(x=1, y=0) + call(x=2, y=0) + call(x=3, y=0), "the answer is 3"], (barrier,),
                   max_parallel_calls=2)
    out = asyncio.run(asyncio.wait_for(loop.run(example(), SamplingParams(), "r"), timeout=60))
    text = TOK.decode(out.response_ids)
    assert "<|tool|>\n1</s>\n<|tool|>\n2</s>\n<|assistant|>" in text and "<|tool|>\n3" not in text
    assert out.metrics["tool_calls_made"] == 2 and len(started) == 2


def test_malformed_calls_are_counted_and_the_good_ones_run() -> None:
    calc = CalcTool()
    loop, _ = make([call(x=1, y=2) + "<tool_call>{oops</tool_call>", "the answer is 3"], (calc,))
    out = run(loop)
    assert out.metrics["tool_calls_malformed"] == 1 and out.metrics["tool_calls_made"] == 1


@pytest.mark.parametrize(("side", "expected"), [
    ("left", "0123456789...(truncated)"),
    ("right", "(truncated)...klmnopqrst"),
    ("middle", "01234...(truncated)...pqrst"),
])
def test_tool_response_truncation_uses_verls_markers(side: str, expected: str) -> None:
    assert truncate_tool_text("0123456789abcdefghijklmnopqrst", 10, side) == expected
    assert truncate_tool_text("0123456789", 10, side) == "0123456789"


def test_truncated_tool_text_is_what_the_model_sees() -> None:
    echo = TextTool("1 2 3 4 5 6 7 8 9")
    loop, _ = make([call("echo"), "the answer is 3"], (echo,), max_tool_response_length=6,
                   tool_response_truncate_side="middle")
    out = run(loop)
    assert "<|tool|>\n1 2...(truncated)...8 9</s>" in TOK.decode(out.response_ids)
    assert out.extra["tool_rewards"] == []  # a None reward is not recorded


def test_unknown_truncate_side_is_refused() -> None:
    with pytest.raises(AgentLoopError, match=r"tool_response_truncate_side=top` is none of .*left.*right.*middle"):
        make([], tool_response_truncate_side="top")


def test_single_turn_ignores_calls() -> None:
    loop, server = make([call(x=1, y=2)], (CalcTool(),), loop=SingleTurnAgentLoop)
    out = run(loop)
    assert len(server.requests) == 1 and out.response_mask == [1] * len(out.response_ids)


# ----------------------------------------------------------------------------- interactions


class ScriptedUser(Interaction):
    def __init__(self, replies: list[tuple[bool, str, float | None]]) -> None:
        super().__init__({"name": "teacher"})
        self.replies = replies
        self.log: list[tuple[Any, ...]] = []

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.log.append(("start", instance_id, kwargs))
        return instance_id or "new"

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        self.log.append(("respond", instance_id, [dict(m) for m in messages], kwargs))
        stop, text, score = self.replies.pop(0)
        return stop, text, score, {}  # type: ignore[return-value]

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("finalize", instance_id))


def test_interaction_answers_as_the_user_until_it_stops() -> None:
    user = ScriptedUser([(False, "please repeat", 0.0), (True, "reply with only the number", 1.0)])
    loop, server = make(["the answer is 2", "the answer is 3"], interactions={"teacher": user})
    kwargs = {"name": "teacher", "ground_truth": "3"}
    out = run(loop, example({"interaction_kwargs": kwargs}))
    assert out.extra == {"turn_scores": [0.0, 1.0], "tool_rewards": []}
    assert out.num_turns == 5
    assert user.log[0] == ("start", "traj-0", kwargs) and user.log[-1] == ("finalize", "traj-0")
    seen = user.log[2][2]
    assert seen == [*QUESTION, {"role": "assistant", "content": "the answer is 2"},
                    {"role": "user", "content": "please repeat"}, {"role": "assistant", "content": "the answer is 3"}]
    assert user.log[1][3] == kwargs
    assert TOK.decode(out.response_ids) == ("the answer is 2</s>\n<|user|>\nplease repeat</s>\n<|assistant|>\nthe answer is 3"
                                            "</s>\n<|user|>\nreply with only the number</s>\n<|assistant|>\n")
    assert len(server.requests) == 2
    user_tokens = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m]
    assert TOK.decode(user_tokens) == ("\n<|user|>\nplease repeat</s>\n<|assistant|>\n"
                                         "\n<|user|>\nreply with only the number</s>\n<|assistant|>\n")


def test_tool_calls_go_before_the_interaction() -> None:
    user = ScriptedUser([(True, "then the answer is 3", None)])
    loop, server = make([call(x=1, y=2), "the answer is 3"], (CalcTool(),), interactions={"teacher": user})
    out = run(loop, example({"interaction_kwargs": {"name": "teacher"}}))
    assert out.num_turns == 5 and out.extra == {"turn_scores": [], "tool_rewards": [0.5]}
    assert [m["role"] for m in user.log[1][2]] == ["user", "assistant", "tool", "assistant"]


def test_interaction_turn_filling_the_budget_ends_without_another_request() -> None:
    """verl checks no budget after a user turn; its next turn is all cut away: counted, not asked."""
    user = ScriptedUser([(False, "please repeat the answer", 0.0)])
    first = ids("the answer is 2") + [EOS]
    loop, server = make([first], interactions={"teacher": user}, response_length=len(first) + 3)
    out = run(loop, example({"interaction_kwargs": {"name": "teacher"}}))
    assert len(server.requests) == 1 and out.num_turns == 4
    assert len(out.response_ids) == len(first) + 3 and out.response_mask == [1] * len(first) + [0] * 3


def test_interaction_rows_must_name_a_known_interaction() -> None:
    loop, _ = make(["x"], interactions={"teacher": ScriptedUser([])})
    with pytest.raises(AgentLoopError, match=r"row 7: `extra_info.interaction_kwargs` has no `name`.*\['teacher'\]"):
        run(loop, example({"interaction_kwargs": {"query": "q"}}))
    with pytest.raises(AgentLoopError, match=r"interaction_kwargs.name=tutor` is not an interaction.*\['teacher'\]"):
        run(loop, example({"interaction_kwargs": {"name": "tutor"}}))


# ----------------------------------------------------------------------------- registry


class EchoLoop(AgentLoop):
    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        return AgentOutput(prompt_ids=list(example.prompt_ids), response_ids=[], response_mask=[])


NOT_A_LOOP = 3


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, type[AgentLoop]]:
    fresh = dict(loops._LOOPS)
    monkeypatch.setattr(loops, "_LOOPS", fresh)
    return fresh


def write(tmp_path: Path, entries: Any) -> Path:
    path = tmp_path / "agent_loops.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def test_loops_are_registered_by_verls_names() -> None:
    assert loop_class("single_turn_agent") is SingleTurnAgentLoop and loop_class("tool_agent") is ToolAgentLoop
    with pytest.raises(AgentLoopError, match=r"`agent_name=react` names no agent loop; registered: "
                                             r"\['single_turn_agent', 'tool_agent'\].*agent_loop_config_path"):
        loop_class("react")


def test_agent_loop_config_registers_custom_and_verls_own_loops(tmp_path: Path, registry: dict) -> None:
    path = write(tmp_path, [
        {"name": "echo", "_target_": "tests.trainer.agent.test_loops.EchoLoop"},
        {"name": "tools2", "_target_": "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"},
    ])
    assert load_agent_loops(path) == {"echo": EchoLoop, "tools2": ToolAgentLoop}
    assert loop_class("echo") is EchoLoop and loop_class("tools2") is ToolAgentLoop


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "x", "_target_": "verl.experimental.agent_loop.react.ReactAgentLoop"},
     r"is a verl class that cannot be imported here .*install verl .*subclass of `trainer.agent.base.AgentLoop`"),
    ({"name": "x", "_target_": "tests.trainer.agent.test_loops.NOT_A_LOOP"},
     r"is 3, not a subclass of `trainer.agent.base.AgentLoop`"),
    ({"name": "x", "_target_": "no_such_module.Loop"}, r"cannot be imported .*PYTHONPATH"),
    ({"name": "x", "_target_": "tests.trainer.agent.test_loops.Missing"}, r"cannot be imported"),
    ({"name": "x", "_target_": "tests.trainer.agent.test_loops.EchoLoop", "depth": 2},
     r"exactly the keys `name` and `_target_`, got \['_target_', 'depth', 'name'\]"),
])
def test_bad_agent_loop_entries_are_refused_and_nothing_registered(tmp_path: Path, registry: dict,
                                                                   entry: dict, message: str) -> None:
    good = {"name": "echo", "_target_": "tests.trainer.agent.test_loops.EchoLoop"}
    with pytest.raises(AgentLoopError, match=r"agent_loop_config_path=.*entry 1: .*" + message):
        load_agent_loops(write(tmp_path, [good, entry]))
    assert "echo" not in registry


def test_missing_or_shapeless_agent_loop_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentLoopError, match=r"no such file .*_target_"):
        load_agent_loops(tmp_path / "nope.yaml")
    with pytest.raises(AgentLoopError, match=r"expected a YAML list"):
        load_agent_loops(write(tmp_path, {"name": "x"}))
