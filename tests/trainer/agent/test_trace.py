"""Rollout tracing (`rollout.trace.*`, verl's MLflow backend): each traced trajectory is one
MLflow trace with verl's tags, a span per model turn and per tool call, in the run's store. The
server is scripted (the one seam faked); loops, the calculator and MLflow's SQLite store are real."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.trainer.agent.fakes import ScriptedServer
from trainer import tiny
from trainer.agent.base import TokenOutput, Tool, ToolResponse
from trainer.agent.manager import AgentRollout, TraceInfo
from trainer.config import ConfigError, load_config
from trainer.data import Example, chat_prompt_ids
from trainer.mlflow_tracking import MlflowUnavailable
from trainer.rollout.base import SamplingParams

TOK = tiny.build_tokenizer(tools=True)  # word-level: its vocabulary has `calc`, `x`, `y`, digits
SCHEMA = {"type": "function", "function": {"name": "calc", "description": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}}


class AddTool(Tool):
    """`calc`: x + y, loaded from a tool config file by its dotted path, as a user's tool is."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        return ToolResponse(text=str(parameters["x"] + parameters["y"])), None, {}


def rows(count: int) -> list[Example]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"what is {i} plus 2"}]
        out.append(Example(index=i, data_source="t", prompt=messages, ability="math", reward_model={},
                           extra_info={"index": 100 + i}, prompt_ids=chat_prompt_ids(TOK, messages),
                           agent_name="tool_agent"))
    return out


def call(x: int, y: int) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'calc', 'arguments': {'x': x, 'y': y}})}\n</tool_call>"


class CallThenAnswer(ScriptedServer):
    """Each trajectory's first turn calls `calc` with its question's number and 2, its second
    answers the sum: by request id, since concurrent trajectories' turns interleave."""

    def __init__(self) -> None:
        super().__init__(TOK, [])
        self.turns_of: dict[str, int] = {}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        turn = self.turns_of[request_id] = self.turns_of.get(request_id, 0) + 1
        i = int(re.search(r"what is (\d+) plus 2", TOK.decode(prompt_ids)).group(1))  # type: ignore[union-attr]
        return TokenOutput(token_ids=self.turn_ids(call(i, 2) if turn == 1 else str(i + 2)))


def config(tmp_path: Path, *extra: str):
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": f"{__name__}.AddTool", "config": {"type": "native"},
                                                "tool_schema": SCHEMA}]}))
    return load_config([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                        "data.max_response_length=256", "trainer.project_name=proj",
                        "trainer.experiment_name=exp", *extra])


def test_traced_trajectories_are_mlflow_traces_with_verl_s_tags_and_a_span_per_turn_and_call(tmp_path: Path,
                                                                                             monkeypatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the process's working directory gets nothing (MLflow's default: ./mlruns)
    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cfg = config(tmp_path, "actor_rollout_ref.rollout.trace.backend=mlflow", "actor_rollout_ref.rollout.trace.token2text=true",
                 "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=1")
    agents = AgentRollout(cfg, TOK)
    server = CallThenAnswer()  # 3 prompts x 2 samples: each trajectory calls `calc`, then answers
    batch, metrics = agents.run(rows(3), SamplingParams(n=2), server, trace=TraceInfo(step=3, store=store))
    assert batch.input_ids.shape[0] == 6 and all(m["tool_calls_made"] == 1 for m in metrics)

    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("proj").experiment_id
    traces = mlflow.search_traces(locations=[experiment], return_type="list")
    assert len(traces) == 2  # one prompt of three traced (max 1 per step), both its samples, nothing else
    tags = [t.info.tags for t in traces]
    assert {t["rollout_n"] for t in tags} == {"0", "1"}
    assert len({t["sample_index"] for t in tags}) == 1 and tags[0]["sample_index"] in {"100", "101", "102"}
    assert all(t["step"] == "3" and t["validate"] == "False" and t["experiment_name"] == "exp" for t in tags)
    for trace in traces:
        spans = {s.name: s for s in trace.data.spans}
        assert sorted(s.name for s in trace.data.spans) == ["agent_loop", "generate", "generate", "tool:calc"]
        root, tool = spans["agent_loop"], spans["tool:calc"]
        assert root.parent_id is None and tool.parent_id == root.span_id
        i = int(trace.info.tags["sample_index"]) - 100
        assert tool.inputs["parameters"] == {"x": i, "y": 2} and tool.outputs["text"] == str(i + 2)
        assert root.outputs["num_turns"] == 4 and root.outputs["response_text"].endswith(f"{i + 2}</s>")
        assert f"what is {i} plus 2" in root.inputs["prompt_text"]
        first = min((s for s in trace.data.spans if s.name == "generate"), key=lambda s: s.start_time_ns)
        assert first.outputs["text"].startswith("<tool_call>")
    assert list(elsewhere.iterdir()) == []


def test_without_a_backend_nothing_is_traced_and_mlflow_is_not_imported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    agents = AgentRollout(config(tmp_path), TOK)
    server = ScriptedServer(TOK, ["2"])
    batch, _ = agents.run(rows(1), SamplingParams(n=1), server, trace=TraceInfo(step=1))
    assert batch.input_ids.shape[0] == 1 and agents.tracer is not None and not agents.tracer.on


def test_mlflow_missing_stops_the_first_traced_rollout_naming_the_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    agents = AgentRollout(config(tmp_path, "actor_rollout_ref.rollout.trace.backend=mlflow"), TOK)
    with pytest.raises(MlflowUnavailable, match=r"trace.backend=mlflow.*pip install mlflow-skinny"):
        agents.run(rows(1), SamplingParams(n=1), ScriptedServer(TOK, ["2"]), trace=TraceInfo(step=1))


def test_weave_is_refused_naming_mlflow(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Weave.*trace.backend=mlflow"):
        config(tmp_path, "actor_rollout_ref.rollout.trace.backend=weave")
