"""A discriminative reward model colocated with a 2-rank actor group on a private local Ray
cluster (CPU, gloo): a step trains on its scores, and the rows scored on the two ranks (each
with its own copy, half the rows each) get the scores one in-process copy gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_distributed import no_ray_address, overrides, toy  # noqa: F401 (a fixture)
from tests.trainer.test_reward_model import tiny_rm_dir  # noqa: F401 (a fixture)
from trainer.config import load_config
from trainer.driver import PPODriver
from trainer.stages.reward import ModelRewardEngine

pytestmark = pytest.mark.slow


def test_two_ranks_score_as_one_copy_does(tiny_model_dir: Path, toy: Path, tiny_rm_dir: Path,  # noqa: F811
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_ray_address(monkeypatch)
    cfg = load_config(overrides(tiny_model_dir, toy, tmp_path / "run", "algorithm.adv_estimator=grpo",
                                "trainer.n_gpus_per_node=2", "trainer.distributed=true",
                                "trainer.total_training_steps=1", "reward_model.enable=true",
                                f"reward_model.model.path={tiny_rm_dir}"))
    driver = PPODriver(cfg)
    try:
        assert driver.world == 2 and driver.fit() == 0
        batch = driver.generate(driver.loader.next_batch())
        driver.reward.score(batch)  # on the two Ray ranks
        on_ranks = batch.sequence_scores.clone()
        alone = ModelRewardEngine(cfg, driver.tokenizer)  # one copy in this process
        alone.score(batch)
        assert len(batch) == 16 and torch.allclose(batch.sequence_scores, on_ranks, atol=1e-6)
    finally:
        driver.reward.close()
        import ray

        ray.shutdown()
