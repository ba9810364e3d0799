"""Reward inputs as verl 0.9.1 passes them, checked against verl itself: the same finished
trajectories are scored by this trainer (agent loops -> rollout stage -> reward stage) and by
verl's own agent-loop post-processing and reward loop (`verl_reward_side.py`, run by verl's
interpreter as a subprocess that prints JSON). The reward function records every `extra_info`
it receives (keys, types, values); the two sides must give equal token-level rewards and equal
records: `num_turns`, `turn_scores`, `tool_rewards`, `raw_prompt`, `rollout_reward_scores` and
the row's own keys, and no call for the row whose loop set its own `reward_score`.

verl's interpreter: `HPCRL_VERL_PYTHON`, else this one when it imports verl 0.9.1, else the
repository's `.venv-verl` (`make verl-venv`). Without one the test skips, except under CI=true
with HPCRL_REQUIRE_VERL=1 (the Makefile's verl stage), where it fails."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.agent.fakes import ScriptedServer
from tests.trainer.agent.test_loops import TOK, CalcTool, call, multi_turn
from tests.verl_env import verl_python
from trainer.agent.base import AgentContext, AgentLoop, AgentOutput, Interaction
from trainer.agent.loops import SingleTurnAgentLoop, ToolAgentLoop
from trainer.agent.manager import pack_outputs
from trainer.config import load_config
from trainer.data import Example, chat_prompt_ids
from trainer.rollout.base import SamplingParams
from trainer.stages.reward import load_reward, score_rollouts
from trainer.stages.rollout import Rollout

VERL_SIDE = Path(__file__).with_name("verl_reward_side.py")
RESPONSE_LENGTH = 200
LOG = "REWARD_INPUTS_LOG"

#: The reward function both sides load from a file (`custom_reward_function.path`): it records
#: what it received and scores from it, so a value that differs changes the reward too.
REWARD_FN = f'''
import json, os

def _plain(value):
    if isinstance(value, dict):
        return {{str(k): _plain(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # a numpy scalar
        return value.item()
    return value

def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):
    with open(os.environ["{LOG}"], "a") as log:
        log.write(json.dumps({{"index": extra_info.get("index"), "solution_str": solution_str,
                              "data_source": data_source, "ground_truth": ground_truth,
                              "extra_info": {{k: [type(v).__name__, _plain(v)] for k, v in extra_info.items()}}}}) + "\\n")
    turns = extra_info.get("num_turns")
    return (len(solution_str) / 1000 + sum(extra_info.get("tool_rewards") or []) +
            sum(extra_info.get("turn_scores") or []) + 0.01 * (turns if turns is not None else -1))
'''


class OwnScore(AgentLoop):
    """A loop that scores its trajectory itself (verl's `AgentLoopOutput.reward_score`, as
    SWE-agent loops do), with a field of its own in `extra_fields`."""

    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        out = await self.ctx.server.generate(request_id, list(example.prompt_ids), params, self.ctx.response_length)
        ids = list(out.token_ids)
        return AgentOutput(prompt_ids=list(example.prompt_ids), response_ids=ids, response_mask=[1] * len(ids),
                           num_turns=2, extra={"turn_scores": [], "tool_rewards": [], "judge": "the loop"},
                           reward_score=0.75)


class Teacher(Interaction):
    """Answers `try again` with a turn score of 0.25 per model answer so far; stops after two."""

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        answers = sum(m["role"] == "assistant" for m in messages)
        return answers >= 2, "try again", 0.25 * answers, {}


def context(turns: list[str | list[int]], **kw: Any) -> AgentContext:
    return AgentContext(tokenizer=TOK, server=ScriptedServer(TOK, turns), response_length=RESPONSE_LENGTH,
                        multi_turn=multi_turn(), **kw)


#: Per row: its loop, over a context with its scripted turns.
SCRIPTS: list[Any] = [
    lambda: OwnScore(context(["the answer is 3"])),
    lambda: ToolAgentLoop(context([call(x=1, y=2), call(x=3, y=4), "the answer is 3 and 7"],
                                  tools={"calc": CalcTool()})),
    lambda: ToolAgentLoop(context(["the answer is 5", "the answer is 3"], interactions={"teacher": Teacher({"name": "teacher"})})),
    lambda: SingleTurnAgentLoop(context(["the answer is 3"])),
]
EXTRA_INFO: list[dict[str, Any]] = [
    {"index": 0, "split": "train"},
    {"index": 1, "split": "train", "num_turns": "stale", "tools_kwargs": {"calc": {"create_kwargs": {}}}},
    {"index": 2, "split": "train", "interaction_kwargs": {"name": "teacher"}},
    {"index": 3, "split": "train"},
]
AGENTS = ["own_score", "tool_agent", "tool_agent", "single_turn_agent"]


def examples() -> list[Example]:
    question = [{"role": "user", "content": "what is 1 plus 2?"}]
    return [Example(index=i, data_source="toy", prompt=question, ability="math",
                    reward_model={"ground_truth": "3"}, extra_info=EXTRA_INFO[i],
                    prompt_ids=chat_prompt_ids(TOK, question), agent_name=AGENTS[i]) for i in range(len(SCRIPTS))]


class LoopGroup:
    """The actor group (the process seam): its one rank runs each row through its real loop and
    lays the trajectories out as the worker does (`pack_outputs`)."""

    world_size = 1

    def __init__(self) -> None:
        self.outputs: list[AgentOutput] = []

    def run_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[tuple[Any, dict[str, Any]]]:
        assert method == "generate_agent"
        ((rows, sampling, _seed, _trace),) = per_rank
        self.outputs = [asyncio.run(SCRIPTS[e.index]().run(e, sampling, f"traj-{e.index}")) for e in rows]
        batch = pack_outputs(self.outputs, torch.arange(len(rows)), TOK.pad_token_id, RESPONSE_LENGTH,
                             want_log_probs=False)
        return [(batch, {"gen": 0.0, "gen_tokens": 0.0, "rows": [o.metrics for o in self.outputs]})]


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_reward_inputs_and_scores_equal_verls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = verl_python()
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FN)
    tokenizer_dir = tmp_path / "tokenizer"
    TOK.save_pretrained(tokenizer_dir)

    # this trainer: the rollout stage over the agent loops, then the reward stage
    cfg = load_config(["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"data.max_response_length={RESPONSE_LENGTH}",
                       f"custom_reward_function.path={reward_file}", "custom_reward_function.name=compute_score"])
    group = LoopGroup()
    batch = Rollout(cfg, group, pad_token_id=TOK.pad_token_id).generate(  # type: ignore[arg-type]
        examples(), 1, lambda k, v: None)
    ours_log = tmp_path / "ours.jsonl"
    monkeypatch.setenv(LOG, str(ours_log))
    score_rollouts(batch, TOK, load_reward(cfg), cfg.reward_model, RESPONSE_LENGTH)

    # verl: the same trajectories through its post-processing and reward loop
    rows = [{"prompt_ids": o.prompt_ids, "response_ids": o.response_ids, "response_mask": o.response_mask,
             "num_turns": o.num_turns, "extra_fields": o.extra, "reward_score": o.reward_score,
             "kwargs": {"data_source": e.data_source, "reward_model": e.reward_model, "extra_info": e.extra_info,
                        "raw_prompt": e.prompt, "agent_name": e.agent_name, "index": e.index}}
            for o, e in zip(group.outputs, examples(), strict=True)]
    spec = {"tokenizer_dir": str(tokenizer_dir), "reward_path": str(reward_file), "reward_name": "compute_score",
            "prompt_length": max(len(o.prompt_ids) for o in group.outputs), "response_length": RESPONSE_LENGTH,
            "rows": rows}
    verl_log = tmp_path / "verl.jsonl"
    done = subprocess.run([python, str(VERL_SIDE)], input=json.dumps(spec), capture_output=True, text=True,
                          env={**os.environ, LOG: str(verl_log), "PYTHONPATH": ""}, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])

    ours_calls, verl_calls = read_log(ours_log), read_log(verl_log)
    assert [c["index"] for c in verl_calls] == [1, 2, 3]  # row 0 scored by its loop: no call on either side
    assert ours_calls == verl_calls  # same keys, types and values of every `extra_info`
    received = {c["index"]: c["extra_info"] for c in ours_calls}
    assert received[1]["num_turns"] == ["int64", 6] and received[1]["tool_rewards"] == ["list", [0.5, 0.5]]
    assert received[2]["turn_scores"] == ["list", [0.25, 0.5]] and received[2]["num_turns"][1] == 5
    assert received[3]["num_turns"][1] == 2 and received[3]["tool_rewards"] == ["list", []]
    assert torch.equal(batch.token_scores, torch.tensor(theirs["token_scores"], dtype=torch.float32))  # type: ignore[arg-type]
    assert batch.sequence_scores[0] == 0.75  # type: ignore[index]
