"""hpcrl against verl 0.9.1's own code, in the venv where verl is installed (`make verl-venv`,
`.venv-verl`; the Makefile's verl stage runs this file there): tool schemas normalised as verl's
pydantic models dump them, and loops written against verl's interface run unchanged under the
agent-loop manager (verl's own `SingleTurnAgentLoop`, a loop subclassing `AgentLoopBase`, and
without verl a duck-typed one). The one seam faked is generation (a scripted token server).
Tests that need verl skip where it is not importable, except under CI=true with
HPCRL_REQUIRE_VERL=1 (the verl stage), where they fail."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.conftest import require_verl
from tests.trainer.agent.fakes import ScriptedServer
from trainer import tiny
from trainer.agent import loops
from trainer.agent.base import TokenOutput
from trainer.agent.loops import SingleTurnAgentLoop, load_agent_loops
from trainer.agent.manager import AgentRollout
from trainer.agent.tools.loading import AgentConfigError, check_schema
from trainer.agent.verl_compat import VerlLoopError, VerlServerManager, hf_model_type, verl_loop
from trainer.config import load_config
from trainer.data import Example, chat_prompt_ids
from trainer.rollout.base import SamplingParams

# ----------------------------------------------------------------------------- tool schemas


def _fn(parameters: Any = None, **function: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "f", "description": "d", **function}
    if parameters is not None:
        out["parameters"] = parameters
    return {"type": "function", "function": out}


def _params(properties: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **rest}


#: Schemas verl accepts: keys outside its models, its defaults, nulls, unions, orders.
ACCEPTED = [
    _fn(_params({"xs": {"type": "array", "items": {"type": "integer"}, "description": "values"}}, required=["xs"])),
    _fn(_params({"n": {"description": "count", "type": "integer", "minimum": 0, "maximum": 9, "default": 3}})),
    _fn(_params({"mode": {"type": "string", "enum": ["a", "b", None], "default": "a"}}, required=[])),
    _fn(_params({"u": {"type": ["integer", "number"], "description": None, "enum": None}})),
    _fn(_params({"enum_any": {"type": "integer", "enum": [1, 2.5, True, {"k": 1}, [1]]}})),
    _fn(_params({"obj": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}},
                required=["obj"], additionalProperties=False)),
    {"function": {"parameters": {"properties": {"b": {"type": "string"}, "a": {"type": "string"}},
                                 "type": "object"}, "description": "reordered", "name": "g"},
     "type": "function", "id": 3},
    _fn(),  # no parameters: none filled in
    _fn(_params({}), strict=True),
    _fn(_params({}), strict=0),
    _fn(_params({}), strict="yes"),
    _fn(_params({}), strict="Off"),
    _fn(_params({}), extra_key={"x": 1}),
]

#: Schemas verl's models refuse.
REFUSED = [
    {"function": _fn()["function"]},
    {"type": "function"},
    {"type": "function", "function": "f"},
    {"type": 3, "function": _fn()["function"]},
    _fn(_params({"a": {"description": "no type"}})),
    _fn(_params({"a": {"type": 3}})),
    _fn(_params({"a": {"type": ["string", 3]}})),
    _fn(_params({"a": {"type": "string", "description": 5}})),
    _fn(_params({"a": {"type": "string", "enum": "ab"}})),
    _fn(_params({}, required=None)),
    _fn(_params({}, required=[1])),
    _fn({"type": "object"}),
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": None}},
    _fn(_params({}), strict="maybe"),
    _fn(_params({}), strict=2),
    _fn(_params({}), strict=None),
    {"type": "function", "function": {"name": "f", "description": None}},
]


@pytest.mark.parametrize("schema", ACCEPTED, ids=lambda s: json.dumps(s)[:60])
def test_schemas_are_normalised_as_verls_models_dump_them(schema: dict[str, Any]) -> None:
    """hpcrl's normalised schema is verl's `model_dump(exclude_unset=True, exclude_none=True)`
    of it (`ToolAgentLoop.__init__`), key order included (the chat template renders it)."""
    require_verl()
    from verl.tools.schemas import OpenAIFunctionToolSchema

    verls = OpenAIFunctionToolSchema.model_validate(schema).model_dump(exclude_unset=True, exclude_none=True)
    ours = check_schema(schema, "test")
    assert json.dumps(ours) == json.dumps(verls)
    assert check_schema(ours, "test") == ours  # idempotent: the loop normalises again


@pytest.mark.parametrize("schema", REFUSED, ids=lambda s: json.dumps(s)[:60])
def test_schemas_verls_models_refuse_are_refused(schema: dict[str, Any]) -> None:
    require_verl()
    from pydantic import ValidationError
    from verl.tools.schemas import OpenAIFunctionToolSchema

    with pytest.raises(ValidationError):
        OpenAIFunctionToolSchema.model_validate(schema)
    with pytest.raises(AgentConfigError, match=r"test: `tool_schema.*; write it as verl's"):
        check_schema(schema, "test")


# ----------------------------------------------------------------------------- verl's loops, unchanged

TOK = tiny.build_tokenizer(tools=True)
EOS = TOK.eos_token_id
QUESTION = [{"role": "user", "content": "what is 1 plus 2?"}]
ROLLOUT = "actor_rollout_ref.rollout"


class RecordingServer(ScriptedServer):
    """The scripted server, keeping the sampling parameters of each request too."""

    def __init__(self, turns: list[str | list[int]], log_probs: bool = True) -> None:
        super().__init__(TOK, turns, log_probs=log_probs)
        self.params: list[SamplingParams] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        self.params.append(params)
        return await super().generate(request_id, prompt_ids, params, max_tokens)


def example(i: int = 0, agent: str = "single_turn_agent") -> Example:
    extra = {"index": 100 + i, "tools_kwargs": {"calc": {"create_kwargs": {"n": i}}}}
    return Example(index=i, data_source="toy", prompt=QUESTION, ability="math", reward_model={"ground_truth": "3"},
                   extra_info=extra, prompt_ids=chat_prompt_ids(TOK, QUESTION), agent_name=agent)


def ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def config(tmp_path: Path, entries: list[dict[str, Any]] | None = None, *extra: str) -> Any:
    args = ["data.max_prompt_length=64", "data.max_response_length=12", f"{ROLLOUT}.calculate_log_probs=true",
            f"actor_rollout_ref.model.path={tmp_path / 'no-model'}", *extra]
    if entries is not None:
        path = tmp_path / "agent_loops.yaml"
        path.write_text(yaml.safe_dump(entries, sort_keys=False))
        args.append(f"{ROLLOUT}.agent.agent_loop_config_path={path}")
    return load_config(args)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    fresh = dict(loops._LOOPS)
    monkeypatch.setattr(loops, "_LOOPS", fresh)
    return fresh


BUILT: list[Any] = []


class DuckLoop:
    """verl's loop interface without verl: the constructor `AgentLoopWorker` calls through hydra,
    `async run(sampling_params, **kwargs)`, an output read by attribute. Asks for `turns` turns."""

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, processor: Any, dataset_cls: Any,
                 data_config: Any, hf_model_type: str | None = None, turns: int = 1, **kwargs: Any) -> None:
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager, self.tokenizer, self.turns = server_manager, tokenizer, turns
        self.given = {"processor": processor, "dataset_cls": dataset_cls, "hf_model_type": hf_model_type,
                      "template_kwargs": data_config.config.get("apply_chat_template_kwargs"),
                      "tools": kwargs.pop("tools").tools, **kwargs}
        self.kwargs_seen: dict[str, Any] = {}
        BUILT.append(self)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        self.kwargs_seen = kwargs
        text = self.tokenizer.apply_chat_template(kwargs["raw_prompt"], add_generation_prompt=True, tokenize=False)
        prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
        response: list[int] = []
        log_probs: list[float] = []
        for _ in range(self.turns):
            out = await self.server_manager.generate(request_id="r", prompt_ids=prompt + response,
                                                     sampling_params=sampling_params)
            response += out.token_ids
            log_probs += out.log_probs or []
        n = min(len(response), self.rollout_config.response_length)
        return SimpleNamespace(prompt_ids=prompt, response_ids=response[:n], response_mask=[1] * n,
                               response_logprobs=log_probs[:n] or None, num_turns=1 + self.turns,
                               metrics={"generate_sequences": 0.5, "num_preempted": -1},
                               extra_fields={"turn_scores": []}, reward_score=None)


def test_a_duck_typed_verl_loop_runs_unchanged_under_the_agent_loop_manager(tmp_path: Path, registry: dict) -> None:
    """Built per trajectory from its YAML entry (its constructor argument `turns` too), given
    verl's config view, sampling dict and row fields; its turns reach the server with verl's
    `max_tokens`; its output laid out as verl lays it out."""
    BUILT.clear()
    cfg = config(tmp_path, [{"name": "twice", "_target_": f"{__name__}.DuckLoop", "turns": 2}])
    agents = AgentRollout(cfg, TOK)
    server = RecordingServer(["ab"] * 8)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5)
    batch, metrics = agents.run([example(0, "twice"), example(1, "twice")], params, server)
    assert len(BUILT) == 4 and all(loop.turns == 2 for loop in BUILT)  # one instance per trajectory
    first = BUILT[0]
    assert first.given == {"processor": None, "dataset_cls": None, "hf_model_type": None, "template_kwargs": {},
                           "tools": [], "name": "twice"}  # hydra passes the entry's `name` too, as in verl
    assert (first.rollout_config.prompt_length, first.rollout_config.response_length) == (64, 12)
    assert first.kwargs_seen["raw_prompt"] == QUESTION and first.kwargs_seen["data_source"] == "toy"
    assert first.kwargs_seen["index"] == 100 and first.kwargs_seen["tools_kwargs"] == {"calc": {"create_kwargs": {"n": 0}}}
    prompt = chat_prompt_ids(TOK, QUESTION)
    turn = ids("ab") + [EOS]
    by_prompt = sorted((len(r.prompt_ids), r.max_tokens) for r in server.requests)
    # verl's server: min(response_length, prompt_length + response_length - len(prompt))
    assert by_prompt == [(len(prompt), 12)] * 4 + [(len(prompt) + len(turn), min(12, 76 - len(prompt) - len(turn)))] * 4
    assert all((p.n, p.temperature, p.top_p, p.top_k, p.greedy) == (1, 0.7, 0.9, 5, False) for p in server.params)
    n = min(2 * len(turn), 12)
    assert batch.response_ids[:, :n].tolist() == [(turn * 2)[:n]] * 4
    assert batch.response_mask.sum(-1).tolist() == [n] * 4
    assert (batch.log_probs[:, :n] < 0).all() and batch.num_turns.tolist() == [3] * 4  # type: ignore[union-attr]
    assert batch.prompt_ids[0, -len(prompt):].tolist() == prompt
    assert all(m["generate_sequences"] == 0.5 and m["num_preempted"] == -1 for m in metrics)


class ScoredLoop(DuckLoop):
    """Scores its own trajectory (verl's `reward_score`, as SWE-agent loops do)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        out = await super().run(sampling_params, **kwargs)
        out.reward_score = 1.0
        return out


def test_loop_entries_with_arguments_are_for_verl_loops_only_and_own_scores_are_kept(tmp_path: Path,
                                                                                     registry: dict) -> None:
    path = tmp_path / "l.yaml"
    entry = {"name": "scored", "_target_": f"{__name__}.ScoredLoop", "turns": 3}
    path.write_text(yaml.safe_dump([entry]))
    cls = load_agent_loops(path)["scored"]
    assert cls.verl_class is ScoredLoop and cls.entry == entry and loops.loop_class("scored") is cls
    ctx = AgentRollout(config(tmp_path), TOK).context(RecordingServer(["ab"] * 3))
    out = asyncio.run(cls(ctx).run(example(), SamplingParams(), "id"))
    assert out.reward_score == 1.0  # the reward stage puts it in place of the reward function's


def test_the_server_manager_computes_verls_max_tokens_and_refuses_what_is_not_built() -> None:
    server = RecordingServer(["abc"] * 4)
    manager = VerlServerManager(server, prompt_length=8, response_length=6, max_model_len=16)
    out = asyncio.run(manager.generate("r", prompt_ids=[1] * 12, sampling_params={"temperature": 0.0,
                                                                                  "logprobs": False}))
    assert server.requests[-1].max_tokens == min(6, 8 + 6 - 12) and out.log_probs is None
    assert out.stop_reason == "completed" and server.params[-1].greedy
    asyncio.run(manager.generate("r", prompt_ids=[1] * 12, sampling_params={"max_tokens": 9, "logprobs": True}))
    assert server.requests[-1].max_tokens == 16 - 12  # clamped to the context left
    for kwargs, problem in [({"sampling_params": {"seed": 1}}, r"sampling key\(s\) \['seed'\]"),
                            ({"sampling_params": {"repetition_penalty": 1.1}}, "repetition_penalty=1.1"),
                            ({"sampling_params": {}, "image_data": [object()]}, r"\['image_data'\].*multimodal"),
                            ({"sampling_params": {}, "lora": 1}, r"unknown keyword\(s\) \['lora'\]")]:
        with pytest.raises(VerlLoopError, match=problem):
            asyncio.run(manager.generate("r", prompt_ids=[1, 2], **kwargs))
    with pytest.raises(VerlLoopError, match="no room to generate"):
        asyncio.run(manager.generate("r", prompt_ids=[1] * 16, sampling_params={}))


def test_verl_loops_get_the_models_type_as_verls_worker_reads_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert hf_model_type(load_config([f"actor_rollout_ref.model.path={tiny_model_dir}"])) == "llama"
    assert hf_model_type(config(tmp_path)) is None  # no config there: verl's None


def test_verls_own_single_turn_loop_runs_through_the_adapter_as_its_port_runs(tmp_path: Path) -> None:
    """verl 0.9.1's `SingleTurnAgentLoop` itself (its Continuous Token prompt, its output), built
    as verl's worker builds it, against the same script as this trainer's port of it."""
    require_verl()
    from verl.experimental.agent_loop import single_turn_agent_loop

    VerlSingleTurn = single_turn_agent_loop.SingleTurnAgentLoop  # noqa: N806
    target = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"
    cls = verl_loop(VerlSingleTurn, {"name": "verl_single", "_target_": target})
    cfg = config(tmp_path)
    outs, servers = [], []
    for loop_cls in (cls, SingleTurnAgentLoop):
        server = RecordingServer(["the answer is 3 and more words than fit"])
        ctx = AgentRollout(cfg, TOK).context(server)
        outs.append(asyncio.run(loop_cls(ctx).run(example(), SamplingParams(temperature=0.7), "traj")))
        servers.append(server)
    verls, ours = outs
    assert verls.prompt_ids == chat_prompt_ids(TOK, QUESTION)
    assert verls.response_ids == (ids("the answer is 3 and more words than fit") + [EOS])[:12]
    assert verls.response_mask == [1] * 12 and verls.num_turns == 2
    assert verls.response_logprobs == [-(k + 1) / 100 for k in range(12)]
    assert verls.extra["turn_scores"] == [] and verls.extra["tool_rewards"] == []
    assert (verls.prompt_ids, verls.response_ids, verls.response_mask, verls.response_logprobs, verls.num_turns) == \
        (ours.prompt_ids, ours.response_ids, ours.response_mask, ours.response_logprobs, ours.num_turns)
    assert [r.max_tokens for r in servers[0].requests] == [r.max_tokens for r in servers[1].requests] == [12]
    assert servers[0].params[0].temperature == 0.7 and not servers[0].params[0].greedy


def test_verls_own_tool_loop_without_tools_runs_through_the_adapter_as_its_port_runs(tmp_path: Path) -> None:
    """verl 0.9.1's `ToolAgentLoop` itself, no tool configured (its tools would need verl's
    pydantic schemas, which this trainer's tools do not carry): the same trajectory as the port's."""
    require_verl()
    from verl.experimental.agent_loop import tool_agent_loop

    target = "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"
    cls = verl_loop(tool_agent_loop.ToolAgentLoop, {"name": "verl_tool", "_target_": target})
    cfg = config(tmp_path, None, "data.max_response_length=64")
    outs = []
    for loop_cls in (cls, loops.ToolAgentLoop):
        ctx = AgentRollout(cfg, TOK).context(RecordingServer(["it is 3"]))
        outs.append(asyncio.run(loop_cls(ctx).run(example(0, "tool_agent"), SamplingParams(), "traj")))
    verls, ours = outs
    assert verls.response_ids == ids("it is 3") + [EOS] and verls.num_turns == 2
    assert (verls.prompt_ids, verls.response_ids, verls.response_mask, verls.response_logprobs, verls.num_turns,
            verls.extra) == (ours.prompt_ids, ours.response_ids, ours.response_mask, ours.response_logprobs,
                             ours.num_turns, ours.extra)


def test_a_loop_subclassing_verls_base_runs_from_its_yaml_entry(tmp_path: Path, registry: dict) -> None:
    """A loop written against verl's public interface (`AgentLoopBase`, its Continuous Token
    prompt, `server_manager.generate`, `AgentLoopOutput`), named in `agent_loop_config_path`
    with a constructor argument, through the manager: the rows laid out as verl lays them out."""
    require_verl()
    from tests.trainer.agent import verl_loops

    verl_loops.BUILT.clear()
    cfg = config(tmp_path, [{"name": "repeat", "_target_": "tests.trainer.agent.verl_loops.RepeatAgentLoop",
                             "turns": 2}])
    server = RecordingServer(["abc"] * 5)
    batch, metrics = AgentRollout(cfg, TOK).run([example(0, "repeat"), example(1, "repeat")],
                                                SamplingParams(n=1), server)
    assert len(verl_loops.BUILT) == 2 and all(loop.turns == 2 for loop in verl_loops.BUILT)
    assert verl_loops.BUILT[0].kwargs_seen["raw_prompt"] == QUESTION
    turn = ids("abc") + [EOS]
    prompt = chat_prompt_ids(TOK, QUESTION)
    assert batch.prompt_ids[:, -len(prompt):].tolist() == [prompt] * 2
    assert batch.response_ids[:, :2 * len(turn)].tolist() == [turn * 2] * 2
    assert batch.response_mask.sum(-1).tolist() == [2 * len(turn)] * 2 and batch.num_turns.tolist() == [3, 3]  # type: ignore[union-attr]
    assert all(m["generate_sequences"] > 0 and m["num_preempted"] == -1 for m in metrics)
    out = asyncio.run(verl_loops.BUILT[0].server_manager.generate(request_id="x", prompt_ids=prompt,
                                                                   sampling_params={"logprobs": True}))
    from verl.workers.rollout import replica

    assert isinstance(out, replica.TokenOutput)  # what the loop is given: verl's own class
