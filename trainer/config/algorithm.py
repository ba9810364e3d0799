"""`algorithm.*`: advantage estimation and the KL penalty in the reward (verl's `algorithm`
section). Defaults: `trainer/config/algorithm.yaml`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from trainer.algos import registry
from trainer.algos.registry import BYPASS_LOSS_TYPES
from trainer.config.base import ConfigError, h, require


@dataclass(frozen=True)
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = h("KL coefficient controller for the in-reward penalty")
    kl_coef: float = h("initial KL coefficient")
    horizon: int = h("adaptive controller horizon")
    target_kl: float = h("adaptive controller target KL")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: str | None = h("importance weights between the rollout's and the trainer's log-probs: `token`, "
                               "`sequence`, or null for none (needs `rollout.calculate_log_probs=true`)")
    rollout_is_threshold: float = h("upper bound the importance weights are truncated at")
    rollout_is_batch_normalize: bool = h("divide the importance weights by their batch mean")
    rollout_rs: str | None = h("rejection options, comma-separated (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
                               "seq_max_k2..3): responses outside `rollout_rs_threshold` leave the loss")
    rollout_rs_threshold: str | None = h("per option (comma-separated): `lower_upper` ratio bounds for k1 "
                                         "options, one upper bound for the others")
    bypass_mode: bool = h("verl's bypass mode: the rollout's log-probs are the old ones (no recomputation), and "
                          "the policy loss is bypass mode's (`loss_type`) whatever `policy_loss.loss_mode` says; "
                          "needs `rollout.calculate_log_probs=true`")
    loss_type: str = h("bypass mode's loss: `ppo_clip` (PPO over pi / pi_rollout, no weights) or `reinforce` "
                       "(-A log pi times the importance weights)")


@dataclass(frozen=True)
class PfPpoConfig:
    reweight_method: str = h("how a row's score weighs its draw: `pow` (|score| ** weight_pow), `max_min` "
                             "(only the batch's best and worst rows), `max_random` (best rows 0.4, others 0.1)")
    weight_pow: float = h("`pow`: the exponent (0 or more)")


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = h("discount factor")
    lam: float = h("GAE lambda")
    adv_estimator: str = h("advantage estimator registered under this name (`trainer.algos.registry`): "
                           "gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
                           "opo, gpg, grpo_passk")
    norm_adv_by_std_in_grpo: bool = h("grpo: divide by the group's standard deviation")
    use_kl_in_reward: bool = h("subtract a KL penalty from the token rewards")
    kl_penalty: str = h("KL estimator of the in-reward penalty (the names of `actor.kl_loss_type`)")
    kl_ctrl: KLCtrlConfig = h("KL controller")
    use_pf_ppo: bool = h("PF-PPO: after `gae`, redraw the batch's rows with replacement, weighted by their "
                         "scores (`trainer.algos.pf_ppo`; the draw is seeded per step)")
    pf_ppo: PfPpoConfig = h("PF-PPO's weights")
    rollout_correction: RolloutCorrectionConfig = h(
        "verl's rollout correction, decoupled mode (`trainer.algos.rollout_corr`): importance weights and "
        "rejection between the rollout's and the trainer's log-probs of the sampled tokens")


#: verl's `algorithm.*` keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "algorithm.filter_groups": "DAPO group filtering",
}

#: verl keys accepted that change nothing here, and why.
COMPAT: dict[str, str] = {}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {}


def estimator(name: str) -> Any:
    """The registered estimator `name` (:mod:`trainer.algos.registry`), or a `ConfigError`."""
    try:
        return registry.adv_estimator(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate_rollout_correction(algorithm: AlgorithmConfig, calculate_log_probs: bool) -> None:
    """verl's rules for `algorithm.rollout_correction`; and, stricter than verl (which then does
    nothing without a word), weights or rejection need the rollout's log-probs."""
    rc = algorithm.rollout_correction
    require(rc.rollout_is is None or rc.rollout_is in registry.ROLLOUT_IS_LEVELS,
            f"`algorithm.rollout_correction.rollout_is={rc.rollout_is}` must be `token`, `sequence` or null")
    require(rc.rollout_is_threshold > 0,
            f"`algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold}` must be positive")
    if rc.rollout_rs is not None:
        try:
            registry.parse_rs_thresholds(registry.rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
        except ValueError as err:
            raise ConfigError(f"`algorithm.rollout_correction`: {err}") from None
    require(rc.loss_type in BYPASS_LOSS_TYPES,
            f"`algorithm.rollout_correction.loss_type={rc.loss_type}` must be one of {', '.join(BYPASS_LOSS_TYPES)} "
            "(bypass mode's losses, verl's `compute_policy_loss_bypass_mode`)")
    require(calculate_log_probs or not rc.bypass_mode,
            "`algorithm.rollout_correction.bypass_mode=true` trains with the rollout's own log-probs of the sampled "
            "tokens as the old ones (verl: 'bypass_mode=True requires rollout_log_probs in batch'), which the "
            "rollout returns only with `actor_rollout_ref.rollout.calculate_log_probs=true`; set it")
    require(calculate_log_probs or (rc.rollout_is is None and rc.rollout_rs is None),
            "`algorithm.rollout_correction` weighs or rejects by the rollout's own log-probs of the sampled "
            "tokens, which the rollout returns only with `actor_rollout_ref.rollout.calculate_log_probs=true`; "
            "set it")


def validate_pf_ppo(algorithm: AlgorithmConfig) -> None:
    """verl's PF-PPO keys: a known reweighting, a usable exponent, and (where verl would ignore the
    switch without a word) the estimator verl applies it after."""
    pf = algorithm.pf_ppo
    require(pf.reweight_method in registry.PF_PPO_REWEIGHT_METHODS,
            f"`algorithm.pf_ppo.reweight_method={pf.reweight_method}` is not a PF-PPO reweighting; valid "
            f"values: {', '.join(registry.PF_PPO_REWEIGHT_METHODS)}")
    require(math.isfinite(pf.weight_pow) and pf.weight_pow >= 0,
            f"`algorithm.pf_ppo.weight_pow={pf.weight_pow}` must be a finite number >= 0: a negative "
            "power gives a row scoring 0 an infinite weight, and the draw fails (in verl too). Fix: e.g. 2.0")
    require(not algorithm.use_pf_ppo or algorithm.adv_estimator == "gae",
            f"`algorithm.use_pf_ppo=true` with `algorithm.adv_estimator={algorithm.adv_estimator}`: verl 0.9.1 "
            "resamples only after `gae` (`compute_advantage` in verl/trainer/ppo/ray_trainer.py) and ignores "
            "the switch with any other estimator. Fix: `algorithm.adv_estimator=gae`, or "
            "`algorithm.use_pf_ppo=false`")
