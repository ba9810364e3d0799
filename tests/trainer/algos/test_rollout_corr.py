"""verl's rollout correction (`trainer.algos.rollout_corr`) on hand-computed cases.

The module was also run against verl's own `rollout_corr_helper.py` (b178a3c, its torch helpers
alone) on 3,600 random batches over 90 configurations (every `rollout_is` level, batch
normalisation on and off, every `rollout_rs` option and two chained ones, extreme log-ratios and
empty rows): masks equal, weights and every metric equal to the last bit (bench/README.md)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algos.registry import parse_rs_thresholds
from trainer.algos.rollout_corr import (
    RolloutCorrection,
    correct,
    is_weights,
    rejection_mask,
)

LOG2 = math.log(2.0)


def test_token_weights_are_truncated_ratios_zero_on_padding() -> None:
    # log r = old - rollout: ln 0.5, ln 1.5, ln 4 (truncated to 2), padding
    log_ratio = torch.tensor([[math.log(0.5), math.log(1.5), math.log(4.0), 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, m = is_weights(log_ratio, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.5, 2.0, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx((0.5 + 1.5 + 4.0) / 3)  # before truncation, as verl
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_max"] == pytest.approx(4.0)


def test_sequence_weights_are_the_product_over_the_row_then_normalised() -> None:
    log_ratio = torch.tensor([[LOG2, 0.0], [-LOG2, 0.0]])
    mask = torch.ones(2, 2)
    weights, _ = is_weights(log_ratio, mask, "sequence", 4.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 2.0], [0.5, 0.5]]))
    normalised, m = is_weights(log_ratio, mask, "sequence", 4.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.25)  # mean of 2 and 0.5
    assert torch.allclose(normalised, torch.tensor([[1.6, 1.6], [0.4, 0.4]]))


def test_token_k1_keeps_minus_log_ratio_inside_the_log_bounds() -> None:
    # token_k1 is -log r; bounds 0.5_2 keep -log r in [ln 0.5, ln 2]
    log_ratio = torch.tensor([[0.0, -1.0, 1.0, -0.5]])
    mask = torch.ones(1, 4)
    kept, m = rejection_mask(log_ratio, mask, "token_k1", "0.5_2")
    assert kept.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)


def test_a_sequence_option_rejects_the_whole_row() -> None:
    # seq_max_k2: the largest (log r)^2 / 2 of a row; row 0 has 0.5 * 1^2 = 0.5 > 0.2
    log_ratio = torch.tensor([[0.1, 1.0], [0.1, -0.2]])
    mask = torch.ones(2, 2)
    kept, m = rejection_mask(log_ratio, mask, "seq_max_k2", 0.2)
    assert kept.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert m["rollout_rs_seq_max_k2_seq_masked_fraction"] == pytest.approx(0.5)


def test_thresholds_are_read_as_verl_reads_them() -> None:
    assert parse_rs_thresholds(["token_k1"], 2.0) == {"token_k1": (0.5, 2.0)}
    assert parse_rs_thresholds(["token_k1", "seq_sum_k3"], "0.8_1.2,0.5") == {
        "token_k1": (0.8, 1.2), "seq_sum_k3": (None, 0.5)}
    with pytest.raises(ValueError, match="one upper bound"):
        parse_rs_thresholds(["token_k2"], "0.1_0.2")
    with pytest.raises(ValueError, match="3 values for 2"):
        parse_rs_thresholds(["token_k2", "token_k3"], "1,2,3")
    with pytest.raises(ValueError, match="unknown `rollout_rs` option `token_k9`"):
        rejection_mask(torch.zeros(1, 1), torch.ones(1, 1), "token_k9", 1.0)


def test_correct_returns_weights_the_mask_and_prefixed_offpolicy_metrics() -> None:
    old = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    weights, kept, m = correct(old, rollout, mask, RolloutCorrection(rollout_is="token"))
    assert weights is not None and torch.allclose(weights, torch.tensor([[math.exp(0.5), 1.0]]))
    assert torch.equal(kept, mask)
    assert m["rollout_corr/kl"] == pytest.approx(-0.25)  # mean(rollout - old)
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    none, _, only = correct(old, rollout, mask, RolloutCorrection())
    assert none is None and "rollout_corr/kl" in only and not any("rollout_is" in k for k in only)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov"])
def test_every_policy_loss_is_scaled_by_the_weights_per_token(mode: str) -> None:
    """verl multiplies each policy loss's per-token loss by `rollout_is_weights` right before the
    aggregation: ones change nothing, and a weight on one token scales only that token's part."""
    from trainer.algos import registry

    fn = registry.policy_loss(mode)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    new = old + 0.05 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    plain, _ = fn(old, new, adv, mask, "token-mean")
    ones, _ = fn(old, new, adv, mask, "token-mean", rollout_is_weights=torch.ones(3, 5))
    doubled, _ = fn(old, new, adv, mask, "token-mean", rollout_is_weights=torch.full((3, 5), 2.0))
    assert torch.allclose(ones, plain)
    assert torch.allclose(doubled, 2 * plain, atol=1e-7)
