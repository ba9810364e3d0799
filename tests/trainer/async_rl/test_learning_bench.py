"""`bench.learning run --loop fully-async`: the overrides it submits are a run that the
fully-async entry accepts, with the sync run's nodes, updates and samples per update; and
`bench.learning seeds` reports each setting's trained samples and the staleness histogram."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import learning
from trainer.config import check_run, load_config
from trainer.config.async_training import queue_bounds, total_rollout_steps


def args(*argv: str) -> argparse.Namespace:
    """What `python -m bench.learning run ARGV` would run with."""
    seen: dict[str, argparse.Namespace] = {}

    def capture(_root: Path, a: argparse.Namespace) -> int:
        seen["args"] = a
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(learning, "run", capture)
        learning.main(["run", *argv])
    return seen["args"]


SHORT = ["--steps", "10", "--test-freq", "10", "--prompts", "8", "--n", "4", "--lr", "2e-5"]


def test_fully_async_overrides_make_the_sync_runs_updates_on_the_same_nodes(tmp_path: Path) -> None:
    a = args("--dir", str(tmp_path), "--loop", "fully-async", *SHORT, "trainer.seed=1")
    argv = learning.overrides(tmp_path / "m", tmp_path / "d", tmp_path / "run", a)
    keys = dict(word.split("=", 1) for word in argv)
    assert "trainer.total_training_steps" not in keys  # verl's fully-async trainer reads none
    assert (keys["trainer.nnodes"], keys["rollout.nnodes"], keys["rollout.n_gpus_per_node"]) == ("1", "1", "1")
    assert (keys["async_training.staleness_threshold"], keys["algorithm.rollout_correction.bypass_mode"]) == ("0.5", "true")
    cfg = load_config(argv, env={})
    check_run(cfg, "fully_async")
    b = queue_bounds(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.async_training,
                     total_rollout_steps(cfg, 4096))
    # the sync run: 10 steps x 8 prompts x 4 responses, one update per step
    assert (b.total_train_steps * b.trigger_parameter_sync_step, b.required_samples) == (10, 8)
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert b.ahead == 4  # int(8 x 1.5) - 8: half a step's prompts may be generated ahead

    sync = learning.overrides(tmp_path / "m", tmp_path / "d", tmp_path / "run", args("--dir", str(tmp_path), *SHORT))
    keys = dict(word.split("=", 1) for word in sync)
    assert (keys["trainer.nnodes"], keys["trainer.total_training_steps"], keys["data.train_batch_size"]) == ("2", "10", "8")


def test_fully_async_needs_a_node_for_the_pool(tmp_path: Path) -> None:
    a = args("--dir", str(tmp_path), "--loop", "fully-async", "--nodes", "1", *SHORT)
    with pytest.raises(SystemExit, match="needs `--nodes 2`"):
        learning.overrides(tmp_path / "m", tmp_path / "d", tmp_path / "run", a)


def write_run(root: Path, name: str, rows: list[dict[str, float]], payload: list[str]) -> None:
    run = root / name / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "job.json").write_text(json.dumps({"payload": ["python", "-m", "trainer", *payload]}))
    (root / name / "run-wall.json").write_text(json.dumps({"wall_s": 600.0}))


def val(step: int, acc: float) -> dict[str, float]:
    return {"step": step, learning.ACC: acc, learning.ACC_SEM: 0.02, learning.FORMATTED: 0.1}


def train(step: int, **extra: float) -> dict[str, float]:
    return {"step": step, "actor/pg_loss": 0.0, "critic/score/mean": 0.1, "timing_s/step": 50.0 + step, **extra}


def test_seeds_reports_trained_samples_and_the_staleness_histogram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for seed, acc in ((1, 0.2), (2, 0.16)):
        write_run(tmp_path, f"fp32-s{seed}", [val(0, 0.129), *(train(s) for s in (1, 2)), val(2, acc)],
                  ["data.train_batch_size=8"])
        fa = [train(s, **{"timing_s/param_sync": 10.0, "training/updates": float(s),
                          "fully_async/static/required_samples": 8.0, "fully_async/trainer/idle_ratio": 0.25,
                          "fully_async/rollouter/idle_ratio": 0.5, "fully_async/staleness/0": 8.0 * s - seed,
                          "fully_async/staleness/1": float(seed)}) for s in (1, 2)]
        write_run(tmp_path, f"fa-s{seed}", [*fa, val(2, acc + 0.01)], ["data.train_batch_size=0"])
    assert learning.seeds(tmp_path) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| fa |")]
    assert "s1 0.210 ± 0.020, s2 0.170 ± 0.020" in table[0] and "| 62 |" in table[0]  # step 52 + sync 10
    assert table[1].split(" | ")[1:4] == ["s1 2 x 8, s2 2 x 8", "s1 0: 15 1: 1, s2 0: 14 1: 2", "52"]
    assert "| 0.25 | 0.50 | s1 10.0, s2 10.0 |" in table[1]
    sync = [line for line in out.splitlines() if line.startswith("| fp32 |")]
    assert sync[1].split(" | ")[1:3] == ["s1 2 x 8, s2 2 x 8", "-"]
