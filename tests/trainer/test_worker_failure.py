"""One rank's error inside `generate` ends the run at once, naming that rank, while its peers
are blocked in a collective that rank never joins: vLLM's data-parallel engines
(`external_launcher`, `data_parallel_size` > 1) all-reduce at every engine step, so a peer of a
failed engine waits there until the group's timeout (`actor_rollout_ref.nccl_timeout`, 600 s).
Real Ray actors and a real gloo group; the blocked collective stands in for vLLM's."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow


class Engine:
    """A rank whose `generate` is a collective of its group; rank 1's raises first."""

    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int) -> None:
        self.rank, self.world_size = rank, world_size

    def node_info(self) -> dict[str, Any]:
        import os
        import socket

        return {"rank": self.rank, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}

    def free_port(self) -> int:
        from trainer.parallel import free_port

        return free_port("127.0.0.1")

    def init_dist(self, master: str, port: int) -> dict[str, Any]:
        from trainer.parallel import init_process_group

        init_process_group(self.rank, self.world_size, master, port, backend="gloo", timeout_s=600)
        return {}

    def generate(self) -> int:
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            raise RuntimeError("engine step failed: CUDA error: an illegal memory access")
        value = torch.ones(1)
        dist.all_reduce(value)  # vLLM's data-parallel all-reduce: rank 1 never joins
        return int(value.item())


def test_one_engines_error_fails_the_run_at_once_naming_its_rank(ray_local: Any) -> None:
    from trainer.workers.group import WorkerFailure
    from trainer.workers.ray_group import make_placement_group, start_colocated

    slot = make_placement_group(1, 2)
    group = start_colocated({"actor": Engine}, None, 1, slot=slot, world_size=2)["actor"]
    group.init_dist()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"worker group `actor` rank 1 .* raised RuntimeError: engine step "
                                            r"failed: CUDA error: an illegal memory access during `generate`"):
        group.run("generate")
    assert time.monotonic() - start < 60  # the group's timeout is 600 s
    for actor in group.actors:  # every rank is gone, the blocked one too: nothing waits 600 s
        with pytest.raises(ray_local.exceptions.RayActorError):
            ray_local.get(actor.call.remote("actor", "node_info"), timeout=30)


class Idle:
    """A trainer rank with nothing to do while the pool validates; `sleep` is the pool's call."""

    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int) -> None:
        self.rank = rank

    def node_info(self) -> dict[str, Any]:
        import os
        import socket

        return {"rank": self.rank, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}

    def ping(self) -> int:
        return self.rank

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_trainer_rank_dying_while_the_pool_validates_ends_the_run_at_once(ray_local: Any) -> None:
    """The fully-async and one-step-off loops validate on the rollout pool while the trainer's
    ranks sit idle: one that dies then must end the run within a ping's period, not when the
    trainer is next called, minutes later."""
    import threading

    from trainer.workers.group import WorkerFailure, while_alive
    from trainer.workers.ray_group import make_placement_group, start_colocated

    trainer = start_colocated({"actor": Idle}, None, 1, slot=make_placement_group(1, 1), world_size=1)["actor"]
    pool = start_colocated({"rollout": Idle}, None, 1, slot=make_placement_group(1, 1), world_size=1)["rollout"]
    assert while_alive([trainer], pool.run, "sleep", 1.5, every_s=0.5) == [1.5]  # a live trainer: the result
    threading.Timer(2.0, ray_local.kill, (trainer.actors[0],)).start()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"worker group `actor` rank 0 .* died .* during `ping`"):
        while_alive([trainer], pool.run, "sleep", 120.0, every_s=0.5)
    assert time.monotonic() - start < 30  # the pool's call lasts 120 s
    # the pool's call goes on in its thread (a run ends there); here it must end before this test's
    # Ray does: a thread still waiting on a Ray call after `ray.shutdown()` keeps the driver's GCS
    # client alive, and that client ends the whole process once the GCS has been gone 60 s
    pool.kill()
    watched = [t for t in threading.enumerate() if t.name.endswith("-watched")]
    for thread in watched:
        thread.join(timeout=60)
    assert watched and not any(t.is_alive() for t in watched)
