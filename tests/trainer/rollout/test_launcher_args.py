"""vLLM's `external_launcher` arguments (no vLLM needed): the device comes from the rank's own
device, never from an inherited `LOCAL_RANK`, and the custom all-reduce is off."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from trainer.parallel import free_port, init_method_url
from trainer.rollout import vllm as V


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=init_method_url("127.0.0.1", free_port("127.0.0.1")),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_external_launcher_args(group_of_one: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU backend's shared-memory clean-up would touch other runs' engines on this machine
    monkeypatch.setattr(V, "remove_cpu_shm", lambda: None)
    monkeypatch.setenv("LOCAL_RANK", "5")
    args = V.external_launcher_args(1)
    assert args == {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        V.external_launcher_args(2)
