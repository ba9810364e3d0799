"""Metrics: JSONL continuity across resume, console format, TensorBoard, wandb offline,
and the verl-named metric computations."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from trainer.metrics import (
    MetricsError,
    MetricsLogger,
    data_metrics,
    read_jsonl,
    throughput_metrics,
    timing_metrics,
)


def _log_steps(run_dir: Path, steps: range, keep_through: int) -> None:
    logger = MetricsLogger(run_dir, ["jsonl"], keep_through=keep_through)
    for step in steps:
        logger.log(step, {"critic/score/mean": step / 10})
    logger.close()


def test_resume_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 8), keep_through=-1)  # ran to step 7, checkpoint at 5
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 8, "critic/sco')  # killed mid-line
    _log_steps(tmp_path, range(6, 10), keep_through=5)  # resumed from step 5
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 10))


def test_fresh_run_starts_a_new_file(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 4), keep_through=-1)
    _log_steps(tmp_path, range(1, 3), keep_through=-1)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_console_output_and_plain_values(tmp_path: Path) -> None:
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, ["console"], keep_through=-1, stream=out)
    logger.log(3, {"actor/pg_loss": torch.tensor(0.25), "response_length/mean": 4.0})
    logger.close()
    assert out.getvalue().strip() == "step:3 - actor/pg_loss:0.25 - response_length/mean:4"
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 3, "actor/pg_loss": 0.25, "response_length/mean": 4.0}


def test_unknown_logger_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(MetricsError, match="valid: console, jsonl, tensorboard, wandb"):
        MetricsLogger(tmp_path, ["mlflow"], keep_through=-1)


def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    logger = MetricsLogger(tmp_path, ["tensorboard"], keep_through=-1)
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("critic/score/mean")] == [0.5]


def test_wandb_offline_without_network(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (optional logger)")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, ["wandb"], keep_through=-1, project="p", experiment="e")
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))


def test_data_metrics_hand_computed() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]])
    m = data_metrics(
        sequence_score=torch.tensor([0.0, 1.0]), sequence_reward=torch.tensor([0.5, 1.0]),
        advantages=adv, returns=adv, values=adv, response_mask=mask,
        prompt_mask=torch.tensor([[0, 1], [1, 1]]), max_response_length=3,
    )
    assert m["critic/score/mean"] == 0.5 and m["critic/rewards/mean"] == 0.75
    assert m["critic/advantages/max"] == 3.0 and m["critic/advantages/mean"] == 2.0
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/min"] == 1.0 and m["critic/values/min"] == 1.0


def test_timing_and_throughput_names() -> None:
    assert timing_metrics({"gen": 1.5}) == {"timing_s/gen": 1.5}
    perf = throughput_metrics(total_tokens=1000, step_seconds=2.0, n_workers=2)
    assert perf["perf/throughput"] == 250.0 and perf["perf/time_per_step"] == 2.0


def test_wandb_missing_warns_and_keeps_the_jsonl(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    logger = MetricsLogger(tmp_path, ["wandb"], keep_through=-1)
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    assert "`wandb` package is not installed" in capsys.readouterr().err
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.5}]
