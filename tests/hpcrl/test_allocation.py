"""Ray sized to what Slurm granted (issue 16 item 1): `hpcrl.allocation` from Slurm's variables
and fake cgroup trees (real files under tmp_path), the profile's `ray.*` overrides, and the
`ray start` arguments the node agent builds from them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpcrl.agent.jobfile import JobFileError, parse_job
from hpcrl.agent.launch import ray_start_argv
from hpcrl.agent.node import Node
from hpcrl.agent.ports import PortRange, block_at
from hpcrl.allocation import (
    MIB,
    OBJECT_STORE_MAX,
    OBJECT_STORE_MIN,
    SLOW_STORAGE_LIMIT,
    AllocationError,
    CgroupFiles,
    RayOverrides,
    default_object_store,
    node_allocation,
    parse_size,
)
from hpcrl.rundir import RunPaths
from hpcrl.slurm_env import job_context

GIB = 1024**3
SLURM = {"SLURM_JOB_ID": "42"}


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def meminfo(root: Path, available_gib: int = 200) -> None:
    write(root, "proc/meminfo", f"MemTotal:       {256 * 1024**2} kB\n"
                                f"MemFree:        1000 kB\nMemAvailable:   {available_gib * 1024**2} kB")


def v2_tree(root: Path, cpus: str = "0-127", job_mem: str = "max", step_mem: str = "max",
            cpu_max: str = "max 100000") -> CgroupFiles:
    """A cgroup v2 host: the process in /system.slice/slurmstepd.scope/job_42/step_0."""
    write(root, "proc/self/cgroup", "0::/system.slice/slurmstepd.scope/job_42/step_0")
    base = "sys/fs/cgroup"
    write(root, f"{base}/cgroup.controllers", "cpuset cpu io memory pids")
    job = f"{base}/system.slice/slurmstepd.scope/job_42"
    write(root, f"{job}/memory.max", job_mem)
    write(root, f"{job}/cpu.max", cpu_max)
    write(root, f"{job}/step_0/memory.max", step_mem)
    write(root, f"{job}/step_0/cpu.max", "max 100000")
    write(root, f"{job}/step_0/cpuset.cpus.effective", cpus)
    meminfo(root)
    return CgroupFiles(root)


def v1_tree(root: Path, cpus: str, mem: int, quota: int = -1) -> CgroupFiles:
    """A cgroup v1 host (hybrid: an empty unified mount beside the v1 controllers)."""
    write(root, "proc/self/cgroup", "12:memory:/slurm/uid_0/job_42/step_0\n"
                                    "5:cpu,cpuacct:/slurm/uid_0/job_42/step_0\n"
                                    "3:cpuset:/slurm/uid_0/job_42/step_0\n0::/")
    (root / "sys/fs/cgroup/unified").mkdir(parents=True)
    step = "slurm/uid_0/job_42/step_0"
    write(root, f"sys/fs/cgroup/memory/{step}/memory.limit_in_bytes", str(2**63 - 4096))
    write(root, "sys/fs/cgroup/memory/slurm/uid_0/job_42/memory.limit_in_bytes", str(mem))
    write(root, f"sys/fs/cgroup/cpuset/{step}/cpuset.effective_cpus", cpus)
    write(root, f"sys/fs/cgroup/cpu,cpuacct/{step}/cpu.cfs_quota_us", str(quota))
    write(root, f"sys/fs/cgroup/cpu,cpuacct/{step}/cpu.cfs_period_us", "100000")
    meminfo(root)
    return CgroupFiles(root)


# ---------------------------------------------------------------- CPUs


def test_cpus_are_slurms_share_not_the_node(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, cpus="0-127")
    alloc = node_allocation({**SLURM, "SLURM_CPUS_ON_NODE": "16"}, files=files, node_cpus=128)
    assert alloc.cpus == 16 and alloc.sources["cpus"] == "SLURM_CPUS_ON_NODE"


def test_cpus_are_the_cpuset_when_it_is_smaller(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, cpus="0-3,64-66")
    alloc = node_allocation({**SLURM, "SLURM_CPUS_ON_NODE": "16"}, files=files, node_cpus=128)
    assert alloc.cpus == 7 and alloc.sources["cpus"].endswith("step_0/cpuset.cpus.effective")


def test_cpu_quota_of_an_ancestor_counts(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, cpus="0-127", cpu_max="250000 100000")
    alloc = node_allocation(SLURM, files=files, node_cpus=128)
    assert alloc.cpus == 2 and alloc.sources["cpus"].endswith("job_42/cpu.max")


def test_without_slurm_or_cgroup_the_node_counts(tmp_path: Path) -> None:
    meminfo(tmp_path)
    alloc = node_allocation({}, files=CgroupFiles(tmp_path), node_cpus=12)
    assert alloc.cpus == 12 and alloc.sources["cpus"] == "the node's CPU count"


def test_cgroup_v1(tmp_path: Path) -> None:
    files = v1_tree(tmp_path, cpus="2-5", mem=3 * GIB, quota=300000)
    alloc = node_allocation({**SLURM, "SLURM_CPUS_ON_NODE": "8"}, files=files, node_cpus=64)
    assert alloc.cpus == 3 and alloc.sources["cpus"].endswith("cpu.cfs_quota_us")
    assert alloc.memory_bytes == 3 * GIB
    assert alloc.sources["memory"].endswith("job_42/memory.limit_in_bytes")
    files = v1_tree(tmp_path / "b", cpus="2-5", mem=2**63 - 4096)  # v1's "no limit"
    alloc = node_allocation(SLURM, files=files, node_cpus=64)
    assert alloc.cpus == 4 and alloc.memory_bytes == 200 * GIB


# ---------------------------------------------------------------- GPUs


def test_gpus_from_slurms_ids_are_exported(tmp_path: Path) -> None:
    env = {**SLURM, "SLURM_JOB_GPUS": "2,3,5,6", "SLURM_GPUS_ON_NODE": "4"}
    alloc = node_allocation(env, files=v2_tree(tmp_path))
    assert alloc.gpus == 4 and alloc.gpu_ids == ("2", "3", "5", "6")
    assert alloc.device_env == {"CUDA_VISIBLE_DEVICES": "2,3,5,6", "HIP_VISIBLE_DEVICES": "2,3,5,6"}


def test_step_gpus_win_over_job_gpus_and_ranges_expand(tmp_path: Path) -> None:
    env = {**SLURM, "SLURM_JOB_GPUS": "0-7", "SLURM_STEP_GPUS": "4-5"}
    alloc = node_allocation(env, files=v2_tree(tmp_path))
    assert alloc.gpus == 2 and alloc.gpu_ids == ("4", "5")


def test_the_visible_list_slurm_set_gives_the_ids(tmp_path: Path) -> None:
    # ConstrainDevices renumbers: the step sees 0,1 while Slurm's ids are physical
    env = {**SLURM, "SLURM_JOB_GPUS": "4,5", "CUDA_VISIBLE_DEVICES": "0,1"}
    alloc = node_allocation(env, files=v2_tree(tmp_path))
    assert alloc.gpus == 2 and alloc.gpu_ids == ("0", "1")
    assert alloc.device_env == {"CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}


def test_a_whole_node_list_is_cut_to_the_granted_count(tmp_path: Path) -> None:
    env = {**SLURM, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "4"}
    alloc = node_allocation(env, files=v2_tree(tmp_path))
    assert alloc.gpus == 4 and alloc.sources["gpus"] == "SLURM_GPUS_ON_NODE"
    assert alloc.device_env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "0,1,2,3"}


def test_amd_nodes_keep_rocr_and_cuda_equals_hip_in_its_numbering(tmp_path: Path) -> None:
    env = {**SLURM, "ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "0,1,2,3",
           "SLURM_GPUS_ON_NODE": "4"}
    alloc = node_allocation(env, files=v2_tree(tmp_path))
    assert alloc.gpus == 4
    assert alloc.device_env == {"ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "0,1,2,3",
                                "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = {**SLURM, "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "HIP_VISIBLE_DEVICES": "0,1"}
    assert node_allocation(env, files=v2_tree(tmp_path / "b")).gpus == 2
    alloc = node_allocation({**SLURM, "ROCR_VISIBLE_DEVICES": "4,6"}, files=v2_tree(tmp_path / "c"))
    assert alloc.device_env == {"ROCR_VISIBLE_DEVICES": "4,6", "HIP_VISIBLE_DEVICES": "0,1",
                                "CUDA_VISIBLE_DEVICES": "0,1"}
    # Slurm's AMD gres sets CUDA_ in the physical numbering beside ROCR_: HIP's numbering wins
    env = {**SLURM, "ROCR_VISIBLE_DEVICES": "4,6", "CUDA_VISIBLE_DEVICES": "4,6"}
    alloc = node_allocation(env, files=v2_tree(tmp_path / "d"))
    assert alloc.device_env == {"ROCR_VISIBLE_DEVICES": "4,6", "HIP_VISIBLE_DEVICES": "0,1",
                                "CUDA_VISIBLE_DEVICES": "0,1"}


def test_hip_and_cuda_naming_different_devices_are_refused(tmp_path: Path) -> None:
    env = {**SLURM, "HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(AllocationError, match="name different devices.*set only one"):
        node_allocation(env, files=v2_tree(tmp_path))
    env = {**SLURM, "HIP_VISIBLE_DEVICES": "2,3"}
    assert node_allocation(env, files=v2_tree(tmp_path / "b")).device_env == {
        "HIP_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_a_slurm_job_without_gpus_gets_none_and_outside_slurm_ray_counts(tmp_path: Path) -> None:
    files = v2_tree(tmp_path)
    alloc = node_allocation(SLURM, files=files)
    assert alloc.gpus == 0 and "--num-gpus=0" in alloc.ray_start_args()
    assert node_allocation({**SLURM, "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, files=files).gpus == 0
    alloc = node_allocation({}, files=files)
    assert alloc.gpus is None and not any(a.startswith("--num-gpus") for a in alloc.ray_start_args())


# ---------------------------------------------------------------- memory and the object store


def test_memory_is_the_smallest_source(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, job_mem=str(6 * GIB))
    alloc = node_allocation({**SLURM, "SLURM_MEM_PER_NODE": "8192"}, files=files)
    assert alloc.memory_bytes == 6 * GIB and alloc.sources["memory"].endswith("job_42/memory.max")
    alloc = node_allocation({**SLURM, "SLURM_MEM_PER_NODE": "4096"}, files=files)
    assert alloc.memory_bytes == 4 * GIB and alloc.sources["memory"] == "SLURM_MEM_PER_NODE"
    env = {**SLURM, "SLURM_MEM_PER_CPU": "1024", "SLURM_CPUS_ON_NODE": "3"}
    alloc = node_allocation(env, files=files, node_cpus=128)
    assert alloc.memory_bytes == 3 * GIB and alloc.cpus == 3
    env = {**SLURM, "SLURM_MEM_PER_GPU": "2048", "SLURM_GPUS_ON_NODE": "2"}
    assert node_allocation(env, files=files).memory_bytes == 4 * GIB


def test_memory_defaults_to_the_nodes_available_memory(tmp_path: Path) -> None:
    files = v2_tree(tmp_path)
    alloc = node_allocation({**SLURM, "SLURM_MEM_PER_NODE": "0"}, files=files)  # 0: whole node
    assert alloc.memory_bytes == 200 * GIB
    assert alloc.sources["memory"] == "the node's available memory"


def test_object_store_is_30_percent_and_ray_memory_the_rest(tmp_path: Path) -> None:
    alloc = node_allocation({**SLURM, "SLURM_MEM_PER_NODE": "1000"}, files=v2_tree(tmp_path))
    assert alloc.object_store_bytes == int(1000 * MIB * 0.3)
    assert alloc.heap_bytes == 1000 * MIB - alloc.object_store_bytes
    args = alloc.ray_start_args()
    assert f"--memory={alloc.heap_bytes}" in args
    assert f"--object-store-memory={alloc.object_store_bytes}" in args


def test_default_object_store_caps_like_ray() -> None:
    assert default_object_store(10 * GIB, None) == int(10 * GIB * 0.3)
    assert default_object_store(100 * GIB, 64 * MIB) == SLOW_STORAGE_LIMIT  # small /dev/shm
    assert default_object_store(100 * GIB, 512 * GIB) == int(100 * GIB * 0.3)
    assert default_object_store(2000 * GIB, 2000 * GIB) == OBJECT_STORE_MAX
    assert default_object_store(100 * MIB, None) == OBJECT_STORE_MIN


def test_profile_overrides_win(tmp_path: Path) -> None:
    over = RayOverrides.from_profile({"num_cpus": 3, "num_gpus": 1, "memory": "2G",
                                      "object_store_memory": "512M"})
    env = {**SLURM, "SLURM_CPUS_ON_NODE": "16", "SLURM_JOB_GPUS": "0,1"}
    alloc = node_allocation(env, over, files=v2_tree(tmp_path))
    assert (alloc.cpus, alloc.gpus, alloc.memory_bytes, alloc.object_store_bytes) == (
        3, 1, 2 * GIB, 512 * MIB)
    assert alloc.sources["cpus"] == "profile ray.num_cpus"
    assert alloc.ray_start_args() == ["--num-cpus=3", "--num-gpus=1",
                                      f"--memory={1536 * MIB}", f"--object-store-memory={512 * MIB}"]
    assert RayOverrides.from_profile({"num_cpus": None, "memory": None}) == RayOverrides()


def test_the_allocation_is_readable() -> None:
    alloc = node_allocation({**SLURM, "SLURM_CPUS_ON_NODE": "2", "SLURM_MEM_PER_NODE": "1000"},
                            files=CgroupFiles(Path("/nonexistent")), node_cpus=8)
    text = alloc.describe()
    assert "2 CPU(s), 0 GPU(s), memory 1000 MiB (object store 300 MiB)" in text
    assert "cpus from SLURM_CPUS_ON_NODE" in text and "memory from SLURM_MEM_PER_NODE" in text
    assert alloc.to_dict()["heap_bytes"] == 1000 * MIB - alloc.object_store_bytes


# ---------------------------------------------------------------- errors name the culprit


@pytest.mark.parametrize(("env", "culprit"), [
    ({"SLURM_CPUS_ON_NODE": "16(x2)"}, "SLURM_CPUS_ON_NODE"),
    ({"SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE"),
    ({"SLURM_JOB_GPUS": "0,x"}, "SLURM_JOB_GPUS"),
    ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "CUDA_VISIBLE_DEVICES"),
    ({"ROCR_VISIBLE_DEVICES": "0 1"}, "ROCR_VISIBLE_DEVICES"),
    ({"SLURM_MEM_PER_NODE": "4G"}, "SLURM_MEM_PER_NODE"),
])
def test_malformed_values_are_named(tmp_path: Path, env: dict[str, str], culprit: str) -> None:
    with pytest.raises(AllocationError, match=culprit):
        node_allocation({**SLURM, **env}, files=v2_tree(tmp_path))


def test_malformed_cgroup_files_are_named(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, cpus="0-a", job_mem=str(GIB))
    with pytest.raises(AllocationError, match="cpuset.cpus.effective"):
        node_allocation(SLURM, files=files)
    files = v2_tree(tmp_path / "b", job_mem="lots")
    with pytest.raises(AllocationError, match="memory.max"):
        node_allocation(SLURM, files=files)


def test_too_little_memory_for_an_object_store(tmp_path: Path) -> None:
    with pytest.raises(AllocationError, match="--mem"):
        node_allocation({**SLURM, "SLURM_MEM_PER_NODE": "50"}, files=v2_tree(tmp_path))


@pytest.mark.parametrize(("ray", "message"), [
    ({"num_cpus": -1}, "`ray.num_cpus` is -1"),
    ({"num_gpus": True}, "`ray.num_gpus` is True"),
    ({"memory": "12X"}, "`ray.memory` is '12X', not a size"),
    ({"object_store_memory": "10M"}, "at least 75M"),
    ({"memory": "1G", "object_store_memory": "1G"}, "must be less than `ray.memory`"),
])
def test_bad_overrides(ray: dict, message: str) -> None:
    with pytest.raises(AllocationError, match=message.replace("(", r"\(")):
        RayOverrides.from_profile(ray)


def test_sizes() -> None:
    assert parse_size("64G", "x") == 64 * GIB and parse_size("1.5T", "x") == int(1.5 * 1024 * GIB)
    assert parse_size(1000, "x") == 1000 and parse_size("512MiB", "x") == 512 * MIB
    assert parse_size("2gb", "x") == 2 * GIB


# ---------------------------------------------------------------- the agent's side


def test_job_file_carries_the_overrides() -> None:
    job = parse_job({"payload": ["true"], "profile": {"ray": {"num_cpus": 4, "memory": "8G"}}})
    assert job.ray_overrides == RayOverrides(num_cpus=4, memory=8 * GIB)
    assert parse_job({"payload": ["true"]}).ray_overrides == RayOverrides()
    with pytest.raises(JobFileError, match="profile.ray.num_gpus"):
        parse_job({"payload": ["true"], "profile": {"ray": {"num_gpus": -2}}})


def test_ray_start_argv_is_sized_for_head_and_worker(tmp_path: Path) -> None:
    job = parse_job({"payload": ["true"]})
    alloc = node_allocation({**SLURM, "SLURM_CPUS_ON_NODE": "3", "SLURM_MEM_PER_NODE": "2000",
                             "SLURM_JOB_GPUS": "1"}, files=v2_tree(tmp_path), node_cpus=64)
    ports = block_at(PortRange(), 0)
    store = int(2000 * MIB * 0.3)
    sized = ["--num-cpus=3", "--num-gpus=1", f"--memory={2000 * MIB - store}",
             f"--object-store-memory={store}"]
    for head in (True, False):
        argv = ray_start_argv(job, head, "10.0.0.1", tmp_path, ports, "10.0.0.1:6379", alloc)
        assert argv[:5] == ["start", "--block", "--node-ip-address=10.0.0.1",
                            f"--temp-dir={tmp_path}", "--disable-usage-stats"]
        assert argv[5:9] == sized
        assert ("--head" in argv) == head and ("--address=10.0.0.1:6379" in argv) != head


def test_memory_per_cpu_counts_the_granted_cpus_not_the_override(tmp_path: Path) -> None:
    files = v2_tree(tmp_path, cpus="0-1")
    alloc = node_allocation({**SLURM, "SLURM_MEM_PER_CPU": "1024"},
                            RayOverrides(num_cpus=8), files=files, node_cpus=64)
    assert alloc.cpus == 8 and alloc.memory_bytes == 2 * GIB


def test_the_granted_devices_reach_the_container_even_when_slurm_set_them(tmp_path: Path) -> None:
    """A container starts from a clean environment: the agent passes the device variables
    although they equal its own (Slurm set them for the step), and not the rest of its env."""
    env = {**SLURM, "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "CUDA_VISIBLE_DEVICES": "2,3",
           "UNRELATED": "x"}
    job = parse_job({"payload": ["true"],
                     "profile": {"container": {"runtime": "podman", "image": "img"}}})
    seen: list[dict[str, str]] = []

    def wrap(job, argv, values, binds, workdir, name):
        seen.append(dict(values))
        return list(argv), {}

    ctx = job_context(env)
    node = Node(tmp_path, env, ctx, RunPaths(tmp_path, 0), job, logging.getLogger("t"), wrap, {},
                tmp_path / "tmp")
    node.in_container("ray", ["ray", "start"], {**env, "RAY_AUTH_MODE": "token"}, "/w")
    assert seen == [{"CUDA_VISIBLE_DEVICES": "2,3", "RAY_AUTH_MODE": "token"}]
