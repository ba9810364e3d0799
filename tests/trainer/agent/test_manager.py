"""Finished trajectories in verl's agent-loop layout, and the stages that read them: rewards on
the last attended token, lengths over the tool turns, `num_turns/*` and `agent_loop/*`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from trainer.agent.base import AgentOutput
from trainer.agent.manager import agent_loop_metrics, pack_outputs
from trainer.batch import StepBatch
from trainer.config import load_config
from trainer.data import Example
from trainer.metrics import data_metrics
from trainer.rollout.base import RolloutBatch, SamplingParams
from trainer.stages.reward import score_rollouts
from trainer.stages.rollout import Rollout, agent_loop_sampling

PAD = 0


def _two_turns() -> list[AgentOutput]:
    """Row 0: model turn [11, 12], tool turn [50, 51], model turn [13]; row 1: one model turn."""
    return [AgentOutput(prompt_ids=[1, 2, 3], response_ids=[11, 12, 50, 51, 13], response_mask=[1, 1, 0, 0, 1],
                        response_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], num_turns=4,
                        metrics={"generate_sequences": 0.5, "tool_calls": 0.25, "tool_calls_made": 1}),
            AgentOutput(prompt_ids=[4], response_ids=[14], response_mask=[1], response_logprobs=[-0.4],
                        num_turns=2, metrics={"generate_sequences": 0.125})]


def test_outputs_are_laid_out_as_verls_agent_loop_lays_them_out() -> None:
    out = pack_outputs(_two_turns(), torch.tensor([0, 1]), PAD, 6, want_log_probs=True)
    assert out.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]]  # left-padded
    assert out.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out.response_ids.tolist() == [[11, 12, 50, 51, 13, 0], [14, 0, 0, 0, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]  # the model's tokens
    assert out.attention_mask[:, 3:].tolist() == [[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]  # tool turns too
    assert torch.allclose(out.log_probs, torch.tensor([[-0.1, -0.2, 0, 0, -0.3, 0], [-0.4, 0, 0, 0, 0, 0]]))
    assert out.num_turns.tolist() == [4, 2]  # type: ignore[union-attr]
    assert pack_outputs(_two_turns(), torch.tensor([0, 1]), PAD, 6, want_log_probs=False).log_probs.abs().sum() == 0


def test_a_loop_output_longer_than_the_budget_or_its_mask_is_refused() -> None:
    bad = replace(_two_turns()[0], response_mask=[1, 1])
    with pytest.raises(ValueError, match="a mask of 2"):
        pack_outputs([bad], torch.tensor([0]), PAD, 6, want_log_probs=False)
    with pytest.raises(ValueError, match="a budget of 4"):
        pack_outputs(_two_turns(), torch.tensor([0, 1]), PAD, 4, want_log_probs=False)


class Words:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def _example(i: int) -> Example:
    return Example(index=i, data_source="toy", prompt=[{"role": "user", "content": "q"}], ability="",
                   reward_model={"ground_truth": "7"}, extra_info={}, prompt_ids=[1], agent_name="tool_agent")


def _step_batch(out: RolloutBatch) -> StepBatch:
    return StepBatch(examples=[_example(0), _example(1)], uids=[0, 1], input_ids=out.input_ids,
                     attention_mask=out.attention_mask, response_mask=out.response_mask.float(),
                     num_turns=out.num_turns)


def test_rewards_read_the_whole_conversation_and_land_on_its_last_attended_token() -> None:
    """verl's reward managers decode `attention_mask[prompt_length:]` and its agent loop puts
    `rm_scores` at `valid_response_length - 1`."""
    batch = _step_batch(pack_outputs(_two_turns(), torch.tensor([0, 1]), PAD, 6, want_log_probs=False))
    seen: list[str] = []

    def count(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
        seen.append(solution_str)
        return float(len(solution_str.split()))

    cfg = load_config([])
    score_rollouts(batch, Words(), count, cfg.reward_model, 6)
    assert seen == ["w11 w12 w50 w51 w13", "w14"]
    assert batch.token_scores.tolist() == [[0, 0, 0, 0, 5.0, 0], [1.0, 0, 0, 0, 0, 0]]  # type: ignore[union-attr]


def test_a_loop_s_own_score_wins_and_the_reward_function_gets_the_loop_s_fields() -> None:
    """verl 0.9.1: a trajectory whose loop set `reward_score` is not scored again
    (`AgentLoopWorker._compute_score`); the others' `extra_info` carries the loop's
    `extra_fields`, `raw_prompt` and `num_turns` (`reward_loop/reward_manager/naive.py`)."""
    outs = _two_turns()
    outs[0].reward_score = 2.5
    outs[1].extra = {"turn_scores": [0.5], "tool_rewards": [1.0]}
    packed = pack_outputs(outs, torch.tensor([0, 1]), PAD, 6, want_log_probs=False)
    assert packed.reward_scores == [2.5, None] and packed.extra_fields == [{}, outs[1].extra]
    batch = _step_batch(packed)
    batch.agent_extras, batch.loop_scores = packed.extra_fields or [], packed.reward_scores or []
    seen: list[dict[str, Any]] = []

    def judge(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> dict[str, float]:
        seen.append(extra_info)
        return {"score": 3.0, "acc": 1.0}

    metrics = score_rollouts(batch, Words(), judge, load_config([]).reward_model, 6)
    assert len(seen) == 1 and seen[0]["turn_scores"] == [0.5] and seen[0]["tool_rewards"] == [1.0]
    assert type(seen[0]["num_turns"]) is np.int64 and seen[0]["num_turns"] == 2
    assert seen[0]["raw_prompt"] == [{"role": "user", "content": "q"}] and seen[0]["rollout_reward_scores"] == {}
    assert batch.token_scores.tolist() == [[0, 0, 0, 0, 2.5, 0], [3.0, 0, 0, 0, 0, 0]]  # type: ignore[union-attr]
    assert batch.reward_extras == {"acc": [None, 1.0]} and metrics == {"reward_extra/acc/mean": 1.0}


def test_lengths_count_the_tool_turns_and_advantages_only_the_model_s_tokens() -> None:
    batch = _step_batch(pack_outputs(_two_turns(), torch.tensor([0, 1]), PAD, 6, want_log_probs=False))
    adv = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    m = data_metrics(sequence_score=torch.ones(2), sequence_reward=torch.ones(2), advantages=adv, returns=adv,
                     response_mask=batch.response_mask, prompt_mask=batch.attention_mask[:, :3],
                     max_response_length=6, max_prompt_length=3, response_attention=batch.response_attention)
    assert m["response_length/mean"] == 3.0  # (5 + 1) / 2: verl's `_compute_response_info`
    assert m["critic/advantages/max"] == 6.0 and m["critic/advantages/min"] == 0.0  # [0, 1, 4] and [6]


def test_agent_loop_metrics_are_verls_and_the_tool_call_figures() -> None:
    rows = [o.metrics for o in _two_turns()] + [{"generate_sequences": 0.25, "tool_calls_made": 2,
                                                  "tool_calls_malformed": 1}]
    m = agent_loop_metrics(rows, torch.tensor([3, 1, 2]), torch.tensor([5, 1, 7]))
    assert m["agent_loop/generate_sequences/max"] == 0.5 and m["agent_loop/tool_calls/mean"] == pytest.approx(0.25 / 3)
    assert m["agent_loop/slowest/generate_sequences"] == 0.5 and m["agent_loop/slowest/response_length"] == 5
    assert m["agent_loop/tool_calls_made/mean"] == 1.0 and m["agent_loop/tool_call_rate"] == pytest.approx(2 / 3)
    assert m["agent_loop/tool_calls_malformed/ratio"] == 0.25  # 1 of 4 calls


class AgentGroup:
    """An actor group (the process seam) whose engines run each example's trajectories: prompt
    width grows with the example's index, so the engines' prompts differ in width."""

    world_size = 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], int]] = []
        self.traces: list[Any] = []
        self.samplings: list[SamplingParams] = []

    def run_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[tuple[Any, dict[str, Any]]]:
        if method != "generate_agent":
            raise ValueError(f"this group has no `{method}`")
        results = []
        for examples, sampling, _seed, trace in per_rank:
            self.traces.append(trace)
            self.samplings.append(sampling)
            self.calls.append((method, [e.index for e in examples], sampling.n))
            outs = [AgentOutput(prompt_ids=[7] * (e.index + 1), response_ids=[20 + e.index, 50, 30],
                                response_mask=[1, 0, 1], num_turns=3,
                                metrics={"generate_sequences": float(e.index), "tool_calls_made": 1})
                    for e in examples for _ in range(sampling.n)]
            batch = pack_outputs(outs, torch.arange(len(examples)).repeat_interleave(sampling.n), PAD, 4,
                                 want_log_probs=False)
            results.append((batch, {"gen": 0.5, "gen_tokens": float(batch.response_mask.sum()),
                                    "rows": [o.metrics for o in outs]}))
        return results


def test_the_rollout_stage_sends_agent_rows_to_the_agent_loops_and_unifies_prompt_widths() -> None:
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                       "data.max_response_length=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    group = AgentGroup()
    stage = Rollout(cfg, group, pad_token_id=PAD)  # type: ignore[arg-type]
    batch = stage.generate([_example(i) for i in range(4)], 1, lambda k, v: 0.0)
    assert [c[:2] for c in group.calls] == [("generate_agent", [0, 1]), ("generate_agent", [2, 3])]
    assert [(t.step, t.validate, t.store) for t in group.traces] == [(1, False, None)] * 2  # no tracing
    assert batch.uids == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.input_ids.shape[1] == 4 + 4  # the widest prompt (index 3: 4 tokens) + the response
    assert batch.attention_mask[:, :4].sum(-1).tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert batch.responses[:, 0].tolist() == [20, 20, 21, 21, 22, 22, 23, 23]
    assert batch.num_turns.tolist() == [3] * 8  # type: ignore[union-attr]
    assert stage.agent_metrics["agent_loop/slowest/generate_sequences"] == 3.0
    assert stage.agent_metrics["agent_loop/slowest/prompt_length"] == 4.0
    single = [replace(_example(i), agent_name="single_turn_agent") for i in range(2)]
    with pytest.raises(ValueError):  # single-turn rows go to the batched generate, which this group lacks
        stage.generate(single, 2, lambda k, v: 0.0)
    assert group.calls[-1][0] == "generate_agent" and len(group.calls) == 2


def test_agent_loops_sample_as_verls_do_whatever_do_sample_says() -> None:
    """verl's agent loop builds its sampling from temperature, top_p and top_k only (`rollout.*`,
    `val_kwargs.*` when validating; `AgentLoopWorker.generate_sequences`): `do_sample=false`
    samples at the temperature; ReMax's greedy baseline is verl's `apply_greedy_sampling_params`."""
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                       "data.max_response_length=4", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.temperature=0.7",
                       "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=5",
                       "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=0.6"])
    group = AgentGroup()
    stage = Rollout(cfg, group, pad_token_id=PAD)  # type: ignore[arg-type]
    examples = [_example(i) for i in range(2)]
    stage.generate(examples, 1, lambda k, v: 0.0)
    train = group.samplings[-1]
    assert (train.n, train.temperature, train.top_p, train.top_k, train.greedy) == (2, 0.7, 0.9, 5, False)
    stage.generate(examples, 1, lambda k, v: 0.0, validate=True)
    val = group.samplings[-1]
    assert (val.n, val.temperature, val.top_p, val.top_k, val.greedy) == (1, 0.6, 1.0, -1, False)
    stage.generate(examples, 1, lambda k, v: 0.0, greedy=True)
    base = group.samplings[-1]
    assert (base.n, base.temperature, base.top_p, base.top_k, base.greedy) == (1, 0.0, 1.0, -1, True)
    assert agent_loop_sampling(SamplingParams(temperature=0.5, do_sample=False), False).greedy is False
