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
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 + 4) / (2 sequences * length 3)
    ],
)
def test_agg_loss_modes(mode: str, expected: float) -> None:
    close(ca.agg_loss(LOSS, MASK, mode), expected)


def test_agg_loss_explicit_normalisers_and_errors() -> None:
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10), 7 / 20)
    close(ca.agg_loss(LOSS, MASK, "token-mean", global_num_tokens=14), 0.5)
    close(ca.agg_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=7, dp_size=2), 2.0)
    assert ca.loss_normalizers(T([[1.0, 1, 0], [0, 0, 0], [1, 0, 0]])) == (3.0, 2.0)
    with pytest.raises(ValueError, match="Valid values: token-mean"):
        ca.agg_loss(LOSS, MASK, "mean")


def _minibatch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 5, 3, generator=g)
    lengths = [5, 1, 3, 4, 2, 5]
    mask = torch.zeros(6, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    adv = torch.randn(6, 5, generator=g)
    return feats, mask, adv


def _accumulated_grad(
    splits: list[int], mode: str, global_norm: bool, dp_size: int = 1
) -> torch.Tensor:
    """Policy-loss gradient of a linear 'model', accumulated over micro-batches."""
    feats, mask, adv = _minibatch()
    w = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1]))
    tokens, seqs = ca.loss_normalizers(mask)
    kwargs = {"global_num_tokens": tokens, "global_num_seqs": seqs} if global_norm else {}
    start = 0
    for size in splits:
        sl = slice(start, start + size)
        log_prob = feats[sl] @ w
        old = (feats[sl] @ w).detach() + 0.05
        loss, *_ = ca.compute_policy_loss(
            old, log_prob, adv[sl], mask[sl], loss_agg_mode=mode, dp_size=dp_size, **kwargs
        )
        (loss if global_norm else loss / len(splits)).backward()
        start += size
    assert w.grad is not None
    return w.grad / dp_size


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_micro_batch_split_does_not_change_gradient(mode: str) -> None:
    whole = _accumulated_grad([6], mode, global_norm=True)
    for splits in ([2, 2, 2], [1, 5], [3, 3], [1, 1, 1, 1, 1, 1]):
        torch.testing.assert_close(_accumulated_grad(splits, mode, True), whole)
    # Two data-parallel ranks, each holding half, averaging gradients: same result.
    torch.testing.assert_close(_accumulated_grad([3, 3], mode, True, dp_size=2), whole)


def test_naive_per_micro_batch_mean_would_differ() -> None:
    """The property above is not automatic: local normalisers change the gradient."""
    whole = _accumulated_grad([6], "token-mean", global_norm=True)
    naive = _accumulated_grad([1, 5], "token-mean", global_norm=False)
    assert not torch.allclose(naive, whole, atol=1e-4)


# --------------------------------------------------------------------------- losses


def test_policy_loss_hand_case() -> None:
    ratios = T([[1.5, 0.5, 5.0, 0.5, 2.0]])
    log_prob = ratios.log().requires_grad_(True)
    old = torch.zeros_like(log_prob)
    adv = T([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss(
        old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0
    )
    # token 1: A=+1, r=1.5 -> clipped to 1.3 -> -1.3      token 2: A=+1, r=.5 -> -.5
    # token 3: A=-1, r=5 -> max(5, 1.3)=5 -> dual clip 3  token 4: A=-1, r=.5 -> max(.5,.8)=.8
    close(pg_loss, (-1.3 - 0.5 + 3.0 + 0.8) / 4)
    close(clipfrac, 0.5)  # tokens 1 and 4
    close(clipfrac_lower, 0.25)  # token 3
    close(ppo_kl, -(math.log(1.5) + math.log(0.5) + math.log(5) + math.log(0.5)) / 4)
    pg_loss.backward()
    # only token 2 is unclipped: d/dlogp (-A * r) / 4 = -0.5 / 4
    close(log_prob.grad, [[0.0, -0.125, 0.0, 0.0, 0.0]])


def test_policy_loss_rejects_bad_dual_clip() -> None:
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(z, z, z, z + 1, clip_ratio_c=1.0)


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
    with pytest.raises(ValueError, match="Valid values: kl, k1, abs"):
        ca.kl_penalty(lp, ref, "full")


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

    assert registry.adv_estimator_names() == ["gae", "grpo", "rloo", "reinforce_plus_plus"]
    needs = {name: (registry.adv_estimator(name).needs_critic, registry.adv_estimator(name).min_group_size)
             for name in registry.adv_estimator_names()}
    assert needs == {"gae": (True, 1), "grpo": (False, 2), "rloo": (False, 2), "reinforce_plus_plus": (False, 1)}
    assert registry.adv_estimator("grpo").fn is ca.compute_grpo_outcome_advantage
    assert registry.policy_loss("vanilla") is ca.compute_policy_loss
    with pytest.raises(ValueError, match="Valid values: vanilla"):
        registry.policy_loss("gspo")
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
    with pytest.raises(ConfigError, match="Valid values: gae, grpo, rloo, reinforce_plus_plus, constant_critic"):
        load_config(["algorithm.adv_estimator=ppo"])
    with pytest.raises(ConfigError, match="loss_mode=gspo` is not a registered policy loss"):
        load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])


def test_preflight_reads_the_critic_need_from_the_registry() -> None:
    from hpcrl.preflight import trains_critic

    assert trains_critic("gae") and not trains_critic("grpo") and not trains_critic("rloo")
    assert trains_critic("no_such_estimator")  # unknown: the larger checkpoint is assumed
