"""`trainer.rollout_data_dir` and `trainer.validation_data_dir`: a run writes each step's and each
validation's generations as verl does (`<dir>/<step>.jsonl`), and the file our writer makes from
given columns is byte for byte the file verl 0.9.1's own `RayPPOTrainer._write_generations`
makes from them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.test_driver import toy_overrides
from tests.verl_env import verl_python
from trainer.config import load_config
from trainer.driver import PPODriver
from trainer.rewards.toy import write_toy_digits
from trainer.stages.dump import write_generations

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return {'score': len(solution_str) / 10, 'acc': float(solution_str.strip() == ground_truth),\n"
          "            'pred': solution_str[:3]}\n")


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=64, val_size=16, seed=0)
    return out


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_dumps_every_step_and_every_validation(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    rollouts, vals = tmp_path / "rollouts", tmp_path / "vals"
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path / "run", "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=true",
        "data.val_batch_size=6", f"custom_reward_function.path={reward}",
        f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={vals}"))
    assert PPODriver(cfg).fit() == 0

    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]
    for step in (1, 2):
        rows = read(rollouts / f"{step}.jsonl")
        assert len(rows) == 8  # 4 prompts x 2 responses
        assert all(list(r) == ["input", "output", "gts", "score", "step", "acc", "pred"] for r in rows), rows[0]
        for r in rows:  # the score is the reward function's, of the decoded response
            assert r["step"] == step and r["score"] == pytest.approx(len(r["output"]) / 10)  # float32 sum
            assert r["acc"] == float(r["output"].strip() == r["gts"]) and r["pred"] == r["output"][:3]
            assert r["input"] and isinstance(r["gts"], str)

    # validation before training (step 0) and at step 2, all 16 rows over three batches of 6
    assert sorted(p.name for p in vals.iterdir()) == ["0.jsonl", "2.jsonl"]
    for step in (0, 2):
        rows = read(vals / f"{step}.jsonl")
        assert len(rows) == 16 and {r["step"] for r in rows} == {step}
        assert all(r["reward"] == r["score"] == pytest.approx(len(r["output"]) / 10) for r in rows)
        assert all(set(r) >= {"input", "output", "gts", "score", "acc", "pred"} for r in rows)
    assert [r["input"] for r in read(vals / "0.jsonl")] == [r["input"] for r in read(vals / "2.jsonl")]


def test_no_directory_writes_nothing(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path / "run", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1"))
    assert cfg.trainer.rollout_data_dir is None and cfg.trainer.validation_data_dir is None
    assert PPODriver(cfg).fit() == 0
    assert not list(tmp_path.glob("**/1.jsonl"))


VERL_WRITE = """
import json, sys
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
spec = json.loads(sys.stdin.read())
RayPPOTrainer._write_generations(spec["inputs"], spec["outputs"], spec["gts"], spec["scores"],
                                 spec["extras"], spec["dir"], spec["step"])
"""


def test_the_file_is_verls(tmp_path: Path) -> None:
    """Unicode kept as is, a value JSON cannot hold written as `str`, an extra of the wrong length
    left out: the same bytes as verl's writer."""
    python = verl_python()
    columns = {"inputs": ["1+1=", "ünï"], "outputs": ["2", "ça"], "gts": ["2", None], "scores": [1.0, -0.5],
               "extras": {"acc": [1.0, 0.0], "short": [1], "pred": ["2", "ça"]}}
    ours = write_generations(str(tmp_path / "ours"), 3, columns["inputs"], columns["outputs"], columns["gts"],
                             columns["scores"], columns["extras"])
    spec = {**columns, "dir": str(tmp_path / "verl"), "step": 3}
    done = subprocess.run([python, "-c", VERL_WRITE], input=json.dumps(spec), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = tmp_path / "verl" / "3.jsonl"
    assert Path(ours).read_bytes() == theirs.read_bytes()
    assert [list(r) for r in read(theirs)] == [["input", "output", "gts", "score", "step", "acc", "pred"]] * 2
