"""What the vLLM engine asks of vLLM's `LLM`, the one seam faked here (`vllm` is not installed in
this environment; the real engine is exercised by `test_vllm.py` in the vLLM environment):

- sleep between rollouts at level 2, as verl: no pinned host copy of every weight (torch's
  caching host allocator rounds each to a power of two), and no generation until the next weight
  sync has replaced the discarded weights;
- verl's speed defaults: CUDA graphs (`enforce_eager: false`), one sampling-parameter object for
  the whole batch with no per-request seed, and log-probs only with `calculate_log_probs`.

A GPU is declared (`torch.cuda.is_available`) where the behaviour is the GPU's (sleeping)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from trainer.rollout import vllm as V
from trainer.rollout.base import SamplingParams


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.output_kind: Any = None

    def clone(self) -> FakeSamplingParams:
        return FakeSamplingParams(**self.kwargs)


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: Any = None
    finish_reason: str | None = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool


class FakeEngine:
    """vLLM's `LLMEngine` as the engine loop drives it (`add_request`, `step`): each request gets
    token 5, then EOS (1) at the next step, in deltas."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls: list[tuple[str, Any]] = calls
        self.pending: dict[str, tuple[int, Any]] = {}

    def add_request(self, request_id: str, prompt: Any, params: Any) -> str:
        self.calls.append(("add_request", params))
        self.pending[request_id] = (0, params)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[_Output]:
        out = []
        for rid, (done, params) in list(self.pending.items()):
            token, lp = (5, -0.5) if done == 0 else (1, -0.25)
            logprobs = params.kwargs["logprobs"] is not None
            out.append(_Output(rid, [_Completion([token], [{token: types.SimpleNamespace(logprob=lp)}] if logprobs else None,
                                                 "stop" if done else None)], bool(done)))
            self.pending[rid] = (done + 1, params)
            if done:
                del self.pending[rid]
        return out


class FakeLLM:
    """vLLM's `LLM`: records what the engine asks of it; generates token 5 then EOS (1)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = []
        self.llm_engine = FakeEngine(self.calls)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, fn: Any, args: tuple[Any, ...] = ()) -> None:
        self.calls.append(("rpc", fn.__name__))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


def make_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, *, gpu: bool = True, **kwargs: Any
                ) -> V.VLLMRolloutEngine:
    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM  # type: ignore[attr-defined]
    fake.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    for key in {**V.engine_env(), "VLLM_CPU_KVCACHE_SPACE": "", "VLLM_CPU_OMP_THREADS_BIND": "",
                "TORCHDYNAMO_DISABLE": ""}:  # the engine sets its defaults in os.environ: undone after
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "config.json").write_text("{}")
    return V.VLLMRolloutEngine(tmp_path, pad_token_id=0, eos_token_ids=[1], max_model_len=16, **kwargs)


PROMPTS = torch.tensor([[0, 3, 4], [6, 7, 8]])
SAMPLE = SamplingParams(n=2, max_response_length=3)


def test_the_engine_sleeps_at_level_2_and_needs_a_sync_before_generating(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    engine = make_engine(monkeypatch, tmp_path)
    llm: FakeLLM = engine.llm
    assert llm.kwargs["enable_sleep_mode"] is True
    assert not engine.needs_sync
    engine.sleep()
    assert llm.calls == [("sleep", 2)]
    assert engine.needs_sync
    engine.wake_up()
    with pytest.raises(RuntimeError, match=r"slept at level 2 .* call `sync_weights` before `generate`"):
        engine.generate(PROMPTS, (PROMPTS > 0).long(), SAMPLE)
    engine.sync_weights([[("w", torch.zeros(2))]])
    assert not engine.needs_sync
    assert [c for c in llm.calls if c[0] == "rpc"] == [("rpc", "_begin_reload"), ("rpc", "_load_bucket"),
                                                      ("rpc", "_end_reload")]
    assert engine.generate(PROMPTS, (PROMPTS > 0).long(), SAMPLE).response_ids.shape == (4, 3)


def test_an_engine_without_free_cache_engine_never_sleeps(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    engine = make_engine(monkeypatch, tmp_path, free_cache_engine=False)
    engine.sleep()
    assert engine.llm.calls == [] and not engine.needs_sync


def test_verls_defaults_cuda_graphs_one_unseeded_sampling_and_no_log_probs(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Any) -> None:
    from trainer.config import load_config

    cfg = load_config([f"actor_rollout_ref.model.path={tmp_path}"])
    assert cfg.actor_rollout_ref.rollout.enforce_eager is False  # verl's rollout.yaml
    engine = make_engine(monkeypatch, tmp_path, enforce_eager=cfg.actor_rollout_ref.rollout.enforce_eager)
    assert engine.llm.kwargs["enforce_eager"] is False
    out = engine.generate(PROMPTS, (PROMPTS > 0).long(), SAMPLE)
    asked = [p for name, p in engine.llm.calls if name == "add_request"]
    assert len(asked) == 4 and all(p.kwargs == asked[0].kwargs and p.output_kind == "delta" for p in asked)
    params = asked[0]  # the same sampling for every row, its tokens in deltas (the engine loop's)
    assert "seed" not in params.kwargs and params.kwargs["logprobs"] is None and params.kwargs["n"] == 1
    assert out.prompt_index.tolist() == [0, 0, 1, 1] and not out.log_probs.any()


def test_log_probs_are_asked_for_with_calculate_log_probs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    engine = make_engine(monkeypatch, tmp_path, calculate_log_probs=True)
    out = engine.generate(PROMPTS, (PROMPTS > 0).long(), SAMPLE)
    params = next(p for name, p in engine.llm.calls if name == "add_request")
    assert params.kwargs["logprobs"] == 0
    assert out.log_probs[0, :2].tolist() == [-0.5, -0.25]


def test_the_cpu_backend_runs_eagerly(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    engine = make_engine(monkeypatch, tmp_path, gpu=False)
    assert engine.llm.kwargs["enforce_eager"] is True and engine.llm.kwargs["enable_sleep_mode"] is False


def test_the_context_is_the_model_s_as_verl_sizes_it(tiny_model_dir: Any) -> None:
    """verl 0.9.1 `vLLMHttpServer._validate_configs`: `rollout.max_model_len` null takes the
    model's `max_position_embeddings` (not prompt + response length); a larger one is refused."""
    from trainer.config import load_config

    assert V.max_model_len(None, {"max_position_embeddings": 4096}) == 4096
    assert V.max_model_len(None, {"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert V.max_model_len(1000, {"max_position_embeddings": 4096}) == 1000
    with pytest.raises(ValueError, match=r"`actor_rollout_ref.rollout.max_model_len=5000` is above .*=4096"):
        V.max_model_len(5000, {"max_position_embeddings": 4096})
    with pytest.raises(ValueError, match="set `actor_rollout_ref.rollout.max_model_len`"):
        V.max_model_len(None, {})
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_prompt_length=16",
                       "data.max_response_length=16"])
    tok = type("Tok", (), {"pad_token_id": 0})()
    assert V.rollout_knobs(cfg, tok, [1])["max_model_len"] == 512  # the tiny model's context, not 32
