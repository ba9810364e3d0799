"""Each PPO function against a case computed by hand (numbers in the comments)."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from trainer.algos import core_algos as ca

T = torch.tensor


def close(a: torch.Tensor, b: object, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------- masked statistics

VALUES = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_and_mean() -> None:
    close(ca.masked_sum(VALUES, MASK), 7.0)
    close(ca.masked_mean(VALUES, MASK), 7.0 / 3)
    close(ca.masked_mean(VALUES, MASK, axis=-1), [1.5, 4.0])
    close(ca.masked_sum(VALUES, MASK, axis=-1), [3.0, 4.0])
    close(ca.masked_mean(VALUES, torch.zeros_like(MASK)), 0.0)


def test_masked_var_and_whiten() -> None:
    # valid values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    close(ca.masked_var(VALUES, MASK, unbiased=False), 42 / 27)
    close(ca.masked_var(VALUES, MASK), 42 / 18)
    w = ca.masked_whiten(VALUES, MASK)
    std = math.sqrt(42 / 18)
    close(w[MASK.bool()], [(1 - 7 / 3) / std, (2 - 7 / 3) / std, (4 - 7 / 3) / std], atol=1e-5)
    w2 = ca.masked_whiten(VALUES, MASK, shift_mean=False)
    close(w2[MASK.bool()], w[MASK.bool()] + 7 / 3, atol=1e-5)


def test_masked_var_single_element_fails_clearly() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        ca.masked_var(VALUES, T([[1.0, 0, 0], [0, 0, 0]]))


def test_scores_to_token_level() -> None:
    mask = T([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = ca.scores_to_token_level(T([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, 1, 0], [0, 0, 2], [0, 0, 3]])  # an empty response: index -1, as verl writes it


# --------------------------------------------------------------------------- advantages


def _whiten_list(xs: list[float]) -> list[float]:
    mean, std = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mean) / math.sqrt(std**2 + 1e-8) for x in xs]


def test_gae_hand_case_with_padding() -> None:
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: A2 = 1 - .7 = .3; A1 = (.9*.7 - .6) + .72*.3 = .246; A0 = (.9*.6 - .5) + .72*.246
    # row 1 (last token padding, its value 9.0 must not bootstrap): A1 = 2 - .4 = 1.6;
    #   A0 = (.9*.4 - .2) + .72*1.6 = 1.312
    raw = [0.21712, 0.246, 0.3, 1.312, 1.6]
    close(ret, [[0.71712, 0.846, 1.0], [1.512, 2.0, 9.0]], atol=1e-5)
    close(adv[mask.bool()], _whiten_list(raw), atol=1e-5)
    assert adv[1, 2].item() == 0.0


def test_grpo_with_and_without_std() -> None:
    mask = T([[1.0, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    scores = T([1.0, 0.0, 3.0, 3.0, 2.0])
    rewards = ca.scores_to_token_level(scores, mask)
    uid = ["a", "a", "b", "b", "c"]
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, uid)
    # group a: mean .5, unbiased std sqrt(.5): +-.5/.70711; group b: std 0 -> 0; c alone: 2/1
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[a, a], [-a, 0], [0, 0], [0, 0], [2 / (1 + 1e-6), 0]], atol=1e-5)
    assert torch.equal(adv, ret)
    adv2, _ = ca.compute_grpo_outcome_advantage(rewards, mask, uid, norm_adv_by_std_in_grpo=False)
    close(adv2, [[0.5, 0.5], [-0.5, 0], [0, 0], [0, 0], [2, 0]])


def test_rloo_leave_one_out() -> None:
    mask = torch.ones(4, 2)
    rewards = ca.scores_to_token_level(T([1.0, 2.0, 6.0, 5.0]), mask)
    adv, _ = ca.compute_rloo_outcome_advantage(rewards, mask, [0, 0, 0, 1])
    # others' means: 4, 3.5, 1.5 -> -3, -1.5, 4.5; a group of one keeps its score
    close(adv[:, 0], [-3.0, -1.5, 4.5, 5.0], atol=1e-5)


def test_reinforce_plus_plus() -> None:
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    close(adv[mask.bool()], _whiten_list([0.25, 0.5, 1.0, 1.0, 2.0]), atol=1e-5)
    assert adv[1, 2].item() == 0.0


def test_reinforce_plus_plus_baseline() -> None:
    mask = T([[1.0, 1], [1, 0], [1, 1]])
    rewards = ca.scores_to_token_level(T([1.0, 0.0, 3.0]), mask)
    adv, ret = ca.compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=["a", "a", "b"])
    # minus the group mean (a: .5; b alone: 0), on every token, whitened over the 5 tokens
    close(adv[mask.bool()], _whiten_list([0.5, 0.5, -0.5, 3.0, 3.0]), atol=1e-5)
    assert adv[1, 1].item() == 0.0 and torch.equal(adv, ret)


def test_opo_length_weighted_baseline() -> None:
    mask = T([[1.0, 1], [1, 0], [1, 1], [1, 1]])
    rewards = ca.scores_to_token_level(T([1.0, 0.0, 2.0, 4.0]), mask)
    adv, _ = ca.compute_advantage("opo", rewards, mask, index=["a", "a", "a", "b"])
    # group a: lengths 2, 1, 2 -> baseline (2*1 + 1*0 + 2*2) / 5 = 1.2; b alone: baseline 0
    close(adv, [[-0.2, -0.2], [-1.2, 0.0], [0.8, 0.8], [4.0, 4.0]], atol=1e-6)


def test_gpg_scales_by_the_share_of_non_zero_scores() -> None:
    mask = torch.ones(4, 2)
    rewards = ca.scores_to_token_level(T([1.0, 0.0, 0.0, 2.0]), mask)
    adv, _ = ca.compute_advantage("gpg", rewards, mask, index=["a", "a", "b", "b"])
    # alpha = 4 rows / 2 non-zero = 2; group means .5 and 1
    close(adv[:, 0], [1.0, -1.0, -2.0, 2.0])


def test_grpo_passk_rewards_only_the_best() -> None:
    mask = torch.ones(5, 1)
    rewards = ca.scores_to_token_level(T([1.0, 3.0, 2.0, 5.0, 5.0]), mask)
    index = ["a", "a", "a", "b", "b"]
    adv, _ = ca.compute_advantage("grpo_passk", rewards, mask, index=index)
    # a: best 3 - second 2 = 1, over std(1, 3, 2) = 1; b: a tie, 0
    close(adv[:, 0], [0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0])
    adv, _ = ca.compute_advantage("grpo_passk", rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    close(adv[:, 0], [0.0, 1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        ca.compute_advantage("grpo_passk", rewards, mask, index=["a", "a", "a", "b", "c"])


def test_remax_subtracts_the_greedy_score() -> None:
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_advantage("remax", rewards, mask, reward_baselines=T([0.5, 1.0]))
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])  # reward-to-go
    close(adv, [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="reward_baselines"):
        ca.compute_advantage("remax", rewards, mask)


def test_compute_advantage_dispatch_and_errors() -> None:
    mask = torch.ones(2, 2)
    rewards = T([[0.0, 1.0], [0.0, 0.0]])
    adv, _ = ca.compute_advantage("grpo", rewards, mask, index=["x", "x"])
    assert adv[0, 0] > 0 > adv[1, 0]
    with pytest.raises(ValueError, match="critic `values`"):
        ca.compute_advantage("gae", rewards, mask)
    with pytest.raises(ValueError, match="uid"):
        ca.compute_advantage("rloo", rewards, mask)
    with pytest.raises(ValueError, match="Valid values: gae, grpo, rloo"):
        ca.compute_advantage("ppo", rewards, mask)
    with pytest.raises(ValueError, match="3 entries but the batch has 2"):
        ca.compute_grpo_outcome_advantage(rewards, mask, [1, 2, 3])


# --------------------------------------------------------------------------- aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 3),  # (3 + 4) / padded length 3, no sequence count (verl)
    ],
)
def test_agg_loss_modes(mode: str, expected: float) -> None:
    close(ca.agg_loss(LOSS, MASK, mode), expected)


def test_agg_loss_global_normalisers_and_errors() -> None:
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10), 7 / 10)
    # Dr.GRPO takes neither the sequence count nor the data-parallel size
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10, dp_size=4,
                      global_batch_size=99), 7 / 10)
    close(ca.agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=14), 0.5)
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum", global_batch_size=7, dp_size=2), 2.0)
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-mean", global_batch_size=11, dp_size=2), 5.5 / 11 * 2)
    # a row without tokens: not counted locally, counted in verl's global_batch_size (rows)
    mask = T([[1.0, 1, 0], [0, 0, 0], [1, 0, 0]])
    loss = T([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum"), (3 + 7) / 2)
    assert ca.loss_normalizers(mask) == (3.0, 3.0)
    with pytest.raises(ValueError, match="Valid values: token-mean"):
        ca.agg_loss(LOSS, MASK, "mean")


def _minibatch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(4, 5, 3, generator=g)
    lengths = [5, 1, 3, 2]
    mask = torch.zeros(4, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return feats, mask


def _grad(mode: str, rank_rows: list[list[int]], micro: int, global_norm: bool) -> torch.Tensor:
    """Gradient of the token loss `feats @ w`, aggregated per micro-batch the way the workers do:
    verl's default worker (local normalisers, times 1 / gradient accumulation) or its model
    engine (normalisers of the whole mini-batch, times the world size); ranks averaged."""
    feats, mask = _minibatch()
    w = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1]))
    world = len(rank_rows)
    tokens, rows = ca.loss_normalizers(mask)
    total = torch.zeros(3)
    for mine in rank_rows:
        w.grad = None
        for i in range(0, len(mine), micro):
            part = mine[i:i + micro]
            if global_norm:
                kwargs = {"batch_num_tokens": tokens, "global_batch_size": rows, "dp_size": world}
                ca.agg_loss(feats[part] @ w, mask[part], mode, **kwargs).backward()
            else:
                (ca.agg_loss(feats[part] @ w, mask[part], mode) / (len(mine) // micro)).backward()
        assert w.grad is not None
        total += w.grad / world  # data parallelism averages the ranks' gradients
    return total


def _expected(mode: str, micro_batches: list[list[int]], scale: float) -> torch.Tensor:
    """The same gradient written out: d/dw of `scale * sum over micro-batches of their mean`,
    the mean of `feats @ w` per verl's mode, term by term."""
    feats, mask = _minibatch()
    grad = torch.zeros(3)
    for part in micro_batches:
        if mode == "token-mean":
            count = sum(mask[r].sum().item() for r in part)
            grad += scale * sum((feats[r] * mask[r, :, None]).sum(0) for r in part) / count
        elif mode == "seq-mean-token-mean":
            grad += scale * sum((feats[r] * mask[r, :, None]).sum(0) / mask[r].sum() for r in part) / len(part)
    return grad


def test_default_worker_takes_micro_batch_means_over_gradient_accumulation() -> None:
    """verl's default worker: rank r's micro-batch j contributes mean_j / GA, ranks averaged.
    Two ranks of two rows, micro-batches of one: each micro-batch weighs 1/2 * 1/2."""
    for mode in ("token-mean", "seq-mean-token-mean"):
        got = _grad(mode, [[0, 1], [2, 3]], 1, global_norm=False)
        torch.testing.assert_close(got, _expected(mode, [[0], [1], [2], [3]], 0.25))
    # micro-batches of two on one rank: the same two means, each weighing 1/2
    got = _grad("token-mean", [[0, 1, 2, 3]], 2, global_norm=False)
    torch.testing.assert_close(got, _expected("token-mean", [[0, 1], [2, 3]], 0.5))


def test_model_engine_divides_by_the_whole_mini_batch() -> None:
    """verl's model engine: token-mean over all 11 tokens, seq-mean over all 4 rows, whatever the
    split over ranks and micro-batches."""
    whole = {mode: _expected(mode, [[0, 1, 2, 3]], 1.0) for mode in ("token-mean", "seq-mean-token-mean")}
    for mode, expected in whole.items():
        for ranks, micro in (([[0, 1, 2, 3]], 4), ([[0, 1, 2, 3]], 1), ([[0, 1], [2, 3]], 1), ([[0], [1, 2, 3]], 2)):
            torch.testing.assert_close(_grad(mode, ranks, micro, global_norm=True), expected)
    # the two workers differ whenever the micro-batches hold different token counts
    assert not torch.allclose(_grad("token-mean", [[0, 1], [2, 3]], 1, False), whole["token-mean"], atol=1e-4)


# --------------------------------------------------------------------------- losses

P = ca.PolicyLossParams


def test_policy_loss_hand_case() -> None:
    ratios = T([[1.5, 0.5, 5.0, 0.5, 2.0]])
    log_prob = ratios.log().requires_grad_(True)
    old = torch.zeros_like(log_prob)
    adv = T([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    pg_loss, metrics = ca.compute_policy_loss(
        old, log_prob, adv, mask, params=P(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0))
    # token 1: A=+1, r=1.5 -> clipped to 1.3 -> -1.3      token 2: A=+1, r=.5 -> -.5
    # token 3: A=-1, r=5 -> max(5, 1.3)=5 -> dual clip 3  token 4: A=-1, r=.5 -> max(.5,.8)=.8
    close(pg_loss, (-1.3 - 0.5 + 3.0 + 0.8) / 4)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # tokens 1 and 4
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # token 3
    assert metrics["actor/ppo_kl"] == pytest.approx(
        -(math.log(1.5) + math.log(0.5) + math.log(5) + math.log(0.5)) / 4, abs=1e-6)
    pg_loss.backward()
    # only token 2 is unclipped: d/dlogp (-A * r) / 4 = -0.5 / 4
    close(log_prob.grad, [[0.0, -0.125, 0.0, 0.0, 0.0]])


def test_policy_loss_honours_a_zero_lower_clip() -> None:
    """`clip_ratio_low=0` floors the ratio at 1 - 0 = 1; it is never replaced by `clip_ratio`."""
    log_prob = T([[math.log(0.5)]]).requires_grad_(True)
    old, adv, mask = torch.zeros(1, 1), T([[-1.0]]), torch.ones(1, 1)
    pg_loss, metrics = ca.compute_policy_loss(old, log_prob, adv, mask, params=P(clip_ratio_low=0.0))
    close(pg_loss, 1.0)  # A=-1, r=.5: max(-A*r = .5, -A*clip(.5, 1, 1.2) = 1) = 1
    assert metrics["actor/pg_clipfrac"] == 1.0
    pg_loss.backward()
    close(log_prob.grad, [[0.0]])  # clipped: no gradient
    default, _ = ca.compute_policy_loss(old, log_prob, adv, mask)
    close(default, 0.8)  # clip_ratio_low=0.2 (verl's default): max(.5, .8)


def test_policy_loss_rejects_bad_dual_clip() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(z, z, z, z + 1, params=P(clip_ratio_c=1.0))


def test_gspo_sequence_ratio() -> None:
    log_prob = T([[0.2, 0.4], [-0.1, 7.0]]).requires_grad_(True)
    old = torch.zeros(2, 2)
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    pg_loss, metrics = ca.compute_policy_loss_gspo(old, log_prob, adv, mask, loss_agg_mode="token-mean")
    # row 0: s = e^((.2 + .4) / 2) = e^.3 = 1.3499 > 1.2: both tokens -1.2 (clipped)
    # row 1: s = e^-.1 = .9048 inside [.8, 1.2]: +.9048; seq-mean-token-mean whatever the mode
    close(pg_loss, (-1.2 + math.exp(-0.1)) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.2 + 0.4 - 0.1) / 3, abs=1e-6)
    pg_loss.backward()
    # token (1, 0): d(-A * sg[s] * p / sg[p]) / dlogp = -A * s = e^-.1, over 1 token and 2 rows
    close(log_prob.grad, [[0.0, 0.0], [math.exp(-0.1) / 2, 0.0]])


def test_sapo_smooth_gate() -> None:
    log_prob = T([[0.5], [0.0]]).requires_grad_(True)
    old = torch.zeros(2, 1)
    adv = T([[1.0], [-1.0]])
    pg_loss, metrics = ca.compute_policy_loss_sapo(old, log_prob, adv, torch.ones(2, 1))
    r = math.exp(0.5)
    sig = 1 / (1 + math.exp(-(r - 1)))  # tau_pos = 1: gate sigmoid(r - 1) * 4
    # row 1: r = 1, tau_neg = 1.05: gate sigmoid(0) * 4 / 1.05
    close(pg_loss, (-4 * sig + 2 / 1.05) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.0
    pg_loss.backward()
    # d gate / d logp = sigmoid'(tau (r - 1)) * tau * (4 / tau) * r = 4 sig (1 - sig) r
    close(log_prob.grad, [[-4 * sig * (1 - sig) * r / 2], [4 * 0.25 * 1.0 / 2]])


def test_cispo_stops_the_gradient_of_the_clipped_weight() -> None:
    log_prob = T([[math.log(1.5), math.log(0.5)]]).requires_grad_(True)
    adv = T([[1.0, -1.0]])
    pg_loss, metrics = ca.compute_policy_loss_cispo(torch.zeros(1, 2), log_prob, adv, torch.ones(1, 2))
    # weights clip(1.5) = 1.2 and clip(.5) = .8, detached: loss -(1.2 * 1 * lp0 + .8 * -1 * lp1) / 2
    close(pg_loss, -(1.2 * math.log(1.5) - 0.8 * math.log(0.5)) / 2)
    assert metrics["actor/pg_clipfrac"] == 1.0
    pg_loss.backward()
    close(log_prob.grad, [[-0.6, 0.4]])


def test_gpg_plain_policy_gradient() -> None:
    log_prob = T([[-1.0, -2.0]]).requires_grad_(True)
    pg_loss, metrics = ca.compute_policy_loss_gpg(torch.zeros(1, 2), log_prob, T([[2.0, 3.0]]), torch.ones(1, 2))
    close(pg_loss, (2.0 + 6.0) / 2)
    assert metrics == {}
    pg_loss.backward()
    close(log_prob.grad, [[-1.0, -1.5]])


COV_LOGP = T([[-0.5, -3.0, -2.0, -2.5]])  # mean -2: deviations 1.5, -1, 0, -.5
COV_ADV = T([[2.0, -2.0, 0.0, 0.0]])  # mean 0: covariances 3, 2, 0, 0


def test_clip_cov_drops_the_gradient_of_one_high_covariance_token() -> None:
    log_prob = COV_LOGP.clone().requires_grad_(True)
    # on-policy (ratio 1, no clip); only token 1's covariance 2 lies in (1, 2.5); 1 token dropped
    pg_loss, metrics = ca.compute_policy_loss_clip_cov(
        COV_LOGP.clone(), log_prob, COV_ADV, torch.ones(1, 4), params=P(clip_cov_ub=2.5))
    close(pg_loss, -2.0 / 4)  # tokens: -2, 0 (dropped), 0, 0
    assert metrics["actor/pg_clipfrac"] == 0.25
    pg_loss.backward()
    close(log_prob.grad, [[-2.0 / 4, 0.0, 0.0, 0.0]])


def test_kl_cov_penalises_the_top_covariance_token() -> None:
    d = T([[0.1, -0.2, 0.0, 0.3]])  # log ratios
    log_prob = COV_LOGP.clone().requires_grad_(True)
    pg_loss, metrics = ca.compute_policy_loss_kl_cov(COV_LOGP - d, log_prob, COV_ADV, torch.ones(1, 4))
    # top covariance (3): token 0 gets + ppo_kl_coef (.1) * |d0|
    close(pg_loss, (-2 * math.exp(0.1) + 0.1 * 0.1 + 2 * math.exp(-0.2)) / 4)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.15, abs=1e-6)
    pg_loss.backward()
    close(log_prob.grad, [[(-2 * math.exp(0.1) + 0.1) / 4, 2 * math.exp(-0.2) / 4, 0.0, 0.0]])


def test_value_loss_hand_case() -> None:
    vpreds = T([[1.0, 2.0, 0.0]])
    values = T([[0.5, 0.5, 0.5]])
    returns = T([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    vf_loss, vf_clipfrac = ca.compute_value_loss(vpreds, returns, values, mask, 0.2)
    # clipped preds .7 .7 .3: losses max(0, .09)=.09, max(1, .09)=1, max(1, .49)=1
    close(vf_loss, 0.5 * 2.09 / 3)
    close(vf_clipfrac, 1 / 3)


def test_entropy_from_logits() -> None:
    logits = T([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]])
    ent = ca.entropy_from_logits(logits[:1])
    close(ent, [math.log(4)])
    p = [0.25, 0.75]
    close(ca.entropy_from_logits(logits[1:, :2]), [-sum(x * math.log(x) for x in p)])


# --------------------------------------------------------------------------- KL


def test_kl_estimators() -> None:
    lp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    ln2 = math.log(2)
    close(ca.kl_penalty(lp, ref, "kl"), [ln2])
    close(ca.kl_penalty(lp, ref, "k1"), [ln2])
    close(ca.kl_penalty(ref, lp, "abs"), [ln2])
    close(ca.kl_penalty(lp, ref, "mse"), [0.5 * ln2**2])
    close(ca.kl_penalty(lp, ref, "low_var_kl"), [0.5 + ln2 - 1])  # e^-ln2 - (-ln2) - 1
    close(ca.kl_penalty(T([0.0]), T([-30.0]), "k3"), [10.0])  # clamped
    close(ca.kl_penalty(lp, ref, "k2"), [0.5 * ln2**2])
    with pytest.raises(ValueError, match="Valid values: kl, k1, abs"):
        ca.kl_penalty(lp, ref, "full")


@pytest.mark.parametrize(("name", "value", "plain_grad"), [
    ("k1+", math.log(2), 1.0),  # d(lp - ref)/dlp = 1
    ("kl+", math.log(2), 1.0),
    ("abs+", math.log(2), 1.0),
    ("k2+", 0.5 * math.log(2) ** 2, math.log(2)),
    ("mse+", 0.5 * math.log(2) ** 2, math.log(2)),
    ("k3+", 0.5 + math.log(2) - 1, 0.5),  # d(e^(ref-lp) - (ref-lp) - 1)/dlp = 1 - e^(ref-lp) = .5
    ("low_var_kl+", 0.5 + math.log(2) - 1, 0.5),
])
def test_kl_straight_through_variants(name: str, value: float, plain_grad: float) -> None:
    """`X+`: the value of estimator X, the gradient of k2, d(.5 (lp - ref)^2)/dlp = lp - ref = ln 2."""
    lp = T([math.log(0.5)]).requires_grad_(True)
    ref = T([math.log(0.25)])
    kl = ca.kl_penalty(lp, ref, name)
    close(kl.detach(), [value])
    kl.sum().backward()
    close(lp.grad, [math.log(2)])
    plain = T([math.log(0.5)]).requires_grad_(True)
    ca.kl_penalty(plain, ref, name.rstrip("+")).sum().backward()
    close(plain.grad, [plain_grad])


def test_apply_kl_penalty() -> None:
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1, 1], [1, 1, 0]])
    old = T([[0.1, 0.2, 0.3], [0.0, 0.4, 5.0]])
    rewards, current_kl = ca.apply_kl_penalty(scores, old, torch.zeros(2, 3), mask, 0.5, "kl")
    close(rewards, [[-0.05, -0.1, 0.85], [0.0, 1.8, 0.0]])
    assert current_kl == pytest.approx(0.2)  # mean of per-sequence means .2 and .2


def test_kl_controllers_and_state() -> None:
    fixed = ca.make_kl_controller("fixed", 0.3)
    fixed.update(5.0, 100)
    assert fixed.value == 0.3
    ctl = ca.make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    ctl.update(0.1, n_steps=10)  # error clipped to +.2: x 1.02
    assert ctl.value == pytest.approx(0.102)
    state = ctl.state_dict()
    ctl.update(0.04, n_steps=10)  # error clipped to -.2: x .98
    assert ctl.value == pytest.approx(0.09996)
    again = ca.AdaptiveKLController(1.0, 1.0, 1)
    again.load_state_dict(state)
    again.update(0.04, n_steps=10)
    assert again.value == ctl.value
    with pytest.raises(ValueError, match="fixed, adaptive"):
        ca.make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl"):
        ca.make_kl_controller("adaptive", 0.1, target_kl=0.0)


# --------------------------------------------------------------------------- learning rate


def test_lr_warmup_schedules() -> None:
    """verl's schedules, by hand: both warm up from 0; the cosine falls from 1 to
    `min_lr_ratio` over the steps after the warm-up (`num_cycles=0.5`)."""
    assert [ca.lr_lambda(s, 4, 10) for s in range(6)] == [0, 0.25, 0.5, 0.75, 1, 1]
    # warm-up 2 of 6 steps, floor 0.1: 0, 1/2, then 0.55 + 0.45 cos(pi (s - 2) / 4)
    cos = [ca.lr_lambda(s, 2, 6, "cosine", min_lr_ratio=0.1) for s in (0, 1, 2, 4, 6)]
    assert cos == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1])
    # one whole wave (`num_cycles=1`) over 4 steps, floor 0.2: down to 0.2 and back up to 1
    wave = [ca.lr_lambda(s, 0, 4, "cosine", min_lr_ratio=0.2, num_cycles=1.0) for s in range(5)]
    assert wave == pytest.approx([1.0, 0.6, 0.2, 0.6, 1.0])
    assert ca.resolve_warmup_steps(-1, 0.25, 10) == 2
    assert ca.resolve_warmup_steps(3, 0.25, 10) == 3
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'.*constant, cosine"):
        ca.lr_lambda(0, 1, 1, "linear")


def test_build_lr_scheduler_drives_optimizer() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = ca.build_lr_scheduler(opt, num_warmup_steps=2, num_training_steps=10)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------------- registries


def test_registries_declare_what_each_estimator_needs() -> None:
    from trainer.algos import registry

    assert registry.adv_estimator_names() == ["gae", "grpo", "rloo", "reinforce_plus_plus",
                                              "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk"]
    needs = {name: (registry.adv_estimator(name).needs_critic, registry.adv_estimator(name).min_group_size,
                    registry.adv_estimator(name).greedy_baseline)
             for name in registry.adv_estimator_names()}
    assert needs == {"gae": (True, 1, False), "grpo": (False, 2, False), "rloo": (False, 2, False),
                     "reinforce_plus_plus": (False, 1, False), "reinforce_plus_plus_baseline": (False, 1, False),
                     "remax": (False, 1, True), "opo": (False, 2, False), "gpg": (False, 2, False),
                     "grpo_passk": (False, 2, False)}
    assert registry.adv_estimator("grpo").fn is ca.compute_grpo_outcome_advantage
    assert registry.policy_loss("vanilla") is ca.compute_policy_loss
    assert registry.policy_loss_names() == ["vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov",
                                            "geo_mean"]
    with pytest.raises(ValueError, match="Valid values: vanilla, gspo"):
        registry.policy_loss("dppo_tv")
    with pytest.raises(ValueError, match="registered once"):
        registry.register_adv_est("grpo")(ca.compute_rloo_outcome_advantage)
    with pytest.raises(ValueError, match="not declared; add it to `ADV_ESTIMATORS`"):
        registry.register_adv_est("undeclared")(ca.compute_rloo_outcome_advantage)
    assert all(registry.adv_estimator(n).fn is not None for n in registry.adv_estimator_names())
    assert all(registry.policy_loss(n) for n in registry.policy_loss_names())


def test_the_declarations_need_no_torch() -> None:
    """hpcrl's preflight reads what an estimator needs on a login node: the registry module
    imports no torch and needs no function registered."""
    code = ("import sys; from trainer.algos import registry; "
            "print(registry.adv_estimator('gae').needs_critic, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.split()
    assert out == ["True", "False"]


def test_a_registered_estimator_is_accepted_by_the_config_and_dispatched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding an estimator is one declaration and one decorated function: the configuration and
    `compute_advantage` read the declaration (its needs included), no list of names."""
    from trainer.algos import registry
    from trainer.config import ConfigError, load_config

    monkeypatch.setattr(registry, "ADV_ESTIMATORS", {
        **registry.ADV_ESTIMATORS,
        "constant_critic": registry.AdvEstimator("constant_critic", needs_critic=True, min_group_size=3)})

    @registry.register_adv_est("constant_critic")
    def constant(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **_: object):
        return response_mask * 2.0, response_mask

    cfg = load_config(["algorithm.adv_estimator=constant_critic", "actor_rollout_ref.rollout.n=3"])
    assert cfg.derived.use_critic
    with pytest.raises(ConfigError, match="needs `actor_rollout_ref.rollout.n` >= 3"):
        load_config(["algorithm.adv_estimator=constant_critic", "actor_rollout_ref.rollout.n=2"])
    with pytest.raises(ValueError, match="critic `values`"):
        ca.compute_advantage("constant_critic", torch.zeros(1, 2), torch.ones(1, 2))
    adv, _ = ca.compute_advantage("constant_critic", torch.zeros(1, 2), torch.ones(1, 2), values=torch.zeros(1, 2),
                                  index=[0])
    assert adv.tolist() == [[2.0, 2.0]]
    with pytest.raises(ConfigError, match="Valid values: gae, grpo, rloo, reinforce_plus_plus, .*grpo_passk, constant_critic"):
        load_config(["algorithm.adv_estimator=ppo"])
    with pytest.raises(ConfigError, match="loss_mode=dppo_tv` is not a registered policy loss"):
        load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv"])


def test_preflight_reads_the_critic_need_from_the_registry() -> None:
    from hpcrl.preflight import trains_critic

    assert trains_critic("gae") and not trains_critic("grpo") and not trains_critic("rloo")
    assert trains_critic("no_such_estimator")  # unknown: the larger checkpoint is assumed
