"""`hpcrl submit --dry-run` runs the memory plan before anything is queued: on a GPU site
(`h100-cluster`: 8 GPUs of `slurm.gpu_memory_gib: 80`) the seeds' Qwen2.5-7B GRPO line, whose
24000-token fp32 micro-batches cannot fit, is refused with the phase, the largest term and the
fix; `--force` lets it through with a warning; a model with no local `config.json` is noted,
not refused. Real `python -m hpcrl` and `python -m trainer --plan-memory` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

QWEN_7B = REPO / "tests" / "data" / "model_configs" / "Qwen2.5-7B-Instruct"
GRPO = [f"actor_rollout_ref.model.path={QWEN_7B}", "algorithm.adv_estimator=grpo",
        "data.train_batch_size=1024", "data.max_prompt_length=512", "data.max_response_length=1024",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.rollout.name=vllm"]


def submit(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "hpcrl", "submit", "--dry-run", "--via", "sbatch",
                           "--site", "h100-cluster", *args], env=env, cwd=REPO, text=True,
                          capture_output=True, timeout=900)


@pytest.mark.slow
def test_an_oversize_configuration_is_refused_before_it_queues_and_force_lets_it_through(
        tmp_path: Path) -> None:
    refused = submit(["--", *GRPO], tmp_path)
    assert refused.returncode == 2, refused.stderr
    err = refused.stderr
    assert "hpcrl: error: the memory plan refuses this job before it queues (80 GiB per GPU" in err
    assert "the actor update phase needs" in err and "its largest term is activations" in err
    assert "Fix: fewer micro-batch tokens (`actor_rollout_ref.actor.ppo_max_token_len_per_gpu`" in err
    assert "`hpcrl submit --force`" in err
    assert "#SBATCH" not in refused.stdout  # nothing rendered, nothing queued
    forced = submit(["--force", "--", *GRPO], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "hpcrl: warning: submitted despite the memory plan (`--force`): the actor update" in forced.stderr
    assert "#SBATCH" in forced.stdout


def test_a_model_without_a_local_config_is_noted_not_refused(tmp_path: Path) -> None:
    done = submit(["--", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hpcrl: note: no memory plan: `actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct`" in done.stderr
