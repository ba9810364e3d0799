"""`algorithm.*`: advantage estimation and the KL penalty in the reward (verl's `algorithm`
section). Defaults: `trainer/config/algorithm.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.algos import registry
from trainer.config.base import ConfigError, h


@dataclass(frozen=True)
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = h("KL coefficient controller for the in-reward penalty")
    kl_coef: float = h("initial KL coefficient")
    horizon: int = h("adaptive controller horizon")
    target_kl: float = h("adaptive controller target KL")


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


#: verl's `algorithm.*` keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "algorithm.use_pf_ppo": "",
    "algorithm.pf_ppo": "",
    "algorithm.filter_groups": "DAPO group filtering",
    "algorithm.rollout_correction": "rollout importance-sampling correction",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "algorithm.use_pf_ppo": False,
}


def estimator(name: str) -> Any:
    """The registered estimator `name` (:mod:`trainer.algos.registry`), or a `ConfigError`."""
    try:
        return registry.adv_estimator(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
