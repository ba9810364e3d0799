"""vLLM's sleep between rollouts discards the weights (level 2, as verl): no pinned host copy of
every weight (which torch's caching host allocator rounds to powers of two), and an engine whose
weights were discarded refuses to generate until the next weight sync. The vLLM `LLM` object is
the one seam faked here (`vllm` is not installed in this environment); a GPU is declared
(`torch.cuda.is_available`) since vLLM sleeps only there."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from trainer.rollout import vllm as V
from trainer.rollout.base import SamplingParams


class FakeLLM:
    """vLLM's `LLM`: records what the engine asks of it."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, fn: Any, args: tuple[Any, ...] = ()) -> None:
        self.calls.append(("rpc", fn.__name__))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> V.VLLMRolloutEngine:
    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for key in V.engine_env():  # the engine sets its defaults in os.environ: undone after the test
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "config.json").write_text("{}")
    return V.VLLMRolloutEngine(tmp_path, pad_token_id=0, eos_token_ids=[1], max_model_len=16)


def test_the_engine_sleeps_at_level_2_and_needs_a_sync_before_generating(engine: V.VLLMRolloutEngine) -> None:
    llm: FakeLLM = engine.llm
    assert llm.kwargs["enable_sleep_mode"] is True
    assert not engine.needs_sync
    engine.sleep()
    assert llm.calls == [("sleep", 2)]
    assert engine.needs_sync
    engine.wake_up()
    prompts = torch.tensor([[3, 4]])
    with pytest.raises(RuntimeError, match=r"slept at level 2 .* call `sync_weights` before `generate`"):
        engine.generate(prompts, torch.ones_like(prompts), SamplingParams(n=1, max_response_length=2))
    engine.sync_weights([[("w", torch.zeros(2))]])
    assert not engine.needs_sync
    assert [c for c in llm.calls if c[0] == "rpc"] == [("rpc", "_begin_reload"), ("rpc", "_load_bucket"),
                                                      ("rpc", "_end_reload")]


def test_an_engine_without_free_cache_engine_never_sleeps(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for key in V.engine_env():
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "config.json").write_text("{}")
    engine = V.VLLMRolloutEngine(tmp_path, pad_token_id=0, eos_token_ids=[1], max_model_len=16,
                                 free_cache_engine=False)
    engine.sleep()
    assert engine.llm.calls == [] and not engine.needs_sync
