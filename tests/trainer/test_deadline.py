"""The trainer under hpcrl: checkpoints and metrics default to `$HPCRL_RUN_DIR`, it stops by
itself before the job's end time (`HPCRL_JOB_END_TIME`), and a stop request during start-up is
kept rather than fatal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.agent.requeue import caught_signals
from trainer.checkpoint import full_state as ckpt
from trainer.config import load_config
from trainer.deadline import Deadline, DeadlineError, parse_end_time
from trainer.exit_codes import REQUEUE_EXIT_CODE
from trainer.metrics import read_jsonl
from trainer.rewards.toy import write_toy_digits

REPO = Path(__file__).resolve().parents[2]


def test_parse_end_time() -> None:
    assert parse_end_time("1763741234") == 1763741234.0
    assert parse_end_time(None) is None and parse_end_time(" ") is None
    with pytest.raises(DeadlineError, match="`HPCRL_JOB_END_TIME` is 'soon'"):
        parse_end_time("soon")


def test_deadline_needs_one_more_step_and_a_save() -> None:
    d = Deadline(end_time=1000.0, margin_s=10)
    assert not d.reached(now=0)
    d.record_step(5)
    assert d.needed_s() == 20  # no save seen yet: assumed as long as a step
    d.record_save(2)
    d.record_step(3)
    assert d.needed_s() == 5 + 2 + 10  # the longest recent step
    assert not d.reached(now=982.9) and d.reached(now=983)
    assert "ends in 17 s" in d.describe(now=983)
    assert not Deadline(None, 10).reached(now=1e12)


def test_run_dir_defaults_under_hpcrl() -> None:
    cfg = load_config([], env={"HPCRL_RUN_DIR": "/runs/j1"})
    assert cfg.trainer.default_local_dir == "/runs/j1/checkpoints"
    assert cfg.trainer.run_dir == "/runs/j1"
    mine = load_config(["trainer.default_local_dir=/ck"], env={"HPCRL_RUN_DIR": "/runs/j1"})
    assert mine.trainer.default_local_dir == "/ck" and mine.trainer.run_dir == "/runs/j1"
    plain = load_config([], env={})
    assert plain.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert plain.trainer.run_dir == plain.trainer.default_local_dir


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=64, val_size=4, seed=0)
    return out


def cli(model: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}", "data.max_prompt_length=16",
            "data.max_response_length=4", f"actor_rollout_ref.model.path={model}",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.val_before_train=false", "trainer.device=cpu", "trainer.logger=jsonl",
            "trainer.total_training_steps=3", *extra]


def env_with(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL_")}
    return {**clean, "PYTHONPATH": str(REPO), **extra}


def test_deadline_stops_and_the_rerun_finishes(tiny_model_dir: Path, toy: Path, tmp_path: Path) -> None:
    """An end time too near for a second step: checkpoint after step 1 and the requeue status,
    in `$HPCRL_RUN_DIR/checkpoints`; the rerun resumes there and finishes steps 2 and 3."""
    near = env_with(HPCRL_RUN_DIR=str(tmp_path), HPCRL_JOB_END_TIME=f"{time.time() + 900:.0f}")
    first = subprocess.run(cli(tiny_model_dir, toy, "trainer.deadline_margin_s=900"), env=near,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-2000:]
    assert "the job ends in" in first.stdout and "please requeue" in first.stdout
    assert ckpt.find_latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "global_step_1"
    rerun = subprocess.run(cli(tiny_model_dir, toy), env=env_with(HPCRL_RUN_DIR=str(tmp_path)),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_bad_end_time_is_a_usage_error(tiny_model_dir: Path, toy: Path, tmp_path: Path) -> None:
    proc = subprocess.run(cli(tiny_model_dir, toy), capture_output=True, text=True, timeout=300,
                          env=env_with(HPCRL_RUN_DIR=str(tmp_path), HPCRL_JOB_END_TIME="later"))
    assert proc.returncode == 2 and "`HPCRL_JOB_END_TIME` is 'later'" in proc.stderr


def test_stop_signal_during_start_up_is_kept(tiny_model_dir: Path, toy: Path, tmp_path: Path) -> None:
    """SIGUSR2 as soon as the handler is there, long before the models load: one step, a
    checkpoint and the requeue status (without the early handler SIGUSR2 would kill it)."""
    proc = subprocess.Popen(cli(tiny_model_dir, toy), env=env_with(HPCRL_RUN_DIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while signal.SIGUSR2 not in caught_signals(Path(f"/proc/{proc.pid}/status").read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "no handler for SIGUSR2"
        time.sleep(0.005)
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-2000:]
    assert "stop requested (signal SIGUSR2)" in out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
