"""`bench/gpu_check.py --dry`: the one-GPU check's whole path on the CPU with tiny shapes (FSDP2 on
a group of one, bf16 and fp32, offload, a DCP save and a weight sync; packed and per-row attention;
the trainer's loop with the HF rollout), so that the day a GPU is lent it runs as it ran here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_dry_gpu_check_runs_every_section_without_ray_or_vllm(tmp_path: Path) -> None:
    """Run as on the GPU machines, which carry torch, transformers and peft but not Ray, vLLM,
    submitit or spython: those are made unimportable in the child."""
    from trainer.metrics import read_jsonl

    blocked = ("ray", "vllm", "submitit", "spython", "gguf", "wandb")
    code = (f"import sys; [sys.modules.__setitem__(n, None) for n in {blocked!r}]; "
            f"from bench import gpu_check; sys.exit(gpu_check.main(['--dry', '--dir', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "9 sections" in done.stdout and "0 failed" in done.stdout
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    for precision in ("bf16", "fp32"):
        run = figures["fsdp2"][precision]
        assert run["group"] == {"backend": "gloo", "fsdp": True, "threads": run["group"]["threads"]}
        assert run["optimizer_bytes_on_host"] > 0  # optimizer offload moved the moments out
        assert run["checkpoint_gib"] > 0 and set(run["plan_gib"]) >= {"actor update", "weight sync"}
        for phase in ("build", "update", "update again", "dcp save", "weight sync"):
            assert run[phase]["s"] > 0, (precision, phase)
    assert {"sdpa 128 tokens per-row", "sdpa 128 tokens packed"} <= set(figures["attention"])
    packed = figures["attention"]["hpcrl_packed_sdpa 128 tokens packed"]  # the trainer's path runs
    assert isinstance(packed, dict) and packed["s"] > 0, packed
    assert figures["trainer"]["steps"] == 2 and figures["trainer"]["tokens/s/GPU"] > 0
    rm = figures["reward_model"]  # fp32 on the CPU against itself: the same scores
    assert rm["responses"] == 32 and rm["max_abs_diff_vs_cpu_fp32"] == 0.0 and rm["score_std"] > 0
    fr = figures["flight_recorder"]  # gloo's recorder on the CPU: five all-reduces, none pending
    assert fr["recorder"].startswith("gloo") and fr["entries"] == 5 and fr["pending"] is None, fr
    assert fr["groups"] == {"0": {"last_enqueued": 5, "last_completed": 5}} and fr["names"] == ["gloo:all_reduce"]
    assert figures["gpu_evidence"]["evidence"]["suspect"] == []
    oom = figures["gpu_oom"]  # on a GPU: torch's own sentence for a real allocation past the device
    assert oom["found"] and oom["capacity_gib"] == oom["device_gib"], oom
    pool = figures["pool_broadcast"]  # two processes, every version bit-equal after the bf16 cast
    assert pool["all_bit_equal"] and [r["overlap"] for r in pool["runs"]] == [False, True, True], pool
    rows = read_jsonl(tmp_path / "trainer-bf16" / "metrics.jsonl")
    assert len(rows) == 2 and rows[-1]["perf/max_memory_allocated_gb"] == 0.0  # the CPU reads 0


def test_a_failing_section_is_reported_and_the_next_still_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import gpu_check

    def broken(check: gpu_check.Check) -> dict:
        raise RuntimeError("no such device")

    monkeypatch.setitem(gpu_check.SECTIONS, "fsdp2", broken)
    assert gpu_check.main(["--dry", "--dir", str(tmp_path), "--only", "environment", "fsdp2"]) == 1
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["fsdp2"]["error"] == "RuntimeError: no such device"
    assert figures["environment"]["torch"]


def test_the_attention_section_alone_loads_the_trainer_s_packed_path(tmp_path: Path) -> None:
    """`--only attention` in a fresh process (no earlier section has registered the trainer's
    attention with transformers): on an H200 it once answered "not loadable" for this reason."""
    code = (f"import sys; from bench import gpu_check; "
            f"sys.exit(gpu_check.main(['--dry', '--dir', {str(tmp_path)!r}, '--only', 'attention']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    packed = json.loads((tmp_path / "gpu_check.json").read_text())["attention"]["hpcrl_packed_sdpa 128 tokens packed"]
    assert isinstance(packed, dict) and packed["s"] > 0, packed
