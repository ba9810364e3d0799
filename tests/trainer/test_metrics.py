"""Metrics: JSONL continuity across resume, console format, TensorBoard, wandb offline,
and the verl-named metric computations."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.metrics import (
    MetricsError,
    MetricsLogger,
    data_metrics,
    device_flops,
    flops_fields,
    mfu,
    read_jsonl,
    rollout_probs_diff,
    throughput_metrics,
    timing_metrics,
    train_flops,
    validation_metrics,
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
    with pytest.raises(MetricsError, match="valid: console, jsonl, tensorboard, wandb, mlflow"):
        MetricsLogger(tmp_path, ["neptune"], keep_through=-1)


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
    values = torch.tensor([[0.0, 3.0, -50.0], [2.0, 1.0, 2.0]])
    m = data_metrics(
        sequence_score=torch.tensor([0.0, 1.0]), sequence_reward=torch.tensor([0.5, 1.0]),
        advantages=adv, returns=adv, values=values, response_mask=mask,
        prompt_mask=torch.tensor([[0, 1], [1, 1]]), max_response_length=3, max_prompt_length=2,
    )
    assert m["critic/score/mean"] == 0.5 and m["critic/rewards/mean"] == 0.75
    assert m["critic/advantages/max"] == 3.0 and m["critic/advantages/mean"] == 2.0
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/min"] == 1.0 and m["critic/values/min"] == 0.0
    assert m["prompt_length/clip_ratio"] == 0.5 and m["response/aborted_ratio"] == 0.0
    # returns 1 3 2 2 2 (unbiased variance 0.5), returns - values 1 0 0 1 0 (variance 0.3)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.3 / (0.5 + 1e-5))


def test_an_empty_response_is_left_out_of_the_score_statistics() -> None:
    m = data_metrics(
        sequence_score=torch.tensor([0.0, 1.0]), sequence_reward=torch.tensor([0.0, 1.0]),
        advantages=torch.ones(2, 2), returns=torch.ones(2, 2), response_mask=torch.tensor([[0, 0], [1, 0]]),
        prompt_mask=torch.ones(2, 1), max_response_length=2, max_prompt_length=4)
    assert m["critic/score/mean"] == 1.0 and m["response/aborted_ratio"] == 0.5
    assert m["response_length/mean"] == 0.5 and m["response_length_non_aborted/mean"] == 1.0
    assert "critic/vf_explained_var" not in m


def test_timing_and_throughput_names() -> None:
    assert timing_metrics({"gen": 1.5}) == {"timing_s/gen": 1.5}
    timed = timing_metrics({"gen": 1.0, "update_actor": 2.0, "reward": 0.5}, response_tokens=500, all_tokens=1000)
    assert timed == {"timing_s/gen": 1.0, "timing_s/update_actor": 2.0, "timing_s/reward": 0.5,
                     "timing_per_token_ms/gen": 2.0, "timing_per_token_ms/update_actor": 2.0}
    perf = throughput_metrics(total_tokens=1000, step_seconds=2.0, n_workers=2)
    assert perf["perf/throughput"] == 250.0 and perf["perf/time_per_step"] == 2.0


def test_mfu_hand_computed() -> None:
    """hidden 4, 2 heads of 2 (1 KV head), MLP 8, 2 layers, vocab 10: linear parameters per layer
    4*8*3 + 4*(4+2+2+4) = 144, with the embeddings (144*2 + 10*4*2) = 368; rows of 3 and 5
    tokens: 6*368*8 + 6*(9+25)*2*2*2 = 19296 FLOPs."""
    config = SimpleNamespace(model_type="llama", hidden_size=4, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=8, num_hidden_layers=2, vocab_size=10)
    assert train_flops(config, [3, 5]) == 19296
    assert train_flops(flops_fields(config), [3, 5]) == 19296  # what a worker sends
    got = mfu(config, [3, 5], seconds=2.0, device_name="NVIDIA H100 80GB HBM3", epochs=2, world_size=4)
    assert got == pytest.approx(19296 / 2.0 * 2 / 989e12 / 4)
    assert device_flops("NVIDIA H200") == 989e12 and device_flops("NVIDIA H20") == 148e12
    assert device_flops("NVIDIA GB200") == 2.5e15 and device_flops("CPU") == 448e9
    assert mfu(config, [3, 5], 2.0, "Tesla T4") == 0.0  # an unknown device: verl's infinite promise
    assert mfu(SimpleNamespace(model_type="gpt2"), [3, 5], 2.0, "CPU") == 0.0  # a model verl cannot count


def test_wandb_missing_warns_and_keeps_the_jsonl(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    logger = MetricsLogger(tmp_path, ["wandb"], keep_through=-1)
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    assert "`wandb` package is not installed" in capsys.readouterr().err
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.5}]


def _verl_draws(n: int, k: int) -> np.ndarray:
    """verl's bootstrap draws, the way verl makes them (the global generator, seeded 42)."""
    state = np.random.get_state()
    try:
        np.random.seed(42)
        return np.random.choice(n, size=(1000, k), replace=True)
    finally:
        np.random.set_state(state)


def test_validation_metrics_layout_and_bootstrap() -> None:
    """Two prompts of source `s` with two responses each (accuracies 1, 0 and 0, 0), one of `t`
    (1, 1): `acc` is the core number; `best`, `worst` and `maj` are bootstrap estimates over 1000
    draws of 2 of a prompt's responses, re-derived here from verl's draws."""
    m = validation_metrics(
        ["s", "s", "s", "s", "t", "t"], [0, 0, 1, 1, 2, 2],
        {"reward": [1.0, -1.0, -1.0, -1.0, 1.0, 1.0], "acc": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
         "pred": ["a", "b", "b", "b", "c", "c"]})
    draws = _verl_draws(2, 2)
    acc0 = np.array([1.0, 0.0])  # prompt 0; prompt 1 is all 0, so it adds 0 to every estimate
    best0 = float(np.mean([acc0[row].max() for row in draws]))
    worst0 = float(np.mean([acc0[row].min() for row in draws]))
    maj0 = float(np.mean([acc0[row[0]] for row in draws]))  # a tie goes to the first drawn
    assert m["val-core/s/acc/mean@2"] == 0.25 and m["val-aux/s/acc/std@2"] == 0.25
    assert m["val-core/s/acc/best@2/mean"] == pytest.approx(best0 / 2)
    assert m["val-aux/s/acc/worst@2/mean"] == pytest.approx(worst0 / 2)
    assert m["val-core/s/acc/maj@2/mean"] == pytest.approx(maj0 / 2)
    assert m["val-aux/s/reward/mean@2"] == -0.5  # not the core number: `acc` is there
    assert m["val-aux/s/acc/sem@2"] == pytest.approx(0.5 / 2)  # rows 1 0 0 0: sd 0.5 over sqrt(4)
    assert m["val-core/t/acc/best@2/mean"] == m["val-core/t/acc/maj@2/mean"] == 1.0
    assert m["val-core/t/acc/best@2/std"] == 0.0  # verl files the `/std` of `best` and `maj` as core too
    assert not any("/pred/" in k for k in m)
    assert {k.split("/")[0] for k in m} == {"val-core", "val-aux"}
    core = sorted(k for k in m if k.startswith("val-core/s/"))
    assert core == ["val-core/s/acc/best@2/mean", "val-core/s/acc/best@2/std", "val-core/s/acc/maj@2/mean",
                    "val-core/s/acc/maj@2/std", "val-core/s/acc/mean@2"]


def test_validation_metrics_without_acc_report_the_reward_as_core() -> None:
    m = validation_metrics(["s", "s", "s"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5], "formatted": [1.0, 1.0, 0.0]})
    assert m == pytest.approx({
        "val-core/s/reward/mean@1": 0.5, "val-aux/s/reward/sem@1": 0.5 / np.sqrt(3),
        "val-aux/s/formatted/mean@1": 2 / 3, "val-aux/s/formatted/sem@1": np.std([1, 1, 0], ddof=1) / np.sqrt(3)})


def test_rollout_probs_diff_by_hand() -> None:
    """verl's debug metrics on three response tokens (a fourth, masked, must not count):
    actor p = 0.4, 0.2, 0.9; sampler p = 0.5, 0.2, 0.7. |diff| = 0.1, 0, 0.2: max 0.2, mean 0.1,
    unbiased std sqrt((0 + 0.01 + 0.01) / 2) = 0.1. Pearson: deviations (-0.1, -0.3, 0.4) and
    (1/30, -8/30, 7/30): 0.17 / sqrt(0.26 * 0.126667) = 0.93677."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    actor = torch.tensor([[0.4, 0.2], [0.9, 0.01]]).log()
    sampler = torch.tensor([[0.5, 0.2], [0.7, 0.99]]).log()
    got = rollout_probs_diff(sampler, actor, mask)
    assert got["training/rollout_probs_diff_valid"] == 1.0
    assert got["training/rollout_probs_diff_max"] == pytest.approx(0.2, abs=1e-6)
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(0.1, abs=1e-6)
    assert got["training/rollout_probs_diff_std"] == pytest.approx(0.1, abs=1e-6)
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(0.93677, abs=1e-4)


def test_mlflow_logs_verl_s_names_into_one_run_across_a_resume(tmp_path: Path, monkeypatch) -> None:
    """`trainer.logger` with `mlflow`: the experiment is the project and the run the experiment
    name (as verl), metric names as verl sanitises them, the config as parameters, all in a SQLite
    store in the run directory; a resumed run logs into the same MLflow run."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    config = {"actor": {"optim": {"lr": 1e-6}}, "logger": ["console", "mlflow"]}
    logger = MetricsLogger(tmp_path, ["mlflow"], keep_through=-1, project="proj", experiment="exp", config=config)
    logger.log(1, {"val-core/hpcrl/arith/acc/mean@1": 0.25, "actor/pg_loss": torch.tensor(0.5), "note": "text"})
    logger.close()
    run_id = (tmp_path / "mlflow_run_id").read_text()
    logger = MetricsLogger(tmp_path, ["mlflow"], keep_through=1, project="proj", experiment="exp", config=config)
    logger.log(2, {"val-core/hpcrl/arith/acc/mean@1": 0.5})
    logger.close()
    assert (tmp_path / "mlflow_run_id").read_text() == run_id
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlruns.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_id == run_id and run.info.run_name == "exp"
    history = client.get_metric_history(run_id, "val-core/hpcrl/arith/acc/mean_at_1")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["actor/pg_loss"] == 0.5 and "note" not in run.data.metrics
    assert run.data.params["actor/optim/lr"] == "1e-06"
    assert run.data.params["logger"] == "['console', 'mlflow']"


def test_mlflow_missing_stops_the_run_naming_the_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    with pytest.raises(MetricsError, match=r"`trainer.logger` with `mlflow` needs the `mlflow` package.*"
                                           r"pip install mlflow-skinny sqlalchemy alembic"):
        MetricsLogger(tmp_path, ["console", "mlflow"], keep_through=-1)
