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
    done = submit(["--", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
                   "critic.ppo_micro_batch_size_per_gpu=4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hpcrl: note: no memory plan: `actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct`" in done.stderr


@pytest.mark.parametrize(("mem", "gib"), [("200G", 200.0), ("512000", 500.0), ("1T", 1024.0), ("0", 0.0),
                                          (None, 0.0), ("300gb", 300.0)])
def test_slurm_memory_sizes_read_as_gib(mem: str | None, gib: float) -> None:
    from hpcrl.memcheck import slurm_mem_gib

    assert slurm_mem_gib(mem) == gib


def test_an_unreadable_slurm_memory_size_names_the_fix() -> None:
    from hpcrl.memcheck import slurm_mem_gib
    from hpcrl.preflight import PreflightError

    with pytest.raises(PreflightError, match=r"`slurm.mem` is '200 gigs'.*Fix: a number with an optional unit"):
        slurm_mem_gib("200 gigs")


@pytest.mark.slow
def test_a_node_whose_host_memory_cannot_hold_the_offloaded_state_is_refused_before_it_queues(
        tmp_path: Path) -> None:
    """`mi300-cluster` with `slurm.mem: 96G`: the flagship's offloaded shards and pinned AdamW
    moments of 8 workers need 108 GiB of the node (vLLM sleeps at level 2, no weight backup)."""
    sites = tmp_path / ".config" / "hpcrl" / "sites"
    sites.mkdir(parents=True)
    (sites / "small-mem.yaml").write_text("extends: mi300-cluster\nslurm:\n  mem: 96G\n")
    offload = [f"actor_rollout_ref.model.path={QWEN_7B}", "algorithm.adv_estimator=grpo",
               "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
               "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.use_kl_loss=True",
               "actor_rollout_ref.actor.fsdp_config.param_offload=True",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
               "actor_rollout_ref.ref.fsdp_config.param_offload=True", "data.train_batch_size=1024",
               "actor_rollout_ref.actor.ppo_mini_batch_size=256",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.nnodes=2"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "hpcrl", "submit", "--dry-run", "--via", "sbatch",
                           "--site", "small-mem", "--", *offload], env=env, cwd=REPO, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 2, done.stderr
    assert ("the memory plan refuses this job before it queues (192 GiB per GPU, `slurm.gpu_memory_gib`, "
            "96G per node, `slurm.mem`): the host memory phase needs 108.3 GiB per node") in done.stderr
    assert "its largest term is 8 x offloaded AdamW moments" in done.stderr
    assert "#SBATCH" not in done.stdout


#: `python -m hpcrl` in an interpreter where torch cannot be imported, as after a plain
#: `pip install hpcrl` on a login node (the one seam faked: torch's absence)
WITHOUT_TORCH = """\
import importlib.abc, runpy, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return None
sys.meta_path.insert(0, NoTorch())
sys.argv = ["hpcrl", *sys.argv[1:]]
runpy.run_module("hpcrl", run_name="__main__")
"""


def test_a_light_install_notes_the_plan_was_not_run_and_never_refuses(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "submit", "--dry-run", "--via", "sbatch",
                           "--site", "h100-cluster", "--", *GRPO], env=env, cwd=REPO, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the oversize line: unchecked here, not refused
    assert "hpcrl: note: the memory plan was not run, so GPU memory is unchecked: torch is not installed" in done.stderr
    assert "`pip install 'hpcrl[train]'`" in done.stderr and "`slurm.memory_plan: false`" in done.stderr
    assert "refuses" not in done.stderr and "--force" not in done.stderr
    assert "#SBATCH" in done.stdout


def test_a_plan_that_crashes_is_not_read_as_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from hpcrl import memcheck

    crash = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\n  ...\n"
                                        "ModuleNotFoundError: No module named 'transformers'\n")
    monkeypatch.setattr(memcheck.subprocess, "run", lambda *a, **k: crash)
    slurm = SimpleNamespace(gpus_per_node=8, gpu_memory_gib=80.0, mem=None, memory_plan=True)
    text = memcheck.check_memory(GRPO, {memcheck.MODEL_KEY: str(QWEN_7B)}, slurm, {}, force=False)
    assert text is not None and text.startswith("hpcrl: note: the memory plan was not run")
    assert "exit status 1: ModuleNotFoundError: No module named 'transformers'" in text
    refusal = subprocess.CompletedProcess([], 2, "", "python -m trainer: error: the actor update phase needs more\n")
    monkeypatch.setattr(memcheck.subprocess, "run", lambda *a, **k: refusal)
    with pytest.raises(memcheck.PreflightError, match="the memory plan refuses this job"):
        memcheck.check_memory(GRPO, {memcheck.MODEL_KEY: str(QWEN_7B)}, slurm, {}, force=False)
