"""`geo_mean` (GMPO) and PF-PPO against cases computed by hand (numbers in the comments); the
configuration's acceptance and refusals; the advantage stage's seeded redraw. verl's own functions
on random tensors: `test_algos_vs_verl.py`."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algos import core_algos as ca
from trainer.algos import registry
from trainer.batch import StepBatch
from trainer.config import ConfigError, load_config
from trainer.stages import update
from trainer.stages.advantage import compute_advantages

T = torch.tensor

# --------------------------------------------------------------------------- geo_mean

OLD = T([[0.0, 0.0], [0.0, 0.0]])
NEW = T([[0.5, -0.1], [0.5, -0.1]])  # log ratios 0.5 (clipped to 0.2 where it helps) and -0.1
ADV = T([[1.0, 1.0], [-1.0, -1.0]])
MASK = torch.ones(2, 2)


def test_geo_mean_clips_each_token_pessimistically_and_averages_the_rows() -> None:
    """Row 0 (A = 1): log ratios min(0.5, 0.2), min(-0.1, -0.1): mean 0.05, loss -e^0.05. Row 1
    (A = -1): max(0.5, 0.2), -0.1: mean 0.2, loss +e^0.2. The loss is their mean; the clipped token
    counts in `pg_clipfrac` for A > 0 and in `pg_clipfrac_lower` for A < 0 (1 of 4 tokens each)."""
    log_prob = NEW.clone().requires_grad_(True)
    loss, metrics = registry.policy_loss("geo_mean")(OLD, log_prob, ADV, MASK, "token-mean", ca.PolicyLossParams())
    assert loss.item() == pytest.approx((math.exp(0.2) - math.exp(0.05)) / 2, rel=1e-6)
    assert metrics == pytest.approx({"actor/pg_clipfrac": 0.25, "actor/ppo_kl": -0.2, "actor/pg_clipfrac_lower": 0.25})
    loss.backward()
    assert log_prob.grad is not None
    # row 0: the clipped token has no gradient; the other -(1/2) * e^0.05 / 2 (mean over 2 tokens, 2 rows)
    assert log_prob.grad[0].tolist() == pytest.approx([0.0, -math.exp(0.05) / 4])
    assert log_prob.grad[1].tolist() == pytest.approx([math.exp(0.2) / 4, math.exp(0.2) / 4])


def test_geo_mean_weighs_a_row_by_the_geometric_mean_of_its_importance_weights() -> None:
    """Row 0's weights 4 and 1: geometric mean 2, loss 2 * -e^0.05; row 1's 1 and 1."""
    weights = T([[4.0, 1.0], [1.0, 1.0]])
    loss, _ = ca.compute_policy_loss_geo_mean(OLD, NEW, ADV, MASK, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((math.exp(0.2) - 2 * math.exp(0.05)) / 2, rel=1e-6)


def test_geo_mean_ignores_the_aggregation_and_the_normalisers_as_verl() -> None:
    plain, _ = ca.compute_policy_loss_geo_mean(OLD, NEW, ADV, MASK)
    for mode in ca.LOSS_AGG_MODES:
        loss, _ = ca.compute_policy_loss_geo_mean(OLD, NEW, ADV, MASK, mode, dp_size=4, batch_num_tokens=3.0,
                                                  global_batch_size=7.0, loss_scale_factor=9.0)
        assert loss.item() == plain.item()


def test_geo_mean_is_accepted_and_keeps_every_row_in_the_update() -> None:
    """Its mean over a micro-batch's rows counts a row of zero advantages: under the model engine
    (where other losses skip such rows) every row is computed."""
    for mode, every_row in (("geo_mean", True), ("vanilla", False)):
        cfg = load_config([f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", "trainer.use_legacy_worker_impl=disable"])
        assert update.keeps_every_row(cfg, False) is every_row, mode


# --------------------------------------------------------------------------- PF-PPO


def test_pf_ppo_weights() -> None:
    scores = T([-2.0, 0.0, 1.0, 1.0])
    assert ca.pf_ppo_weights(scores, "pow", 2.0).tolist() == [4.0, 0.0, 1.0, 1.0]  # |s| ** 2
    assert ca.pf_ppo_weights(scores, "pow", 0.0).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert ca.pf_ppo_weights(scores, "max_min", 2.0).tolist() == [1.0, 0.0, 1.0, 1.0]  # the best and the worst
    assert ca.pf_ppo_weights(scores, "max_random", 2.0).tolist() == pytest.approx([0.1, 0.1, 0.4, 0.4])
    assert ca.pf_ppo_weights(T([0.5, 0.5]), "max_min", 2.0).tolist() == [1.0, 1.0]  # all tie: all kept
    with pytest.raises(ValueError, match="Valid values: pow, max_min, max_random"):
        ca.pf_ppo_weights(scores, "min", 2.0)


def test_pf_ppo_draws_as_many_rows_by_weight_and_the_same_for_the_same_seed() -> None:
    scores = T([-2.0, 0.0, 1.0] * 20)
    rows = ca.pf_ppo_rows(scores, "max_min", 2.0, torch.Generator().manual_seed(7))
    assert len(rows) == 60 and set((rows % 3).tolist()) == {0, 2}  # weight 1e-8: the middle rows are never drawn
    again = ca.pf_ppo_rows(scores, "max_min", 2.0, torch.Generator().manual_seed(7))
    other = ca.pf_ppo_rows(scores, "max_min", 2.0, torch.Generator().manual_seed(8))
    assert rows.tolist() == again.tolist() != other.tolist()
    zero = ca.pf_ppo_rows(torch.zeros(50), "pow", 2.0, torch.Generator().manual_seed(7))
    assert len(set(zero.tolist())) > 10  # all weights 0: +1e-8 each, a uniform draw (as verl)


def gae_batch() -> StepBatch:
    rows = 6
    mask = torch.ones(rows, 3)
    scores = torch.zeros(rows, 3)
    scores[:, -1] = T([1.0, 0.0, 0.0, 0.0, 0.0, -1.0])
    return StepBatch(examples=list(range(rows)), uids=list(range(rows)),
                     input_ids=torch.arange(rows).unsqueeze(-1).expand(rows, 5).clone(),
                     attention_mask=torch.ones(rows, 5, dtype=torch.long), response_mask=mask,
                     values=torch.arange(rows).unsqueeze(-1).expand(rows, 3).float() / 10, token_scores=scores)


def test_the_advantage_stage_redraws_every_field_after_gae() -> None:
    """`max_min` keeps only rows 0 and 5 (scores 1 and -1); each row drawn keeps its own
    advantages, values, ids; the same seed draws the same rows."""
    cfg = load_config(["algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min"])
    kl = ca.make_kl_controller("fixed", 0.0)
    plain = gae_batch()
    compute_advantages(plain, load_config([]).algorithm, kl)
    batch = gae_batch()
    compute_advantages(batch, cfg.algorithm, kl, pf_ppo_seed=11)
    assert len(batch) == 6 and set(batch.uids) <= {0, 5} and batch.examples == batch.uids
    assert batch.input_ids[:, 0].tolist() == batch.uids
    assert batch.values is not None and batch.advantages is not None and plain.advantages is not None
    assert torch.equal(batch.values, plain.values[batch.uids])  # type: ignore[index]
    assert torch.equal(batch.advantages, plain.advantages[batch.uids])
    again = gae_batch()
    compute_advantages(again, cfg.algorithm, kl, pf_ppo_seed=11)
    assert again.uids == batch.uids
    with pytest.raises(ValueError, match="pass `pf_ppo_seed`"):
        compute_advantages(gae_batch(), cfg.algorithm, kl)


def test_the_pf_ppo_keys_are_accepted_with_their_values_checked() -> None:
    cfg = load_config(["algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=max_random",
                       "algorithm.pf_ppo.weight_pow=3"])
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo.reweight_method == "max_random"
    assert cfg.algorithm.pf_ppo.weight_pow == 3.0
    assert not load_config([]).algorithm.use_pf_ppo  # verl's default: off, `pow`, 2.0
    assert load_config([]).algorithm.pf_ppo.weight_pow == 2.0
    with pytest.raises(ConfigError, match="reweight_method=min` is not a PF-PPO reweighting; valid values: pow"):
        load_config(["algorithm.pf_ppo.reweight_method=min"])
    with pytest.raises(ConfigError, match="weight_pow=-1.0` must be a finite number >= 0"):
        load_config(["algorithm.pf_ppo.weight_pow=-1"])
    with pytest.raises(ConfigError, match="resamples only after `gae`.*Fix: `algorithm.adv_estimator=gae`"):
        load_config(["algorithm.use_pf_ppo=true", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])
