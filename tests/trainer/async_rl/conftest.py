"""The asynchronous loops' shared Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="package")
def two_nodes() -> Iterator[Any]:
    """Two Ray nodes on this machine, one cluster for the package's loops: the trainer's (2 GPUs
    declared) and the pool's (2)."""
    import ray
    from ray.cluster_utils import Cluster

    from trainer.workers.ray_group import private_token_auth

    with pytest.MonkeyPatch.context() as mp:
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "CUDA_VISIBLE_DEVICES"):
            mp.delenv(name, raising=False)
        private_token_auth()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2,
                                                                "include_dashboard": False})
        cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        mp.setenv("RAY_ADDRESS", cluster.address)
        try:
            yield cluster
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()


def stopped_after(driver_class: Any, step: int) -> Any:
    """`driver_class` asked to stop (the run directory's STOP file) once step `step` has trained:
    the run checkpoints that step, whatever the loop has in flight, and exits for a requeue."""
    from trainer.stop import STOP_FILE

    class Stopped(driver_class):  # type: ignore[misc, valid-type]
        def next_step(self) -> dict[str, float]:
            metrics = super().next_step()
            if self.global_step == step:
                (self.run_dir / STOP_FILE).write_text("test")
            return metrics

    return Stopped
