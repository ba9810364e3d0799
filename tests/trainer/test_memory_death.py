"""A rank killed for memory is named: the process, its node, what it held, the limit, the
memory plan's host figure, the fix. The parsers read text captured on this machine
(`tests/data/memory/`); then real kills: Ray's memory monitor and the kernel's OOM killer each
kill a real Ray rank that allocates, and the run's error says who killed which process holding
how much, with the rank's own last memory sample; where the kernel's log cannot be read, its
cgroup's `oom_kill` count tells."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, wait_until
from trainer.workers.memory_death import describe, parse_kernel_kill, parse_ray_oom
from trainer.workers.memory_samples import read_sample, write_plan

DATA = REPO / "tests" / "data" / "memory"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def test_ray_s_memory_monitor_message_is_read() -> None:
    death = parse_ray_oom((DATA / "ray_memory_monitor.txt").read_text())
    assert death is not None
    assert (death.pid, death.process, death.resident_gb) == (29603, "ray::Hog.eat", 4.81)
    assert (death.node, death.node_used_gb, death.node_limit_gb) == ("192.0.2.2", 5.91, 23.54)
    text = describe(death)
    assert text.startswith("was killed for memory by Ray's memory monitor: process 29603 (ray::Hog.eat) "
                           "holding 4.81 GB; node 192.0.2.2 used 5.91 GB of 23.54 GB (kill threshold 25.0%")
    assert "Fix: " in text and "slurm.mem" in text
    assert parse_ray_oom("The actor died unexpectedly before finishing this task.") is None


def test_the_kernel_log_s_oom_kill_is_read_for_its_process_only() -> None:
    log = (DATA / "kernel_oom_cgroup_v1.txt").read_text()
    death = parse_kernel_kill(log, 29956)
    assert death is not None and (death.process, round(death.resident_gb or 0, 3)) == ("python3", 0.157)
    assert death.threshold == "cgroup /hpcrl-oomtest"  # the kernel enforced that cgroup's limit
    assert parse_kernel_kill(log, 29957) is None  # another process's kill is not this one's
    assert "by the kernel's OOM killer: process 29956 (python3) holding 0.16 GB" in describe(death)


#: torch's sentence for a full H100 (torch 2.13's wording, `c10/cuda/CUDACachingAllocator.cpp`).
GPU_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
           "1.02 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use. Of the "
           "allocated memory 74.50 GiB is allocated by PyTorch, and 2.10 GiB is reserved by PyTorch but "
           "unallocated.")


class Hog:
    """A rank that allocates host memory until something kills it; `cgroup`: a memory cgroup
    directory to move into first (its limit then applies)."""

    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int) -> None:
        self.rank = rank

    def node_info(self) -> dict[str, Any]:
        import socket

        return {"rank": self.rank, "hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}

    def run_out_of_gpu_memory(self) -> None:
        """What torch raises in a rank whose GPU is full (the exception itself: this CPU has no GPU)."""
        import torch

        raise torch.OutOfMemoryError(GPU_OOM)

    def join(self, cgroup: str) -> None:
        """Move into the memory cgroup `cgroup` (its limit then applies)."""
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

    def eat(self, gib: float, cgroup: str | None = None, pace_s: float = 0.02) -> int:
        """Allocate `gib` GiB, 128 MiB every `pace_s` seconds."""
        if cgroup:
            self.join(cgroup)
        blocks = []
        for _ in range(int(gib * 8)):
            block = bytearray(128 << 20)
            block[::4096] = b"\x01" * len(block[::4096])  # touch every page: resident, not only reserved
            blocks.append(block)
            time.sleep(pace_s)
        return len(blocks)


def test_a_rank_on_another_node_is_read_on_its_node() -> None:
    """The kernel log and the cgroup count of a rank on another node are read there (the one
    seam: `remote`, a Ray task pinned to the node in a run); here, they could not be."""
    from trainer.workers.memory_death import MemoryDeath, find_death, local_death

    node = {"rank": 1, "hostname": "node-elsewhere", "ip": "192.0.2.7", "pid": 4242}
    asked = []

    def remote(ip: str, fn: Any, *args: Any) -> MemoryDeath:
        asked.append((ip, fn, args))
        return MemoryDeath("the kernel's OOM killer", pid=4242, process="ray::Worker", resident_gb=1.5,
                           node="node-elsewhere", node_limit_gb=2.0, threshold="cgroup /slurm/job_7")

    death = find_death("ActorDiedError: the worker died", True, node, None, remote=remote)
    assert asked == [("192.0.2.7", local_death, (4242, "node-elsewhere", None))]
    assert death is not None and death.pid == 4242 and death.node == "node-elsewhere", death
    assert "process 4242 (ray::Worker) holding 1.50 GB; the limit of its cgroup /slurm/job_7 is 2.00 GB" in describe(death)
    assert "A requeue would not help" in describe(death)
    assert find_death("ActorDiedError: the worker died", True, node, None) is None  # nothing readable from here


@pytest.mark.slow
def test_a_rank_out_of_gpu_memory_is_named_with_its_phase_and_the_plan_s_figure(ray_starter: Any, tmp_path: Path) -> None:
    """The rank raises torch's `OutOfMemoryError` during the actor's update: the run's error names
    the phase, torch's sentence, the memory plan's actor-update figure for the 79.11 GiB device it
    names (the plan made in the failure's path), that a requeue would not help, and the fix."""
    from functools import partial

    from trainer.config import load_config
    from trainer.memplan import GIB, plan_config
    from trainer.watchdog import at
    from trainer.workers.group import WorkerFailure

    ray_at(ray_starter, None)
    cfg = load_config([f"actor_rollout_ref.model.path={REPO / 'tests/data/model_configs/Qwen2.5-0.5B'}",
                       "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    group = _group(tmp_path)
    group.device_plan = partial(plan_config, cfg)
    with pytest.raises(WorkerFailure) as failed, at("update_actor", 7):
        group.run("run_out_of_gpu_memory")
    text = str(failed.value)
    update = next(p for p in plan_config(cfg, 79.11).phases if p.name == "actor update")
    assert failed.value.kind == "gpu_oom" and failed.value.details["phase"] == "update_actor", failed.value.details
    assert f"worker group `actor` rank 0 on node `{socket.gethostname()}`" in text, text
    assert "ran out of GPU memory in phase `update_actor`: CUDA out of memory. Tried to allocate 2.00 GiB." in text
    assert (f"the memory plan's actor update phase: {update.peak / GIB:.1f} GiB per device of "
            f"{update.limit / GIB:.1f} GiB") in text, text
    assert "A requeue would not help" in text and "Fix: fewer tokens per micro-batch" in text, text
    assert text.endswith("during `run_out_of_gpu_memory`"), text
    # the group ended with its failure; without a plan, or a phase the plan has none for, it still says so
    from trainer.workers import gpu_oom

    line = gpu_oom.oom_line(GPU_OOM)
    assert line == GPU_OOM and gpu_oom.capacity_gib(line) == 79.11
    assert "no memory plan figure for it (no plan for this run)" in gpu_oom.describe(line, "gen", "no plan for this run")
    assert gpu_oom.plan_phase(plan_config(cfg, 79.11), "old_log_prob") is None
    assert gpu_oom.oom_line("RuntimeError: shape mismatch") is None


def _memory_cgroup_or_skip(limit: int) -> Path:
    """A memory cgroup limited to `limit` bytes; without one the test skips (fails under CI=true)."""
    cgroup = _memory_cgroup(limit)
    if cgroup is None:
        reason = "needs root and a writable memory cgroup (v1 memory controller or v2) to limit a rank"
        if CI:
            pytest.fail(reason + ", but CI=true requires this test to run")
        pytest.skip(reason)
    return cgroup


def ray_at(start: Any, threshold: float | None) -> Any:
    """A local Ray whose memory monitor kills at `threshold` of the node's memory (None: Ray's own)."""
    env = {} if threshold is None else {"RAY_memory_usage_threshold": f"{threshold:.3f}",
                                        "RAY_memory_monitor_refresh_ms": "100"}
    return start(**env)


def _group(samples: Path) -> Any:
    """One rank that samples its memory into `samples`, as the driver starts them."""
    from trainer.workers.ray_group import make_placement_group, start_colocated

    group = start_colocated({"actor": Hog}, None, 1, slot=make_placement_group(1, 1), world_size=1,
                            samples=samples)["actor"]
    wait_until(lambda: read_sample(samples, 0) is not None, "the rank's first memory sample")
    return group


def _used_fraction() -> tuple[float, float]:
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    return 1 - info["MemAvailable"] / info["MemTotal"], info["MemTotal"] / (1 << 30)


def _group_under_a_threshold(start: Any, samples: Path, margin_gib: float, tries: int = 3) -> Any:
    """One rank under a Ray whose memory monitor kills at `margin_gib` above what the node uses
    now. Ray's monitor reads the whole node, where other work (CI runs its stages side by side)
    may grow by the margin before the rank has started: Ray then kills the idle rank at its
    start. That start is not the kill under test; it is retried with a new Ray and a new
    threshold, up to `tries` times, each named on stdout."""
    from trainer.workers.group import WorkerFailure

    for attempt in range(1, tries + 1):
        used, total_gib = _used_fraction()
        ray = ray_at(start, min(0.95, used + margin_gib / total_gib))
        try:
            return _group(samples)
        except WorkerFailure as err:
            if err.kind != "oom" or attempt == tries:
                raise
            print(f"the node's other load passed the threshold before the rank started (try {attempt}): {err}")
            ray.shutdown()
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_a_rank_ray_s_memory_monitor_kills_is_named_with_its_node_and_memory(ray_starter: Any, tmp_path: Path) -> None:
    from trainer.workers.group import WorkerFailure

    write_plan(tmp_path, None, use_gpu=False)  # as the driver does on a CPU cluster
    group = _group_under_a_threshold(ray_starter, tmp_path, margin_gib=3.0)
    pid = group.nodes[0]["pid"]
    with pytest.raises(WorkerFailure) as failed:
        group.run("eat", 8.0, None, 0.25)  # slow enough for the sampler (1 s) to see it grow
    text = str(failed.value)
    assert f"worker group `actor` rank 0 on node `{socket.gethostname()}`" in text and "during `eat`" in text, text
    assert f"was killed for memory by Ray's memory monitor: process {pid} (ray::" in text, text
    assert " GB of " in text and "Fix: " in text, text
    assert "; its last memory sample (" in text and " GB resident, peak " in text, text
    assert "under a limit of " in text and "; no memory plan for this run (the memory plan is made for GPU" in text
    details = failed.value.details
    assert failed.value.kind == "oom" and (details["rank"], details["pid"]) == (0, pid), details
    # Ray's figure at the kill, and the rank's own: the node's other load moves the moment of the kill
    assert details["resident_gb"] > 0.3 and details["limit_gb"] > details["resident_gb"], details
    assert details["sampled_rss_gb"] > 0.1 and time.time() - details["sampled_at"] < 60, details


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A new memory cgroup with `limit_bytes` (v1's memory controller or v2), or None when this
    process cannot make one (not root, or no writable memory controller)."""
    for root, limit in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"), (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / limit).exists() and not (root / "cgroup.controllers").exists():
            continue
        group = root / f"hpcrl-test-oom-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / limit).write_text(str(limit_bytes))
            return group
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_a_rank_the_kernel_kills_for_memory_is_named_from_the_kernel_log(ray_starter: Any, tmp_path: Path) -> None:
    from trainer.workers.group import WorkerFailure

    cgroup = _memory_cgroup_or_skip(512 << 20)
    try:
        ray_at(ray_starter, None)
        from trainer.config import load_config
        from trainer.memplan import GIB, host_plan

        cfg = load_config([f"actor_rollout_ref.model.path={REPO / 'tests/data/model_configs/Qwen2.5-0.5B'}"])
        write_plan(tmp_path, cfg, use_gpu=True)  # as the driver does on a GPU cluster
        group = _group(tmp_path)
        pid = group.nodes[0]["pid"]
        with pytest.raises(WorkerFailure) as failed:
            group.run("eat", 2.0, str(cgroup))
        text = str(failed.value)
        assert f"worker group `actor` rank 0 on node `{socket.gethostname()}`" in text, text
        assert f"was killed for memory by the kernel's OOM killer: process {pid} (" in text, text
        import re

        held = float(re.search(r"holding ([\d.]+) GB", text).group(1))  # type: ignore[union-attr]
        assert 0.3 < held < 1.5, text  # about the 512 MiB limit (pages charged before the move count too)
        assert f"the limit of its cgroup /{cgroup.name} is 0.54 GB" in text, text
        head = sum(b for _, b in host_plan(cfg).terms) / GIB
        assert f"the memory plan's host figure for the head node `{socket.gethostname()}`: {head:.2f} GiB" in text
        assert failed.value.kind == "oom" and failed.value.details["plan_host_gib"] == round(head, 2)
    finally:
        _remove(cgroup)


def _remove(cgroup: Path) -> None:
    def removed() -> bool:  # the killed process leaves the cgroup as it is reaped
        try:
            cgroup.rmdir()
        except OSError:
            return False
        return True

    wait_until(removed, f"removal of {cgroup}")


@pytest.mark.slow
def test_a_rank_the_kernel_kills_is_named_from_its_cgroup_s_count_where_the_log_is_unreadable(
        ray_starter: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root (or the rank on another node): no kernel log; the rank's cgroup's `oom_kill`
    count, read against its last sample, says the kernel killed it."""
    from trainer.workers import memory_death
    from trainer.workers.group import WorkerFailure

    cgroup = _memory_cgroup_or_skip(512 << 20)
    monkeypatch.setattr(memory_death, "kernel_log", lambda: None)  # the one seam: `dmesg` unreadable
    try:
        ray_at(ray_starter, None)
        group = _group(tmp_path)
        pid = group.nodes[0]["pid"]
        group.run("join", str(cgroup))  # a job's ranks live in its cgroup from their start
        wait_until(lambda: getattr(read_sample(tmp_path, 0), "cgroup", None) == str(cgroup), "sample in the cgroup")
        with pytest.raises(WorkerFailure) as failed:
            group.run("eat", 2.0)
        text = str(failed.value)
        assert f"worker group `actor` rank 0 on node `{socket.gethostname()}`" in text, text
        assert (f"was killed for memory by the kernel's OOM killer: process {pid} (ray::" in text
                and f"(the `oom_kill` count of its cgroup `{cgroup}` rose from 0 to 1 after its last sample)"
                in text), text
        assert "; it lived under a limit of 0.54 GB on node " in text, text  # the cgroup's limit
        assert "; its last memory sample (" in text, text
        assert "; no memory plan for this run" in text, text  # none written
        assert failed.value.details["limit_gb"] == pytest.approx(0.537, abs=0.001)
    finally:
        _remove(cgroup)
