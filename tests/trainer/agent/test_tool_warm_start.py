"""The tool-use warm start of the learning benchmark (`bench.tool_sft`): its transcripts are the
conversations the `tool_agent` loop holds, token for token, and it trains on the model's tokens
only. Checked on SmolLM2's tokenizer by running the real loop, with the real calculator, on
a server scripted to say the transcript's assistant turns (the one seam faked)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.learning import CALCULATOR, TOOL_SYSTEM
from bench.tool_sft import tokens_and_mask, transcript
from tests.trainer.agent.fakes import ScriptedServer
from trainer.agent.manager import AgentRollout
from trainer.config import load_config
from trainer.data import Example, chat_prompt_ids
from trainer.rewards.arith import arith_rows
from trainer.rollout.base import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def tool_row(row: dict[str, Any]) -> dict[str, Any]:  # as `bench.learning.tool_rows` writes them
    return {**row, "agent_name": "tool_agent", "prompt": [{"role": "system", "content": TOOL_SYSTEM}, *row["prompt"]]}


def test_each_kind_of_question_gets_its_expression_and_the_ground_truth() -> None:
    rows = arith_rows(64, seed=0, split="train")
    kinds = {r["extra_info"]["kind"] for r in rows}
    assert kinds == {"add", "sub", "mul", "two_step"}
    for row in rows:  # transcript() raises where the expression's value is not the ground truth
        messages = transcript(tool_row(row))
        assert messages[-1]["content"].endswith(f"#### {row['reward_model']['ground_truth']}")


def test_a_transcript_is_the_loop_s_conversation_and_only_the_model_s_tokens_train(tok: Any) -> None:
    row = tool_row(arith_rows(1, seed=0, split="train")[0])
    messages = transcript(row)
    ids, mask = tokens_and_mask(tok, messages)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    turns = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in assistant]
    # the model's tokens, as one assistant turn each, are exactly what the mask covers
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert trained == turns[0] + turns[1]

    cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
                       "data.max_response_length=256"])
    agents = AgentRollout(cfg, tok)
    example = Example(index=0, data_source="hpcrl/arith", prompt=row["prompt"], ability="math",
                      reward_model=row["reward_model"], extra_info=row["extra_info"],
                      prompt_ids=chat_prompt_ids(tok, row["prompt"]), agent_name="tool_agent")
    ctx = agents.context(ScriptedServer(tok, turns))
    out = asyncio.run(agents.loop_for(example, ctx, {}).run(example, SamplingParams(), "r0"))
    assert out.num_turns == 4 and out.metrics["tool_calls_made"] == 1
    n = len(out.prompt_ids)
    assert ids[:n] == out.prompt_ids
    # the loop's trajectory is the full rendering but the template's newline after the last turn
    assert ids[n:] == [*out.response_ids, *tok.encode("\n", add_special_tokens=False)]
    assert mask[n : n + len(out.response_mask)] == out.response_mask and not any(mask[:n])
