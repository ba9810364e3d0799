"""Each rank's memory samples (`trainer.workers.memory_samples`): `/proc/<pid>/status` and the
cgroup's `oom_kill` count read from text captured on this machine, the sampler writing what this
process really holds (and only when it moved), the memory plan's host figure written beside the
samples, and a death's description with both."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until
from trainer.config import load_config
from trainer.memplan import GIB, HOST_PROCESS, host_plan, read_model
from trainer.workers.memory_death import (
    MemoryDeath,
    death_details,
    describe,
    last_seen,
    memory_limit_bytes,
    oom_kills,
)
from trainer.workers.memory_samples import (
    PLAN_FILE,
    RssSampler,
    read_plan,
    read_sample,
    read_status,
    take_sample,
    write_plan,
)

DATA = REPO / "tests" / "data"
QWEN_7B = DATA / "model_configs" / "Qwen2.5-7B-Instruct"
FLAGSHIP = [f"actor_rollout_ref.model.path={QWEN_7B}", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]


def test_proc_status_gives_the_resident_set_and_its_peak() -> None:
    rss, hwm = read_status((DATA / "proc_status_trainer.txt").read_text())
    assert (rss, hwm) == (10884 * 1024, 10884 * 1024)
    with pytest.raises(ValueError, match="not the text of /proc/<pid>/status"):
        read_status("Name:\tpython3\n")


def test_the_oom_kill_count_is_read_from_a_v1_cgroup_s_oom_control(tmp_path: Path) -> None:
    # captured here after the kernel killed a process past its cgroup's 64 MiB limit
    (tmp_path / "memory.oom_control").write_text((DATA / "memory" / "cgroup_v1_oom_control.txt").read_text())
    assert oom_kills(tmp_path) == 1
    assert oom_kills(tmp_path / "gone") is None


def test_the_limit_is_the_lowest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    leaf = tmp_path / "job" / "step"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")  # v2's "no limit" on the step
    (tmp_path / "job" / "memory.max").write_text(f"{3 << 30}\n")  # Slurm's --mem on the job
    assert memory_limit_bytes(leaf) == 3 << 30
    total = memory_limit_bytes(None)  # no cgroup: the node's MemTotal
    assert total is not None and total > 3 << 30
    (leaf / "memory.max").write_text(f"{total * 2}\n")  # a limit above the node's memory is none
    assert memory_limit_bytes(leaf) == 3 << 30


def test_the_sampler_writes_what_this_process_holds_and_only_when_it_moves(tmp_path: Path) -> None:
    sampler = RssSampler(tmp_path, rank=3)
    sampler.sample_once()
    first = read_sample(tmp_path, 3)
    assert first is not None and (first.rank, first.pid, first.host) == (3, os.getpid(), socket.gethostname())
    rss, _ = read_status(Path("/proc/self/status").read_text())
    assert abs(first.rss_bytes - rss) < 32 << 20 and first.hwm_bytes >= first.rss_bytes
    assert first.limit_bytes is not None and first.limit_bytes <= memory_limit_bytes(None)  # type: ignore[operator]
    sampler.sample_once()  # nothing moved: the file is kept
    assert read_sample(tmp_path, 3) == first
    held = bytearray(256 << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # resident, not only reserved
    sampler.sample_once()
    grown = read_sample(tmp_path, 3)
    assert grown is not None and grown.rss_bytes - first.rss_bytes > 200 << 20, (first, grown)
    assert grown.hwm_bytes >= grown.rss_bytes
    del held
    assert read_sample(tmp_path, 4) is None and read_sample(None, 3) is None


def test_the_sampling_thread_keeps_sampling_until_stopped(tmp_path: Path) -> None:
    sampler = RssSampler(tmp_path, rank=0, interval_s=0.05, heartbeat_s=0.0)  # every sample written
    sampler.start()
    try:
        seen: set[float] = set()

        def three_seen() -> bool:
            sample = read_sample(tmp_path, 0)
            if sample is not None:
                seen.add(sample.time)
            return len(seen) >= 3

        wait_until(three_seen, "three distinct samples", timeout_s=30, poll_s=0.02)
    finally:
        sampler.stop()
        sampler.join(timeout=10)
    assert not sampler.is_alive()


def test_the_plan_s_host_figure_is_written_per_node(tmp_path: Path) -> None:
    cfg = load_config(FLAGSHIP)
    record = write_plan(tmp_path, cfg, use_gpu=True)
    assert json.loads((tmp_path / PLAN_FILE).read_text()) == record == read_plan(tmp_path)
    # 8 workers each: the process baseline and the reference model's offloaded fp32 shard (an
    # eighth of 7.6 B parameters), nothing else offloaded; the head adds the driver's 2 GiB
    params = read_model(str(QWEN_7B)).params()
    per_worker = HOST_PROCESS + params * 4 / 8
    assert record["node_gib"] == pytest.approx(8 * per_worker / GIB, abs=0.02)
    assert record["head_gib"] == pytest.approx(record["node_gib"] + 2, abs=0.01)
    assert record["head"] == socket.gethostname()
    assert record["head_gib"] == round(sum(b for _, b in host_plan(cfg).terms) / GIB, 2)
    offloaded = write_plan(tmp_path, load_config([*FLAGSHIP, "actor_rollout_ref.actor.fsdp_config.param_offload=True"]),
                           use_gpu=True)
    assert offloaded["node_gib"] == pytest.approx(record["node_gib"] + params * 4 / GIB, abs=0.02)
    assert write_plan(tmp_path, cfg, use_gpu=False) == {
        "none": "the memory plan is made for GPU jobs, and this run has no GPU"}
    missing = write_plan(tmp_path, load_config([*FLAGSHIP[1:], f"actor_rollout_ref.model.path={tmp_path}"]),
                         use_gpu=True)
    assert missing["none"].startswith("it could not be made: no `config.json` at")


def test_a_death_is_described_with_the_last_sample_and_the_plan(tmp_path: Path) -> None:
    RssSampler(tmp_path, rank=1).sample_once()
    sample = read_sample(tmp_path, 1)
    assert sample is not None
    node = {"rank": 1, "hostname": socket.gethostname(), "pid": os.getpid()}
    assert "; no memory plan for this run" in last_seen(node, tmp_path)
    write_plan(tmp_path, load_config(FLAGSHIP), use_gpu=True)
    plan = read_plan(tmp_path)
    assert plan is not None
    seen = last_seen(node, tmp_path, ended=sample.time + 4)
    assert seen.startswith(f"its last memory sample (4 s before it was found dead): {sample.rss_bytes / 1e9:.2f} GB "
                           f"resident, peak {sample.hwm_bytes / 1e9:.2f} GB, under a limit of "), seen
    assert seen.endswith(f"the memory plan's host figure for the head node `{node['hostname']}`: "
                         f"{plan['head_gib']:.2f} GiB (with the driver)"), seen
    other = {**plan, "head": "gpu001"}
    (tmp_path / PLAN_FILE).write_text(json.dumps(other))
    assert f"for node `{node['hostname']}`: {plan['node_gib']:.2f} GiB ({plan['head_gib']:.2f} GiB on the head" \
        in last_seen(node, tmp_path)
    death = MemoryDeath("the kernel's OOM killer", pid=os.getpid(), process="python3", resident_gb=1.5,
                        node=node["hostname"], node_limit_gb=2.0, sample=sample, plan=other)
    text = describe(death)
    assert text.startswith(f"was killed for memory by the kernel's OOM killer: process {os.getpid()} (python3) "
                           f"holding 1.50 GB; it lived under a limit of 2.00 GB on node {node['hostname']} (its memory "
                           "cgroup's, or the node's memory); its last memory "
                           "sample: "), text
    details = death_details(death, node)
    assert (details["rank"], details["plan_host_gib"], details["limit_gb"]) == (1, plan["node_gib"], 2.0)
    assert details["sampled_rss_gb"] == round(sample.rss_bytes / 1e9, 3) and details["no_plan"] is None
    assert take_sample(1).pid == os.getpid()
