"""A worker given a GPU that torch cannot see refuses to start instead of training on the CPU:
a GPU granted by Ray, a visible-device variable naming one, or `trainer.device=cuda`. This
machine has no GPU, so torch here is exactly the worker that cannot see one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.devices import WorkerDevice
from trainer.config import ConfigError, load_config
from trainer.workers.base import Worker, require_visible_gpu

FIX = r"Fix: start the container with the GPUs passed in .* or train on the CPU on purpose with `trainer.device=cpu`"


@pytest.mark.parametrize("var", ["CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"])
def test_a_visible_device_variable_naming_a_gpu_torch_cannot_see_is_refused(var: str) -> None:
    with pytest.raises(ConfigError, match=rf"given a GPU \(`{var}=0,1`\) but torch cannot see one .*{FIX}"):
        require_visible_gpu(None, "auto", {var: "0,1"}, cuda_available=False)


def test_a_gpu_granted_by_ray_is_named() -> None:
    gpu = WorkerDevice(ray_id="3", index=0)
    with pytest.raises(ConfigError, match=r"given a GPU \(Ray granted GPU `3`, `CUDA_VISIBLE_DEVICES=3`\)"):
        require_visible_gpu(gpu, "auto", {"CUDA_VISIBLE_DEVICES": "3"}, cuda_available=False)


@pytest.mark.parametrize(("env", "device", "cuda"), [({}, "auto", False), ({"CUDA_VISIBLE_DEVICES": ""}, "auto", False),
                                                     ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, "auto", False),
                                                     ({"CUDA_VISIBLE_DEVICES": "0"}, "cpu", False),
                                                     ({"CUDA_VISIBLE_DEVICES": "0"}, "auto", True)])
def test_no_gpu_asked_the_cpu_asked_or_a_visible_gpu_passes(env: dict[str, str], device: str, cuda: bool) -> None:
    require_visible_gpu(None, device, env, cuda_available=cuda)


def test_a_worker_of_a_group_refuses_at_construction(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the fix, `init_process_group` picked gloo here and the rank trained on the CPU."""
    assert not torch.cuda.is_available()
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}"])
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2")
    with pytest.raises(ConfigError, match=r"`HIP_VISIBLE_DEVICES=2`"):
        Worker(cfg, 0, 2, total_steps=1)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    cuda = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match=r"given a GPU \(`trainer.device=cuda`\)"):
        Worker(cuda, 1, 2, total_steps=1)
    Worker(cfg, 0, 2, total_steps=1)  # nothing asks for a GPU: the CPU, as before
