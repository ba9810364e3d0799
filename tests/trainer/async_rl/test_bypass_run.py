"""Bypass mode (`algorithm.rollout_correction.bypass_mode=true`) in the step, as verl's
`RayPPOTrainer.fit` runs it: the old log-probs are the rollout's (no actor forward, no
`actor/entropy`, no `training/rollout_probs_diff_*`), the decoupled correction before the
advantages is skipped (the mask is untouched), and the actor trains with bypass mode's loss
whatever `policy_loss.loss_mode` says, logging the `rollout_corr/*` metrics from the update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_driver import toy_data, toy_overrides  # noqa: F401 (the module's fixture)
from trainer.algos import rollout_corr
from trainer.algos.policy_losses import PolicyLossParams
from trainer.batch import StepBatch
from trainer.config import ConfigError, load_config
from trainer.driver import PPODriver
from trainer.metrics import read_jsonl
from trainer.stages import logprobs
from trainer.stages.advantage import correct_rollout

BYPASS = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.bypass_mode=true"]


class NoCalls:
    """A worker group that must not be asked for anything."""

    def run_each(self, method: str, per_rank: object) -> None:
        raise AssertionError(f"bypass mode asked the workers for `{method}`")


def _batch(rows: int = 3, length: int = 4) -> StepBatch:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, length)
    return StepBatch(examples=[], uids=list(range(rows)), input_ids=torch.zeros(rows, 2 + length, dtype=torch.long),
                     attention_mask=torch.ones(rows, 2 + length, dtype=torch.long), response_mask=mask,
                     rollout_log_probs=-torch.rand(rows, length, generator=gen))


def test_old_log_probs_are_the_rollouts_without_a_forward() -> None:
    batch = _batch()
    metrics = logprobs.old_log_probs(batch, NoCalls(), [[0, 1, 2]], "token-mean",  # type: ignore[arg-type]
                                     lambda *_: 0.0, bypass=True)
    assert metrics == {} and batch.old_log_probs is batch.rollout_log_probs and batch.entropy is None


def test_the_decoupled_correction_is_skipped() -> None:
    cfg = load_config([*BYPASS, "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=0.99_1.01"], env={})
    batch = _batch()
    batch.old_log_probs = torch.zeros_like(batch.response_mask)  # far from the rollout's: would be rejected
    mask = batch.response_mask.clone()
    assert correct_rollout(batch, cfg.algorithm) == {}
    assert torch.equal(batch.response_mask, mask) and batch.rollout_is_weights is None
    decoupled = load_config(["actor_rollout_ref.rollout.calculate_log_probs=true",
                             "algorithm.rollout_correction.rollout_rs=token_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.99_1.01"], env={})
    assert correct_rollout(batch, decoupled.algorithm) and batch.response_mask.sum() < mask.sum()


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_the_actor_trains_with_bypass_loss_whatever_loss_mode_says(loss_type: str) -> None:
    cfg = load_config([*BYPASS, f"algorithm.rollout_correction.loss_type={loss_type}",
                       "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                       "algorithm.rollout_correction.rollout_is=token"], env={}).algorithm.rollout_correction
    fn = rollout_corr.policy_loss_for("gspo", cfg)
    gen = torch.Generator().manual_seed(1)
    rollout, adv, mask = -torch.rand(2, 5, generator=gen), torch.randn(2, 5, generator=gen), torch.ones(2, 5)
    log_prob = rollout + 0.2 * torch.randn(2, 5, generator=gen)
    loss, metrics = fn(rollout, log_prob, adv, mask, "token-mean", PolicyLossParams(),
                       rollout_is_weights=torch.full((2, 5), 7.0))  # the caller's weights: ignored, as verl
    want, _ = rollout_corr.bypass_policy_loss(rollout, log_prob, adv, mask, "token-mean", PolicyLossParams(),
                                              rollout_corr.RolloutCorrection("token"), loss_type)
    assert torch.equal(loss, want) and "rollout_corr/rollout_is_mean" in metrics
    assert rollout_corr.policy_loss_for("gspo", load_config([], env={}).algorithm.rollout_correction).__name__ == \
        "compute_policy_loss_gspo"


def test_bypass_needs_the_rollouts_log_probs_and_a_known_loss_type() -> None:
    with pytest.raises(ConfigError, match="bypass_mode=true` trains with the rollout's own log-probs.*calculate_log_probs=true"):
        load_config(["algorithm.rollout_correction.bypass_mode=true"], env={})
    with pytest.raises(ConfigError, match="`algorithm.rollout_correction.loss_type=pg` must be one of ppo_clip, reinforce"):
        load_config([*BYPASS, "algorithm.rollout_correction.loss_type=pg"], env={})


def test_a_bypass_run_trains_and_logs_verls_metrics(tiny_model_dir: Path, toy_data: Path,  # noqa: F811
                                                   tmp_path: Path) -> None:
    over = toy_overrides(tiny_model_dir, toy_data, tmp_path, "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
                         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                         "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                         "algorithm.rollout_correction.rollout_is=token", *BYPASS)
    assert PPODriver(load_config(over)).fit() == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert "training/rollout_probs_diff_mean" not in row and "actor/entropy" not in row
        # the HF engine samples with the actor's weights: the update's first mini-batch is on-policy
        assert abs(row["rollout_corr/kl"]) < 1e-2 and row["actor/pg_loss"] == row["actor/pg_loss"]
