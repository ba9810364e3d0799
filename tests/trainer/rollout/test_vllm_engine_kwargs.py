"""`actor_rollout_ref.rollout.engine_kwargs.vllm` reaches vLLM's engine arguments as verl 0.9.1
passes them (`verl/workers/rollout/vllm_rollout/vllm_async_server.py`): null values dropped,
`compilation_config` given `cudagraph_mode: FULL_AND_PIECEWISE` unless set, the rest over the
arguments set here. `engine_args` is the one path of the in-process engine and the server-mode
replica; no vLLM is needed to read its output."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.rollout.vllm import engine_args


def test_engine_kwargs_go_into_vllms_engine_arguments_as_verl_passes_them(tmp_path: Path) -> None:
    plain = engine_args(tmp_path, max_model_len=64)
    args = engine_args(tmp_path, max_model_len=64, max_num_seqs=8, engine_kwargs={
        "swap_space": 4, "kv_cache_dtype": None, "max_num_seqs": 16,
        "compilation_config": '{"level": 3}'})
    assert args["swap_space"] == 4 and "kv_cache_dtype" not in args  # null dropped
    assert args["max_num_seqs"] == 16  # over the rollout's own, as verl's `**engine_kwargs` last
    assert args["compilation_config"] == {"level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert {k: v for k, v in args.items() if k not in ("swap_space", "max_num_seqs", "compilation_config")} == {
        k: v for k, v in plain.items() if k != "max_num_seqs"}
    kept = engine_args(tmp_path, max_model_len=64, engine_kwargs={"compilation_config": {"cudagraph_mode": "PIECEWISE"}})
    assert kept["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "compilation_config" not in plain  # none given: vLLM's own, as before


def test_the_cpu_backend_stays_eager_whatever_engine_kwargs_say(tmp_path: Path) -> None:
    args = engine_args(tmp_path, max_model_len=64, engine_kwargs={"enforce_eager": False})
    assert args["enforce_eager"] is (not torch.cuda.is_available() or False)
