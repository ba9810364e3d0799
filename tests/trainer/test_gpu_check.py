"""`bench/gpu_check.py --dry`: the one-GPU check's whole path (GRPO, rollout sleeping between
rollouts, offload off and on) run on the CPU with the tiny model, 2 steps each."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_dry_gpu_check_runs_both_offload_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu_check
    from trainer.metrics import read_jsonl

    assert gpu_check.main(["--dry", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for setting in ("off", "on"):
        assert f"offload={setting}: " in out and "tokens/s/GPU" in out and "MFU (actor update) n/a (CPU)" in out
        rows = read_jsonl(tmp_path / f"run-offload-{setting}" / "metrics.jsonl")
        assert len(rows) == 2
        for phase in ("rollout", "old_log_prob", "ref", "update_actor"):
            assert f"perf/memory/{phase}/max_allocated_gb" in rows[-1], (setting, phase)
        assert rows[-1]["perf/max_memory_allocated_gb"] == 0.0  # the CPU's device memory reads 0
        assert rows[-1]["perf/throughput"] > 0
    assert out.count("update_actor GiB") == 2
