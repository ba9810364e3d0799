"""A node's GPU evidence at a watchdog fire (:mod:`hpcrl.gpu_evidence`): the parsers on the tools'
outputs (`tests/data/gpu/`), and the node's verdict with the command runner (the one seam)
answering from those files."""

from __future__ import annotations

import time
from datetime import datetime

from hpcrl.gpu_evidence import (
    AMD_SMI,
    NVIDIA_SMI,
    node_evidence,
    parse_amd_smi,
    parse_kernel_log,
    parse_nvidia_smi,
    suspect_reasons,
)
from tests.conftest import REPO

DATA = REPO / "tests" / "data" / "gpu"


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_nvidia_smi_rows_name_each_gpu_s_uncorrected_errors_and_failed_remaps() -> None:
    clean = parse_nvidia_smi(text("nvidia_smi_clean.csv"))
    assert len(clean) == 8 and clean[0] == {"index": 0, "bus_id": "00000000:18:00.0", "uncorrected": 0,
                                            "remap_failed": False}
    fault = parse_nvidia_smi(text("nvidia_smi_fault.csv"))
    assert fault[2] == {"index": 2, "bus_id": "00000000:3A:00.0", "uncorrected": 3, "remap_failed": True}
    assert parse_nvidia_smi(text("nvidia_smi_no_ecc.csv")) == [
        {"index": 0, "bus_id": "00000000:01:00.0", "uncorrected": None, "remap_failed": None}]
    assert parse_nvidia_smi("Field \"remapped_rows.failure\" is not a valid field to query.\n") == []


def test_amd_smi_json_of_rocm_6_and_7() -> None:
    assert parse_amd_smi(text("amd_smi_ecc_rocm6.json")) == [{"index": 0, "uncorrected": 0},
                                                             {"index": 1, "uncorrected": 0}]
    assert parse_amd_smi(text("amd_smi_ecc_rocm7.json")) == [
        {"index": 0, "uncorrected": 0}, {"index": 1, "uncorrected": 2}, {"index": 2, "uncorrected": None}]
    assert parse_amd_smi("not json") == []


def test_kernel_log_xids_and_amdgpu_faults_since_the_run_started() -> None:
    xids = parse_kernel_log(text("journal_xid.txt"))
    assert [(e["xid"], e["pci"]) for e in xids] == [(74, "0000:b9:00"), (120, "0000:23:00"), (79, "0000:3b:00")]
    assert xids[2]["line"].endswith("79, pid=1234, name=python3, GPU has fallen off the bus.")
    since = datetime.fromisoformat("2026-02-14T08:00:00+00:00").timestamp()
    assert [e["xid"] for e in parse_kernel_log(text("journal_xid.txt"), since)] == [79]
    amd = parse_kernel_log(text("dmesg_amdgpu.txt"))  # not the all-clear, not the soft recovery
    assert [e["amdgpu"] for e in amd] == ["ring sdma1 timeout", "GPU reset", "2 uncorrectable hardware errors"]
    assert parse_kernel_log("[   12.3] NVRM: Xid (PCI:0000:10:00.0): 13, Graphics SM Warp Exception")[0]["pci"] == (
        "0000:10:00.0")  # dmesg without time stamps: kept


def runner(answers: dict[str, tuple[int, str]]):  # type: ignore[no-untyped-def]
    """The command runner of a node where only the programs in `answers` are installed."""
    asked: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str] | None:
        asked.append(argv)
        return answers.get(argv[0])
    run.asked = asked  # type: ignore[attr-defined]
    return run


def test_a_node_without_gpu_tools_gives_no_evidence_and_is_no_suspect() -> None:
    run = runner({"journalctl": (1, "No journal files were opened due to insufficient permissions."),
                  "dmesg": (1, "dmesg: read kernel buffer failed: Operation not permitted")})
    evidence = node_evidence(time.time() - 60, run, node="cpu07")
    assert evidence["notes"] == ["no GPU tools on cpu07",
                                 "the kernel log is not readable here (`journalctl -k`, `dmesg`)"]
    assert evidence["suspect"] == [] and evidence["tools"] == []
    assert [a[0] for a in run.asked] == ["nvidia-smi", "amd-smi", "journalctl", "dmesg"]


def test_uncorrected_ecc_and_an_xid_make_the_node_a_suspect() -> None:
    since = datetime.fromisoformat("2026-02-14T08:00:00+00:00").timestamp()
    run = runner({"nvidia-smi": (0, text("nvidia_smi_fault.csv")), "journalctl": (0, text("journal_xid.txt"))})
    evidence = node_evidence(since, run, node="gpu017")
    assert evidence["tools"] == ["nvidia-smi", "journalctl"] and evidence["notes"] == []
    assert evidence["suspect"] == ["GPU 2 (00000000:3A:00.0) has 3 uncorrected ECC error(s)",
                                   "GPU 2 (00000000:3A:00.0) failed a row remap", "Xid 79 on GPU 0000:3b:00"]
    assert run.asked[0] == NVIDIA_SMI and run.asked[2][:3] == ["journalctl", "-k", "--no-pager"]
    assert run.asked[2][-1] == f"@{int(since)}"


def test_a_clean_node_is_no_suspect_and_dmesg_stands_in_for_the_journal() -> None:
    run = runner({"amd-smi": (0, text("amd_smi_ecc_rocm6.json")), "dmesg": (0, "")})
    evidence = node_evidence(time.time(), run, node="mi300-03")
    assert evidence["tools"] == ["amd-smi", "dmesg"] and evidence["suspect"] == [] and evidence["notes"] == []
    assert run.asked[1] == AMD_SMI
    bad = node_evidence(0.0, runner({"amd-smi": (0, text("amd_smi_ecc_rocm7.json")),
                                     "dmesg": (0, text("dmesg_amdgpu.txt"))}), node="mi300-04")
    assert suspect_reasons(bad) == bad["suspect"] == [
        "GPU 1 has 2 uncorrectable ECC error(s)", "amdgpu: ring sdma1 timeout", "amdgpu: GPU reset",
        "amdgpu: 2 uncorrectable hardware errors"]


def test_a_tool_that_fails_is_said_so_and_blames_nobody() -> None:
    evidence = node_evidence(0.0, runner({"nvidia-smi": (9, "NVIDIA-SMI has failed because it couldn't "
                                                            "communicate with the NVIDIA driver."),
                                          "dmesg": (0, "")}), node="gpu001")
    assert evidence["notes"] == ["`nvidia-smi` failed (9): NVIDIA-SMI has failed because it couldn't "
                                 "communicate with the NVIDIA driver."]
    assert evidence["suspect"] == [] and evidence["tools"] == ["dmesg"]


def test_the_runner_gives_a_tool_s_output_and_does_not_wait_for_one_that_hangs() -> None:
    from hpcrl.gpu_evidence import run_command

    assert run_command(["no-such-tool-here"]) is None
    assert run_command(["sh", "-c", "echo 0, 00000000:18:00.0, 0, No; echo oops >&2; exit 3"]) == (
        3, "0, 00000000:18:00.0, 0, No\noops\n")
    status, text = run_command(["sleep", "30"], timeout=0.5)
    assert (status, text) == (124, "`sleep` did not answer within 0.5 s")
