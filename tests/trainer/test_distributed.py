"""The distributed trainer on a private local Ray cluster (2 CPU ranks, gloo): both ranks
generate and train (per-rank metrics), sharded checkpoints saved on 2 (4) ranks resume on 1 (2)
and continue as an uninterrupted run would, and a worker killed mid-run ends `python -m trainer` with status 1 and a message naming its node and rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from trainer.checkpoint import full_state as ckpt
from trainer.checkpoint import sharded
from trainer.metrics import read_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.rewards.toy import write_toy_digits

    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=256, val_size=8, seed=0)
    return out


def overrides(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.val_before_train=false",
        f"trainer.default_local_dir={run}", "trainer.logger=jsonl", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4", *extra,
    ]


def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)


#: Greedy rollouts (no per-rank sampling streams) and one checkpoint per step, so that runs on
#: different numbers of ranks see the same data and can be compared step by step.
#: An update that does not depend on the world size, so that runs on different numbers of ranks
#: can be compared: verl's model engine (`use_legacy_worker_impl=disable`: losses over the whole
#: mini-batch; verl's default worker averages each rank's micro-batch means, which depend on which
#: rows share a rank) and one mini-batch of all 16 rows, twice (verl cuts mini-batches from each
#: rank's rows, so with several their rows depend on the world size, as in verl).
COMMON = ("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
          "actor_rollout_ref.rollout.do_sample=false", "trainer.save_freq=1",
          "trainer.use_legacy_worker_impl=disable", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
          "actor_rollout_ref.actor.ppo_epochs=2")
#: Weights of a resumed run against an uninterrupted one: float noise between world sizes moves
#: Adam's steps by ~1e-6; a resume that lost the Adam moments, the LR schedule or the data
#: position moves them by about the learning rate (1e-3), which the test checks is detectable.
RESUME_ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, toy: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps on one rank in process, uninterrupted: what every resumed run must reproduce."""
    from trainer.config import load_config
    from trainer.driver import run_training

    run = tmp_path_factory.mktemp("reference")
    assert run_training(load_config(overrides(tiny_model_dir, toy, run, *COMMON, "trainer.total_training_steps=2"))) == 0
    return run


def assert_resume_matches(run: Path, reference: Path, step: int) -> None:
    """Step `step` of `run` (resumed) equals the reference's: weights within `RESUME_ATOL` (which
    the reference's own last update exceeds tenfold) and the same rewards."""
    for group in ("actor", "critic"):
        got = sharded.read_group_state(run / f"global_step_{step}", group)["model"]
        want = sharded.read_group_state(reference / f"global_step_{step}", group)["model"]
        before = sharded.read_group_state(reference / f"global_step_{step - 1}", group)["model"]
        assert max(float((want[k] - before[k]).abs().max()) for k in want) > 10 * RESUME_ATOL, group
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=RESUME_ATOL, msg=f"{group} {name}")
    mine, theirs = read_jsonl(run / "metrics.jsonl")[-1], read_jsonl(reference / "metrics.jsonl")[step - 1]
    assert mine["step"] == theirs["step"] == step
    assert mine["critic/score/mean"] == theirs["critic/score/mean"]


def test_two_ranks_train_and_a_checkpoint_resumes_on_one(tiny_model_dir, toy, reference, tmp_path, monkeypatch) -> None:
    from trainer.config import load_config
    from trainer.driver import run_training

    no_ray_address(monkeypatch)
    run = tmp_path / "run"
    cfg = load_config(overrides(tiny_model_dir, toy, run, *COMMON, "trainer.n_gpus_per_node=2",
                                "trainer.total_training_steps=1"))
    assert run_training(cfg) == 0
    # the private cluster used a token of its own, not one written into the user's home
    assert os.environ["RAY_AUTH_MODE"] == "token" and not (Path.home() / ".ray").exists()
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    for rank in (0, 1):
        assert rows[0][f"dp/rank_{rank}/gen_rows"] == 4, rows[0]
        assert rows[0][f"dp/rank_{rank}/gen_tokens"] > 0 and rows[0][f"dp/rank_{rank}/update_actor_tokens"] > 0
        assert rows[0][f"dp/rank_{rank}/update_critic_tokens"] > 0
    assert {"timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values",
            "timing_s/update_actor", "timing_s/update_critic", "timing_s/update_weights"} <= set(rows[0])
    workers = json.loads((run / "workers.json").read_text())
    assert [w["rank"] for w in workers["actor_rollout_ref"]] == [0, 1]
    assert [w["rank"] for w in workers["critic"]] == [0, 1]
    saved = ckpt.find_latest_checkpoint(run)
    assert saved == run / "global_step_1"
    assert ckpt.load_state(saved, "trainer_state")["world_size"] == 2
    assert sharded.has_group_state(saved, "actor") and sharded.has_group_state(saved, "critic")
    assert (saved / "huggingface" / "config.json").is_file()
    # the same run continues on one rank (still on Ray) from the 2-rank checkpoint
    cfg = load_config(overrides(tiny_model_dir, toy, run, *COMMON, "trainer.n_gpus_per_node=1",
                                "trainer.distributed=true", "trainer.total_training_steps=2"))
    assert run_training(cfg) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert "dp/rank_1/gen_rows" not in rows[-1] and rows[-1]["dp/rank_0/gen_rows"] == 8
    assert ckpt.load_state(run / "global_step_2", "trainer_state")["world_size"] == 1
    assert_resume_matches(run, reference, 2)


def test_four_ranks_checkpoint_resumes_on_two(tiny_model_dir, toy, reference, tmp_path, monkeypatch) -> None:
    from trainer.config import load_config
    from trainer.driver import run_training

    no_ray_address(monkeypatch)
    run = tmp_path / "run"
    for ranks, steps in ((4, 1), (2, 2)):
        cfg = load_config(overrides(tiny_model_dir, toy, run, *COMMON, f"trainer.n_gpus_per_node={ranks}",
                                    f"trainer.total_training_steps={steps}"))
        assert run_training(cfg) == 0
        assert ckpt.load_state(run / f"global_step_{steps}", "trainer_state")["world_size"] == ranks
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert_resume_matches(run, reference, 2)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the trainer ended early ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.5)


def test_killed_worker_ends_the_run_naming_node_and_rank(tiny_model_dir, toy, tmp_path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "trainer", *overrides(
        tiny_model_dir, toy, run, "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=500")]
    proc = subprocess.Popen(argv, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(run / "metrics.jsonl", proc, timeout=400)  # training is under way
        victim = json.loads((run / "workers.json").read_text())["actor_rollout_ref"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (proc.returncode, out[-2000:], err[-3000:])
    expected = f"worker group `actor_rollout_ref` rank 1 on node `{socket.gethostname()}` ({victim['ip']}, pid {victim['pid']}) died"
    assert expected in err, err[-3000:]
    # a kill that is not for memory is not called one; the rank's last sample is said all the same
    assert "killed for memory" not in err and "; its last memory sample (" in err, err[-3000:]
    assert "; no memory plan for this run (the memory plan is made for GPU jobs" in err, err[-3000:]
    from hpcrl.diagnosis import read_diagnoses

    (kept,) = read_diagnoses(run)  # for `hpcrl status`, after the job is gone
    assert kept["kind"] == "worker" and expected in kept["summary"], kept


def test_sigterm_after_connecting_to_ray_is_a_stop_request(tmp_path) -> None:
    """`ray.init` installs its own SIGTERM handlers (a Python one that exits, the core worker's
    that aborts); `connect` puts the trainer's back: Slurm's SIGTERM to every process of a
    cancelled or requeued job asks the driver to checkpoint and stop, it does not kill it."""
    code = ("import os, signal, time\n"
            "from trainer.stop import StopRequest\n"
            "from trainer.workers.ray_group import connect\n"
            "stop = StopRequest(); stop.install()\n"
            "connect(1)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(1)\n"
            "print('stop requested:', stop.requested(), stop.reason(), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HPCRL_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stop requested: True signal SIGTERM" in proc.stdout, proc.stdout + proc.stderr[-2000:]
