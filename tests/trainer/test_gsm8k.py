"""GSM8K end to end with a real model: `python -m trainer` trains SmolLM2-135M-Instruct on a
few prompts of the GSM8K sample (verl parquet, GSM8K scorer), is stopped after a step with a
checkpoint and the requeue status, and a second run of the same command resumes from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoint import full_state as ckpt
from trainer.exit_codes import OK_EXIT_CODE, REQUEUE_EXIT_CODE
from trainer.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
RESPONSE_LENGTH = 16


def gsm8k_overrides(model: Path, run: Path) -> list[str]:
    """Two prompts x two samples, 16 response tokens, GRPO: the smallest real step."""
    return [
        f"data.train_files={DATA / 'gsm8k_train_sample.parquet'}",
        f"data.val_files={DATA / 'gsm8k_test_sample.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=256",
        f"data.max_response_length={RESPONSE_LENGTH}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={run}", "trainer.logger=['console','jsonl']",
        "trainer.max_actor_ckpt_to_keep=1", "trainer.seed=3",
    ]


def run_trainer(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          env=env, check=False, timeout=600)


@pytest.mark.slow
def test_gsm8k_smollm2_scores_checkpoints_and_resumes(smollm2_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()  # a stop request present from the start: one step, then requeue
    args = gsm8k_overrides(smollm2_dir, run)

    first = run_trainer(args)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    assert ckpt.find_latest_checkpoint(run) == run / "global_step_1"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

    second = run_trainer(args)  # the same command line, as a requeued job would run it
    assert second.returncode == OK_EXIT_CODE, second.stderr[-3000:]
    assert f"resumed from {run / 'global_step_1'} (step 1)" in second.stdout
    assert "step:2 " in second.stdout and "step:1 " not in second.stdout  # step 1 not redone
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["critic/score/mean"] <= 1.0, row
        assert 0 < row["response_length/mean"] <= RESPONSE_LENGTH, row
        assert row["prompt_length/mean"] > 30, row  # real GSM8K questions in the chat template
        assert row["perf/throughput"] > 0, row
    assert ckpt.find_latest_checkpoint(run) == run / "global_step_2"
    assert ckpt.list_checkpoints(run) == [run / "global_step_2"]  # keep the last 1
    assert (run / "global_step_2" / "huggingface" / "config.json").is_file()
