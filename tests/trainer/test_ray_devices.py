"""Each Ray actor takes the GPU Ray assigned it: a private local Ray cluster declaring 4 GPUs on
this CPU machine sets `CUDA_VISIBLE_DEVICES` per actor exactly as on a GPU node (or leaves the
node's list with `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`), and an inherited `LOCAL_RANK`
is replaced by the index of that GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_with_gpus() -> Iterator[Any]:
    import ray

    from trainer.workers.ray_group import private_token_auth

    with pytest.MonkeyPatch.context() as mp:
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "CUDA_VISIBLE_DEVICES"):
            mp.delenv(name, raising=False)
        private_token_auth()
        ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False)
        try:
            yield ray
        finally:
            ray.shutdown()


class Probe:
    def take(self) -> dict[str, Any]:
        import os

        from trainer.workers.base import take_ray_device

        inherited = os.environ.get("LOCAL_RANK")
        device = take_ray_device()
        assert device is not None
        return {"ray_id": device.ray_id, "index": device.index, "inherited": inherited,
                **{k: os.environ.get(k) for k in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}}


def probes(ray: Any, env: dict[str, str]) -> list[dict[str, Any]]:
    remote = ray.remote(Probe)
    actors = [remote.options(num_cpus=0, num_gpus=1, runtime_env={"env_vars": env}).remote() for _ in range(4)]
    try:
        return ray.get([a.take.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)


def test_each_actor_takes_its_own_gpu_and_local_rank_from_ray(ray_with_gpus: Any) -> None:
    got = probes(ray_with_gpus, {"LOCAL_RANK": "7"})
    assert sorted(g["ray_id"] for g in got) == ["0", "1", "2", "3"]
    for g in got:
        assert g["inherited"] == "7" and g["LOCAL_RANK"] == "0" and g["index"] == 0
        assert g["CUDA_VISIBLE_DEVICES"] == g["HIP_VISIBLE_DEVICES"] == g["ray_id"]


def test_noset_keeps_the_node_list_and_indexes_into_it(ray_with_gpus: Any) -> None:
    env = {"LOCAL_RANK": "0", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    got = probes(ray_with_gpus, env)
    assert sorted(g["ray_id"] for g in got) == ["0", "1", "2", "3"]
    for g in got:
        assert g["CUDA_VISIBLE_DEVICES"] == g["HIP_VISIBLE_DEVICES"] == "0,1,2,3"
        assert g["index"] == int(g["ray_id"]) and g["LOCAL_RANK"] == g["ray_id"]


class Role:
    """A worker role that reports where it runs (the colocated worker hosts two of them)."""

    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int) -> None:
        from trainer.workers.base import take_ray_device

        self.rank, self.device = rank, take_ray_device()

    def where(self) -> dict[str, Any]:
        import os

        return {"rank": self.rank, "pid": os.getpid(), "ray_id": self.device.ray_id if self.device else None,
                "index": self.device.index if self.device else None,
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def node_info(self) -> dict[str, Any]:
        return self.where()


def test_one_bundle_and_one_process_per_gpu_with_roles_colocated(ray_with_gpus: Any) -> None:
    from trainer.workers.ray_group import make_placement_group, start_colocated

    slot = make_placement_group(1, 4, tp=2)
    assert slot.use_gpu and len(slot.placement_groups) == 1
    assert slot.placement_groups[0].bundle_specs == [{"GPU": 1.0}] * 4
    groups = start_colocated({"actor": Role, "critic": Role}, None, 1, slot=slot, world_size=4)
    try:
        actor, critic = groups["actor"].run("where"), groups["critic"].run("where")
        assert [a["rank"] for a in actor] == [c["rank"] for c in critic] == [0, 1, 2, 3]
        assert [a["pid"] for a in actor] == [c["pid"] for c in critic]  # one process per rank
        assert sorted(a["ray_id"] for a in actor) == ["0", "1", "2", "3"]  # one GPU each
        assert all(a["visible"] == a["ray_id"] and a["index"] == 0 for a in actor)
    finally:
        groups["actor"].kill()
        for pg in slot.placement_groups:
            ray_with_gpus.util.remove_placement_group(pg)


def test_a_tensor_parallel_engine_never_spans_nodes(ray_with_gpus: Any) -> None:
    from trainer.config import ConfigError
    from trainer.workers.ray_group import make_placement_group

    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3` does not divide `trainer.n_gpus_per_node=4`"):
        make_placement_group(1, 4, tp=3)


def test_a_worker_granted_a_gpu_torch_cannot_see_fails_at_once_naming_it(ray_with_gpus: Any,
                                                                          tiny_model_dir: Any, tmp_path: Any) -> None:
    """Ray grants the actor a GPU (declared on this CPU machine, as a container started without
    its GPU flags would have it): the worker refuses at construction, and the group's failure
    names the rank, the GPU and the fix, instead of the rank training on the CPU over gloo."""
    from trainer.config import load_config
    from trainer.workers.actor import ActorRolloutRefWorker
    from trainer.workers.group import WorkerFailure
    from trainer.workers.ray_group import make_placement_group, start_colocated

    # its run directory (memory samples, the plan's figure) in the test's own folder, not the cwd
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.default_local_dir={tmp_path}"])
    slot = make_placement_group(1, 2, tp=1)
    try:
        with pytest.raises(WorkerFailure, match=r"rank [01] .*failed to start: .*given a GPU \(Ray granted GPU `\d`, "
                                                r"`CUDA_VISIBLE_DEVICES=\d`.*Fix: start the container"):
            start_colocated({"actor": ActorRolloutRefWorker}, cfg, 1, slot=slot, world_size=2)
    finally:
        for pg in slot.placement_groups:
            ray_with_gpus.util.remove_placement_group(pg)


def test_pools_share_a_node_only_when_the_job_has_fewer_nodes_than_they_ask(ray_with_gpus: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One node with 4 GPUs: a trainer of 2 and a rollout pool of 1 share it (as verl's resource
    pools may), each rank a GPU of its own. (With a node for each, they are kept apart:
    `tests/trainer/async_rl/test_one_step_off.py` on two Ray nodes.)"""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from trainer.workers import ray_group

    monkeypatch.delenv("HPCRL_NUM_NODES", raising=False)
    trainer, pool = ray_group.make_pools([(1, 2), (1, 1)])
    try:
        assert trainer.use_gpu and (trainer.per_node, pool.per_node) == (2, 1)
        for slot in (trainer, pool):
            assert all(placement_group_table(pg)["state"] == "CREATED" for pg in slot.placement_groups)
    finally:
        for pg in (*trainer.placement_groups, *pool.placement_groups):
            remove_placement_group(pg)
