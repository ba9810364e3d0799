"""Registries of the RL mathematics, keyed by verl's names (as verl's `register_adv_est` and
`register_policy_loss`).

What each advantage estimator needs (a critic's values, groups of `rollout.n >= 2` samples per
prompt) is declared once, here, in :data:`ADV_ESTIMATORS`; the configuration
(`algorithm.adv_estimator`, the derived `use_critic`) and hpcrl's preflight read those
declarations instead of lists of names. Policy losses are named in :data:`POLICY_LOSSES` (verl's
`actor_rollout_ref.actor.policy_loss.loss_mode`).

The functions themselves are tensor code in :mod:`trainer.algos.advantages` and
:mod:`trainer.algos.policy_losses`, bound to their declared name by :func:`register_adv_est` and
:func:`register_policy_loss`. This module imports no torch and imports none of the functions: the
declarations are readable on a login node, and :func:`adv_estimator` / :func:`policy_loss` return a
function once those modules (which :mod:`trainer.algos.core_algos`, imported by the trainer,
imports) have registered it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

__all__ = [
    "ADV_ESTIMATORS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "parse_rs_thresholds",
    "rs_options",
    "KL_ESTIMATORS",
    "PF_PPO_REWEIGHT_METHODS",
    "POLICY_LOSSES",
    "ROW_MEAN_LOSSES",
    "AdvEstimator",
    "adv_estimator",
    "adv_estimator_names",
    "policy_loss",
    "policy_loss_names",
    "register_adv_est",
    "register_policy_loss",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class AdvEstimator:
    """A declared advantage estimator and what it needs."""

    name: str
    """verl's `algorithm.adv_estimator` value."""
    needs_critic: bool = False
    """It bootstraps from a value model: the run trains a critic (`derived.use_critic`)."""
    min_group_size: int = 1
    """Samples per prompt it compares (`actor_rollout_ref.rollout.n` at least this); above 1 it
    also needs the prompt uid of each row."""
    greedy_baseline: bool = False
    """It subtracts the score of each prompt's greedy response (`reward_baselines=`): the driver
    runs one greedy rollout per prompt and scores it before the estimator (verl's ReMax)."""
    fn: Callable[..., Any] | None = None
    """`fn(token_level_rewards=, response_mask=, values=, index=, gamma=, lam=,
    norm_adv_by_std_in_grpo=, reward_baselines=) -> (advantages, returns)`; it ignores the inputs it does not use.
    None until :mod:`trainer.algos.advantages` registers it."""


ADV_ESTIMATORS: dict[str, AdvEstimator] = {e.name: e for e in (
    AdvEstimator("gae", needs_critic=True),
    AdvEstimator("grpo", min_group_size=2),
    AdvEstimator("rloo", min_group_size=2),
    AdvEstimator("reinforce_plus_plus"),
    AdvEstimator("reinforce_plus_plus_baseline"),
    AdvEstimator("remax", greedy_baseline=True),
    AdvEstimator("opo", min_group_size=2),
    AdvEstimator("gpg", min_group_size=2),
    AdvEstimator("grpo_passk", min_group_size=2),
)}
"""Every advantage estimator, in the order the configuration lists them."""

POLICY_LOSSES: tuple[str, ...] = ("vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean")
"""Every policy loss (`loss_mode`): `fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, params, **normalisers) -> (pg_loss, metrics)`."""

ROW_MEAN_LOSSES: tuple[str, ...] = ("geo_mean",)
"""Policy losses that average over the rows of each micro-batch themselves, whatever the
normalisers say (verl's `geo_mean`: `torch.mean` of the sequence losses): a row whose advantages
are all zero still counts in that mean, so the update computes every row where verl does
(`trainer.stages.update.keeps_every_row`)."""

PF_PPO_REWEIGHT_METHODS: tuple[str, ...] = ("pow", "max_min", "max_random")
"""verl's `algorithm.pf_ppo.reweight_method` values (:mod:`trainer.algos.pf_ppo`)."""

_KL_BASES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATORS: tuple[str, ...] = (*_KL_BASES, *(f"{name}+" for name in _KL_BASES))
"""verl's KL estimator names (`algorithm.kl_penalty`, `actor.kl_loss_type`); a trailing `+` takes
the gradient of `k2` (straight-through, `trainer.algos.kl.kl_penalty`)."""

_POLICY_LOSS_FNS: dict[str, Callable[..., Any]] = {}


def register_adv_est(name: str) -> Callable[[F], F]:
    """Bind the decorated function to the advantage estimator `name` declared in
    :data:`ADV_ESTIMATORS`."""

    def wrap(fn: F) -> F:
        declared = _declared(ADV_ESTIMATORS, name, "register_adv_est", "ADV_ESTIMATORS")
        if declared.fn is not None:
            raise ValueError(_twice("register_adv_est", name))
        ADV_ESTIMATORS[name] = replace(declared, fn=fn)
        return fn

    return wrap


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Bind the decorated function to the policy loss `name` (verl's `loss_mode`) declared in
    :data:`POLICY_LOSSES`."""

    def wrap(fn: F) -> F:
        _declared(dict.fromkeys(POLICY_LOSSES), name, "register_policy_loss", "POLICY_LOSSES")
        if name in _POLICY_LOSS_FNS:
            raise ValueError(_twice("register_policy_loss", name))
        _POLICY_LOSS_FNS[name] = fn
        return fn

    return wrap


def _declared(table: dict[str, Any], name: str, decorator: str, where: str) -> Any:
    if name not in table:
        raise ValueError(f"`{decorator}({name!r})`: `{name}` is not declared; add it to `{where}` "
                         "in trainer/algos/registry.py")
    return table[name]


def _twice(decorator: str, name: str) -> str:
    return (f"`{decorator}({name!r})` was called twice; each name is registered once, and "
            f"`{name}` is already taken")


def adv_estimator_names() -> list[str]:
    """Declared estimator names, in declaration order."""
    return list(ADV_ESTIMATORS)


def adv_estimator(name: str) -> AdvEstimator:
    """The estimator declared as `name`; an unknown name lists the valid ones."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"Unknown `algorithm.adv_estimator={name!r}`. Valid values: "
                         f"{', '.join(ADV_ESTIMATORS)}.")
    return ADV_ESTIMATORS[name]


def policy_loss_names() -> list[str]:
    """Declared policy-loss names, in declaration order."""
    return list(POLICY_LOSSES)


def policy_loss(name: str) -> Callable[..., Any]:
    """The policy-loss function registered as `name`; an unknown name lists the valid ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"Unknown `actor_rollout_ref.actor.policy_loss.loss_mode={name!r}`. Valid "
                         f"values: {', '.join(POLICY_LOSSES)}.")
    if name not in _POLICY_LOSS_FNS:
        raise ValueError(f"policy loss `{name}` is declared but no function is registered for it "
                         "(import trainer.algos.core_algos)")
    return _POLICY_LOSS_FNS[name]


# ----------------------------------------------------------------------------- rollout correction

ROLLOUT_IS_LEVELS = ("token", "sequence")
"""verl's `algorithm.rollout_correction.rollout_is` levels (:mod:`trainer.algos.rollout_corr`)."""
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""verl's `algorithm.rollout_correction.loss_type` values: bypass mode's losses."""
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's `rollout_rs` options: the divergence estimate (k1, k2, k3) per token or per sequence."""


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """Option -> (lower, upper): k1 options take ``lower_upper`` ratio bounds (a single value is the
    upper, its reciprocal the lower), the others one positive upper bound; one value serves all."""
    if spec is None:
        raise ValueError("`algorithm.rollout_correction.rollout_rs_threshold` must be set with `rollout_rs`. "
                         "Fix: give one threshold, or one per option (comma-separated).")
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(raw) not in (1, len(options)):
        raise ValueError(f"`rollout_rs_threshold` has {len(raw)} values for {len(options)} `rollout_rs` options. "
                         "Fix: one threshold shared by all options, or exactly one per option.")
    raw = raw * len(options) if len(raw) == 1 else raw
    out: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, raw, strict=True):
        if option.endswith("k1"):
            low, _, up = text.partition("_") if "_" in text else (str(1.0 / float(text)), "", text)
            lower, upper = float(low), float(up)
            if lower <= 0 or upper <= 0:
                raise ValueError(f"the thresholds of `{option}` must be positive, got `{text}`")
            out[option] = (lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"`{option}` takes one upper bound, without `_`; got `{text}`")
            if float(text) <= 0:
                raise ValueError(f"the threshold of `{option}` must be positive, got `{text}`")
            out[option] = (None, float(text))
    return out


def rs_options(rollout_rs: str) -> list[str]:
    """The options of `rollout_rs` (comma-separated), each once, in order; an unknown one is refused."""
    seen: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if opt and opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"unknown `rollout_rs` option `{opt}`. Fix: one or more of {', '.join(ROLLOUT_RS_OPTIONS)}")
        if opt and opt not in seen:
            seen.append(opt)
    if not seen:
        raise ValueError("`rollout_rs` names no option. Fix: e.g. `token_k1` or `seq_mean_k3`")
    return seen
