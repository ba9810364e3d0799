"""A partial rollout's parts: the HF engine's abort between decode steps, then the continuation
from the prompt and the tokens so far, give what one uninterrupted generation gives; the join of
the parts' tokens and log-probs (:mod:`trainer.async_rl.partial`) by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import models
from trainer.async_rl.partial import Partial, Piece, continuation, extend, row_spans
from trainer.batch import StepBatch
from trainer.rollout.base import AbortableEngine, SamplingParams
from trainer.rollout.hf import HFRolloutEngine

PROMPTS = [[5, 26, 14, 3, 6], [5, 27, 3, 6], [5, 26, 30, 31, 17, 9, 21, 3, 6]]
PAD, EOS = 0, 3
BUDGET = 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(models.load_actor(tiny_model_dir), PAD, [EOS])


def aborting_after(engine: HFRolloutEngine, forwards: int) -> Any:
    """A hook that aborts the engine once the model has run `forwards` forward passes (the
    prefill, then one per decode step): the abort lands mid-generation, at a known step."""
    seen = [0]

    def hook(*_: Any) -> None:
        seen[0] += 1
        if seen[0] == forwards:
            engine.abort()

    return engine.model.register_forward_hook(hook)


def test_an_aborted_generation_continued_equals_the_uninterrupted_one(engine: HFRolloutEngine) -> None:
    assert isinstance(engine, AbortableEngine)
    greedy = SamplingParams(n=1, temperature=0.0, max_response_length=BUDGET)
    whole = engine.generate_tokens(PROMPTS, greedy, [BUDGET] * 3)
    assert all(len(o.token_ids) == BUDGET and o.finish_reason == "length" for o in whole)  # no EOS: a long run

    handle = aborting_after(engine, 5)  # the prefill and 4 decode steps: 5 tokens, then the abort
    try:
        first = engine.generate_tokens(PROMPTS, greedy, [BUDGET] * 3)
    finally:
        handle.remove()
    assert [(len(o.token_ids), o.finish_reason) for o in first] == [(5, "abort")] * 3
    assert engine.generate_tokens(PROMPTS, greedy, [BUDGET] * 3)[0].token_ids == []  # aborted until resumed
    engine.resume()

    rest = engine.generate_tokens([p + o.token_ids for p, o in zip(PROMPTS, first, strict=True)], greedy,
                                  [BUDGET - 5] * 3)
    for w, a, b in zip(whole, first, rest, strict=True):
        assert a.token_ids + b.token_ids == w.token_ids and b.finish_reason == "length"
        assert a.log_probs is not None and b.log_probs is not None and w.log_probs is not None
        assert torch.allclose(torch.tensor(a.log_probs + b.log_probs), torch.tensor(w.log_probs), atol=1e-5)


def test_a_batched_generation_marks_its_aborted_rows(engine: HFRolloutEngine) -> None:
    ids, mask = models.left_pad(PROMPTS, PAD)
    handle = aborting_after(engine, 3)
    try:
        batch = engine.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_response_length=BUDGET))
    finally:
        handle.remove()
        engine.resume()
    lengths, ended = batch.response_mask.sum(1), (batch.response_ids == EOS).any(1)
    assert batch.aborted is not None and batch.aborted.tolist() == (~ended).tolist() and batch.aborted.any()
    assert (lengths[batch.aborted] == 3).all() and (lengths <= 3).all()  # 3 tokens at most, nothing after
    assert (batch.log_probs[:, 3:] == 0).all() and (batch.log_probs[batch.aborted, :3] < 0).all()
    full = engine.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_response_length=BUDGET))
    assert full.aborted is None


def test_an_aborted_turn_leaves_the_single_turn_loop_as_an_aborted_row(engine: HFRolloutEngine) -> None:
    """Through the agent-loop path (single-turn loop, turns batched into the engine): the aborted
    turn's row is marked `aborted` in the packed batch, its tokens so far kept."""
    import asyncio

    from trainer.agent.base import AgentContext
    from trainer.agent.loops import SingleTurnAgentLoop
    from trainer.agent.manager import pack_outputs
    from trainer.agent.servers import BatchedServer
    from trainer.data import Example

    server = BatchedServer(engine)
    loop = SingleTurnAgentLoop(AgentContext(tokenizer=None, server=server, response_length=BUDGET, multi_turn=None))
    examples = [Example(i, "toy", [], "", {}, {}, p) for i, p in enumerate(PROMPTS)]

    async def run_all() -> list[Any]:
        for _ in examples:
            server.open()

        async def one(e: Example) -> Any:
            try:
                return await loop.run(e, SamplingParams(temperature=0.0, max_response_length=BUDGET), f"r{e.index}")
            finally:
                server.close()

        return list(await asyncio.gather(*(one(e) for e in examples)))

    handle = aborting_after(engine, 4)
    try:
        outputs = asyncio.run(run_all())
    finally:
        handle.remove()
        engine.resume()
    assert [(o.aborted, len(o.response_ids)) for o in outputs] == [(True, 4)] * 3
    batch = pack_outputs(outputs, torch.arange(3), PAD, BUDGET, want_log_probs=True)
    assert batch.aborted is not None and batch.aborted.tolist() == [True] * 3
    assert batch.response_mask.sum(1).tolist() == [4] * 3


def two_rows() -> StepBatch:
    """One prompt [7, 8] (left-padded to 3), two rows, a budget of 4: row 0 ended ([9, EOS]),
    row 1 paused after one token ([11])."""
    input_ids = torch.tensor([[0, 7, 8, 9, 3, 0, 0], [0, 7, 8, 11, 0, 0, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])
    log_probs = torch.tensor([[-0.1, -0.2, 0, 0], [-0.3, 0, 0, 0]])
    return StepBatch(examples=[None, None], uids=[0, 0], input_ids=input_ids, attention_mask=attention,
                     response_mask=attention[:, 3:].float(), rollout_log_probs=log_probs,
                     aborted=torch.tensor([False, True]))


def piece(tokens: list[int], log_probs: list[float], ended: bool = True) -> Piece:
    return Piece(tokens, torch.tensor(log_probs), None, ended)


def test_the_parts_of_a_paused_row_join_in_order() -> None:
    p = Partial.start(two_rows(), version=4)
    assert p.open == [1] and p.parts == [[(4, 2)], [(4, 1)]]
    assert continuation(p) == ([[7, 8, 11]], [3])  # the prompt unpadded, the token so far; 3 left
    extend(p, [piece([12], [-0.4], ended=False)], version=5)  # paused again at the next sync
    assert p.open == [1] and continuation(p) == ([[7, 8, 11, 12]], [2])
    extend(p, [piece([13, 3], [-0.5, -0.6])], version=6)
    assert p.finished and p.parts[1] == [(4, 1), (5, 1), (6, 2)]
    b = p.sample()
    assert b.aborted is None and b.input_ids[1].tolist() == [0, 7, 8, 11, 12, 13, 3]
    assert b.attention_mask[1].tolist() == [0, 1, 1, 1, 1, 1, 1] and b.response_mask[1].tolist() == [1, 1, 1, 1]
    assert b.rollout_log_probs is not None
    assert torch.allclose(b.rollout_log_probs[1], torch.tensor([-0.3, -0.4, -0.5, -0.6]))
    assert b.input_ids[0].tolist() == [0, 7, 8, 9, 3, 0, 0]  # the ended row untouched
    assert row_spans(tuple(tuple(r) for r in p.parts), 2, 6) == [0, 2]


def test_a_continuation_past_the_budget_is_refused() -> None:
    p = Partial.start(two_rows(), version=0)
    with pytest.raises(ValueError, match="exceed the budget of 4"):
        extend(p, [piece([1, 2, 3, 4], [-1.0] * 4)], version=1)
