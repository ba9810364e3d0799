"""`hpcrl doctor`: the parsers (NCCL/RCCL's log, the NVIDIA driver file), the rows from what the
nodes report, the table, the record of a pass and `hpcrl submit`'s note. The job itself runs on
the lab: `tests/lab/test_agent.py::test_sites_new_profile_runs_a_job_unchanged`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hpcrl import doctor_record
from hpcrl.commands import doctor
from hpcrl.doctor_check import (
    allreduce_rows,
    bus_bandwidth_gbps,
    check_nodes,
    cuda_driver_problem,
    node_report,
    parse_nccl_transport,
    parse_nvidia_driver,
    prerequisite_rows,
    sandbox_report,
    sandbox_row,
)
from hpcrl.profile_load import load_profile
from tests.conftest import DATA

# Lines composed in the format of NCCL's `NCCL_DEBUG=INFO` log (INIT,NET), not captured from a
# cluster: an IB run and one that finds no HCA and falls back to sockets
NCCL_IB = """gpu01:1234:1234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.2.3<0>
gpu01:1234:1234 [0] NCCL INFO Using network IB
gpu01:1234:1290 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0
"""
NCCL_SOCKET = """gpu01:1234:1234 [0] NCCL INFO NET/IB : No device found.
gpu01:1234:1234 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.1.5<0>
gpu01:1234:1234 [0] NCCL INFO Using network Socket
gpu01:1234:1290 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_transport_from_the_nccl_log() -> None:
    assert parse_nccl_transport(NCCL_IB) == "IB"
    assert parse_nccl_transport(NCCL_SOCKET.replace("NET/IB : No device found.", "")) == "Socket"
    assert parse_nccl_transport("gpu01 NCCL INFO Bootstrap : Using eth0") is None


def test_a_socket_fallback_after_no_hca_is_socket() -> None:
    """`NET/IB : No device found` names NET/IB too: the lines that carry data decide."""
    assert parse_nccl_transport(NCCL_SOCKET) == "Socket"


def test_bus_bandwidth_is_nccl_tests_busbw() -> None:
    assert bus_bandwidth_gbps(1_000_000_000, 2, 1.0) == pytest.approx(1.0)
    assert bus_bandwidth_gbps(1_000_000_000, 4, 0.5) == pytest.approx(3.0)


def test_nvidia_driver_and_cuda() -> None:
    text = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert parse_nvidia_driver(text) == (550, 54, 15)
    assert parse_nvidia_driver("") is None
    # an H200 node's file (the open kernel module), and what `node_report` saw there in torch
    # 2.11+cu130: driver 580.159.04 runs CUDA 13.0
    h200 = parse_nvidia_driver((DATA / "proc_driver_nvidia_version_h200.txt").read_text())
    assert h200 == (580, 159, 4) and cuda_driver_problem("13.0", h200) is None
    assert cuda_driver_problem("12.8", (550, 54, 15)) is None
    assert "needs driver >= 580.0" in str(cuda_driver_problem("13.0", (550, 54, 15)))
    assert "needs driver >= 525.60" in str(cuda_driver_problem("12.1", (470, 82, 1)))


def report(host: str, devices: int, granted: int, **kw: object) -> dict:
    base = {"hostname": host, "container": "podman", "torch": "2.9.0", "hip": "7.0", "cuda": None,
            "devices": [{"name": "AMD Instinct MI300X", "memory_gib": 191.5}] * devices,
            "granted": granted, "kernel": "256x256 matmul on 8 GPU(s)", "kernel_ok": True,
            "driver": "6.10.5", "driver_problem": None, "memory_bytes": 1800 * 2**30}
    return {**base, **kw}


def status(rows: list[dict], check: str) -> str:
    (found,) = [r for r in rows if r["check"] == check]
    return found["status"]


def test_node_rows_pass_and_fail_with_fixes() -> None:
    rows = check_nodes([report("gpu01", 8, 8), report("gpu02", 0, 8, hip=None)], "podman", "amd", 192)
    assert status(rows, "container starts on every node") == "PASS"
    assert status(rows, "gpu01: GPUs torch sees = granted") == "PASS"
    assert status(rows, "gpu01: GPU memory vs the profile") == "PASS"  # 191.5 of 192: within 5%
    assert status(rows, "gpu01: host RAM vs the GPUs' memory") == "PASS"
    bad = next(r for r in rows if r["check"] == "gpu02: GPUs torch sees = granted")
    assert bad["status"] == "FAIL" and "keep-groups" in bad["fix"]
    cuda = check_nodes([report("gpu01", 8, 8, hip=None, cuda="12.8")], "podman", "amd", 192)
    assert status(cuda, "gpu01: GPUs torch sees = granted") == "FAIL"  # a CUDA image on AMD GPUs
    small = check_nodes([report("gpu01", 8, 8, memory_bytes=512 * 2**30)], "apptainer", "amd", 256)
    assert status(small, "container starts on every node") == "FAIL"
    assert status(small, "gpu01: GPU memory vs the profile") == "FAIL"
    assert status(small, "gpu01: host RAM vs the GPUs' memory") == "FAIL"
    for r in small:
        assert (r["status"] == "FAIL") == bool(r["fix"]), r


def test_prerequisite_rows_check_one_interpreter_and_a_shared_run_directory(tmp_path: Path) -> None:
    """This host's real `node_report` leaves its file in the run directory; a second node's
    report, as it came back from a node whose file this head does not see and whose interpreter
    differs, fails both rows, naming the node and the paths."""
    import socket
    import sys

    here = node_report(0, str(tmp_path))
    assert (tmp_path / "doctor-nodes" / socket.gethostname()).is_file() and here["python"] == sys.executable
    rows = prerequisite_rows([here], tmp_path)
    assert status(rows, "the payload's interpreter: one on every node, Python >= 3.11") == "PASS"
    assert status(rows, "run directory shared by every node") == "PASS"
    other = {**here, "hostname": "gpu02", "python": "/usr/bin/python3", "python_version": "3.9.2"}
    rows = prerequisite_rows([here, other], tmp_path)
    interp = next(r for r in rows if r["check"].startswith("the payload's interpreter"))
    shared = next(r for r in rows if r["check"] == "run directory shared by every node")
    assert interp["status"] == "FAIL" and "/usr/bin/python3 (Python 3.9.2) on gpu02" in interp["detail"]
    assert "`python:`" in interp["fix"]
    assert shared["status"] == "FAIL" and "1 of 2 node(s)" in shared["detail"] and "not seen: gpu02" in shared["detail"]
    assert "`run_root`" in shared["fix"]


def test_the_h200_node_report() -> None:
    """`node_report(1)` as it came back from one H200 (torch 2.11.0+cu130), outside a container."""
    h200 = {"hostname": "vm", "container": "none", "torch": "2.11.0+cu130", "hip": None, "cuda": "13.0",
            "devices": [{"name": "NVIDIA H200", "memory_gib": 139.8}], "granted": 1,
            "kernel": "256x256 matmul on 1 GPU(s)", "kernel_ok": True, "driver": "580.159.4",
            "driver_problem": "", "memory_bytes": 200 * 2**30}  # memory: as Ray would report it
    rows = check_nodes([h200], "none", "nvidia", 141)
    assert [r["status"] for r in rows] == ["PASS"] * 6, rows
    h200["memory_bytes"] = 120 * 2**30  # less host RAM than the GPU has
    assert status(check_nodes([h200], "none", "nvidia", 141), "vm: host RAM vs the GPUs' memory") == "FAIL"
    assert status(check_nodes([h200], "none", "amd", 141), "vm: GPUs torch sees = granted") == "FAIL"


def test_allreduce_rows() -> None:
    ranks = [{"backend": "nccl", "seconds": 0.004, "sum_ok": True}] * 2
    rows = allreduce_rows(ranks, 20.0, NCCL_SOCKET)
    assert [r["status"] for r in rows] == ["PASS", "FAIL", "FAIL"]
    assert "16.78 GB/s" in rows[1]["detail"] and "NCCL_IB_HCA" in rows[2]["fix"]
    gloo = allreduce_rows([{"backend": "gloo", "seconds": 0.2, "sum_ok": True}] * 3, 0.01, "")
    assert [r["status"] for r in gloo] == ["PASS", "PASS", "SKIP"]


def test_the_sandbox_builds_on_this_node_in_the_sites_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sandbox_report() == {"mode": "strict", "ok": True, "why": ""}
    monkeypatch.setenv("HPCRL_PYTHON_SANDBOX", "rlimits")
    assert sandbox_report() == {"mode": "rlimits", "ok": True, "why": ""}
    monkeypatch.setenv("HPCRL_PYTHON_SANDBOX", "none")
    report = sandbox_report()
    assert not report["ok"] and "`HPCRL_PYTHON_SANDBOX=none` names no sandbox mode" in report["why"]


def test_the_sandbox_row_names_each_node_that_cannot_build_it() -> None:
    good = {"mode": "strict", "ok": True, "why": ""}
    assert sandbox_row([good, good], ["n1", "n2"])["status"] == "PASS"
    bad = sandbox_row([good, {"mode": "strict", "ok": False, "why": "unshare: EPERM"}], ["n1", "n2"])
    # only the python tool needs it: said with the fix, without failing the doctor
    assert bad["status"] == "SKIP" and bad["detail"].startswith("n2: unshare: EPERM -- only the `python` tool")
    assert "unmask=/proc/*" in bad["detail"] and "`HPCRL_PYTHON_SANDBOX: rlimits`" in bad["detail"]


def test_table_puts_each_fix_under_its_failure() -> None:
    rows = allreduce_rows([{"backend": "nccl", "seconds": 0.004, "sum_ok": True}] * 2, 20.0, NCCL_IB)
    lines = doctor.table(rows).splitlines()
    assert lines[0].startswith("PASS  all-reduce across nodes: result")
    assert lines[1].startswith("FAIL  all-reduce across nodes: bus bandwidth")
    assert lines[2].strip().startswith("fix: below the floor") and lines[3].startswith("PASS")


def test_doctor_job_goes_through_submit(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    args = argparse.Namespace(site="mi300-cluster", nodes=2, via="sbatch", model="/models/m")
    p = load_profile("mi300-cluster", env).profile
    assert doctor.vendor_of(p) == "amd"
    assert doctor.vendor_of(load_profile("h100-cluster", env).profile) == "nvidia"
    ns = doctor.submit_args(args, tmp_path / "run")
    assert ns.whole_command and ns.follow and ns.doctor and ns.site == "mi300-cluster"
    assert ns.payload[0] == "--" and ns.payload[2:4] == ["-m", "hpcrl.doctor_check"]
    cmd = " ".join(ns.payload)
    for part in ("--runtime podman", "--nodes 2", "--gpus 8", "--vendor amd", "--gpu-gib 192.0",
                 "--floor-gbps 20.0", "--model /models/m"):
        assert part in cmd, part


def test_submit_notes_a_site_never_passed(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    assert "hpcrl doctor --site gpu1" in str(doctor_record.suggestion("gpu1", env))
    path = doctor_record.record_pass("gpu1", tmp_path / "run", [{"check": "x", "status": "PASS"}], env)
    assert path == tmp_path / ".local" / "state" / "hpcrl" / "doctor" / "gpu1.json"
    assert doctor_record.suggestion("gpu1", env) is None
    assert doctor_record.has_passed("gpu1", {"XDG_STATE_HOME": str(tmp_path / ".local" / "state")})


def test_memory_plan_row_skips_without_a_command_line_or_a_gpu(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    lab = load_profile("slurmlab", env).profile
    assert doctor.memory_plan_row(lab, [], [], 3, tmp_path)["status"] == "SKIP"
    bad = doctor.memory_plan_row(lab, ["data.train_batch_size=8"], [], 3, tmp_path)
    assert bad["status"] == "FAIL" and "multiple of" in bad["detail"]  # the trainer's own refusal
    cpu = doctor.memory_plan_row(lab, ["trainer.total_training_steps=1", "critic.ppo_micro_batch_size_per_gpu=4"],
                                 [], 3, tmp_path)
    assert cpu["status"] == "SKIP" and cpu["detail"] == "no GPU: nothing to plan"


@pytest.mark.slow
def test_memory_plan_row_uses_the_gpus_found(tmp_path: Path) -> None:
    """The seeds' Qwen2.5-7B GRPO line (tests/hpcrl/test_memcheck.py) on the 80 GiB the job
    found: refused; on 192 GiB: fits. Real `python -m trainer --plan-memory` processes."""
    from tests.hpcrl.test_memcheck import GRPO

    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    h100 = load_profile("h100-cluster", env).profile
    found = [dict(report("gpu01", 8, 8), devices=[{"name": "NVIDIA H100", "memory_gib": 79.1}] * 8)]
    refused = doctor.memory_plan_row(h100, GRPO, found, 2, tmp_path)
    assert refused["status"] == "FAIL" and "79.1 GiB per GPU" in refused["detail"], refused
    big = [dict(report("gpu01", 8, 8), devices=[{"name": "MI300X", "memory_gib": 191.5}] * 8)]
    fits = doctor.memory_plan_row(h100, GRPO, big, 2, tmp_path)
    assert fits["status"] == "PASS", fits
    assert "fits 191.5 GiB per GPU and 1800.0 GiB of host memory per node (found)" in fits["detail"], fits
    # the host memory a node reported, not the profile's `slurm.mem`: 8 worker processes and the
    # driver do not fit in 16 GiB
    small = [dict(big[0], memory_bytes=16 * 2**30), big[0]]
    refused = doctor.memory_plan_row(h100, GRPO, small, 2, tmp_path)
    assert refused["status"] == "FAIL" and "the host memory phase needs" in refused["detail"], refused
    assert "16384M per node" in refused["detail"] and "larger `slurm.mem`" in refused["fix"], refused


@pytest.mark.vllm
def test_vllm_generates_a_few_tokens(tiny_model_dir: Path) -> None:
    """The doctor's vLLM check itself (`generate_once`), here on vLLM's CPU backend. It leaves no
    engine process behind (`VLLM::EngineCore`, `VLLM::Worker`): in the doctor's Ray worker those
    would hold the GPU's memory through the checks after it."""
    from tests.trainer.rollout.vllm_support import require_vllm

    require_vllm()
    import psutil

    from hpcrl.doctor_check import generate_once

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    text = generate_once(str(tiny_model_dir), max_model_len=64)
    assert isinstance(text, str) and text, text
    engine = [p for p in psutil.Process().children(recursive=True)
              if p.pid not in before and p.name().startswith("VLLM::")]
    # shut down: each got its SIGTERM and ends (at once here, later on a loaded machine); left
    # running, none would end, and the wait returns them
    _, alive = psutil.wait_procs(engine, timeout=120)
    assert not alive, [p.name() for p in alive]
