"""Prompts near the length limit through the agent-loop rollout (`AgentRollout.run`: the real
loops, tools, templates and layout; the server scripted, with a context limit as the vLLM
replica's). The tool agent renders its prompt again with the tool schemas, which can make it
longer than `data.max_prompt_length`; verl cuts such a prompt to `rollout.prompt_length`
(`AgentLoopBase._cap_text_prompt_length`), so that every turn fits prompt + response length. Here
the trajectory then ends on its response budget, with the right masks, instead of a turn the
server refuses (`ValueError`) failing the whole rollout."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.trainer.agent.fakes import ScriptedServer
from tests.trainer.agent.test_loops import TOK, CalcTool, call
from trainer.agent.manager import AgentRollout
from trainer.config import load_config
from trainer.data import PromptDataset, chat_prompt_ids
from trainer.rollout.base import SamplingParams

PROMPT, RESPONSE = 140, 105
SHORT = "what is 1 plus 2?"
LONG = "what is 1 plus 2? what is 1 plus 2? what is 1 plus 2?"


def dataset(tmp_path: Path) -> PromptDataset:
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": text}], "ability": "math",
             "reward_model": {"ground_truth": "3"}, "agent_name": "tool_agent"} for text in (SHORT, LONG)]
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return PromptDataset([path], TOK, max_prompt_length=PROMPT, agents={"tool_agent"})


def test_a_prompt_the_tool_loop_renders_too_long_is_cut_and_its_turns_fit(tmp_path: Path) -> None:
    cfg = load_config([f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}"])
    data = dataset(tmp_path)
    calc = CalcTool()
    rendered = [len(chat_prompt_ids(TOK, e.prompt, {"tools": [calc.tool_schema]})) for e in data.examples]
    assert rendered[0] <= PROMPT < rendered[1]  # the second is longer than the limit once the tools are in
    rollout = AgentRollout(cfg, TOK)
    rollout.tools = {"calc": calc}
    # every trajectory: two tool calls, then a third the response budget cuts; the server's context
    # is prompt + response length (a `rollout.max_model_len` so set): the uncut long prompt would leave
    # no room for the third turn
    server = ScriptedServer(TOK, [call(x=1, y=2)] * 3, per_trajectory=True, max_model_len=PROMPT + RESPONSE)
    batch, _ = rollout.run(data.examples, SamplingParams(n=1, max_response_length=RESPONSE), server)

    assert batch.prompt_mask.sum(-1).tolist() == [rendered[0], PROMPT]  # cut to `data.max_prompt_length`
    call_len, tool_len = len(server.turn_ids(call(x=1, y=2))), 8
    model, tool = [1] * call_len, [0] * tool_len
    last = RESPONSE - 2 * (call_len + tool_len)  # the third turn: the budget left
    expected = model + tool + model + tool + [1] * last
    assert batch.response_mask.tolist() == [expected, expected]
    assert batch.response_attention.sum(-1).tolist() == [RESPONSE, RESPONSE]  # type: ignore[union-attr]
    assert batch.num_turns.tolist() == [6, 6]  # type: ignore[union-attr]  # 3 model + 2 tool turns + 1
    assert [r.max_tokens for r in server.requests][-2:] == [last, last]
    long_prompt = chat_prompt_ids(TOK, data.examples[1].prompt, {"tools": [calc.tool_schema]})
    assert batch.prompt_ids[1].tolist() == long_prompt[-PROMPT:]  # its last tokens, as verl cuts (left)
