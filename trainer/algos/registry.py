"""Registries of the RL mathematics, keyed by verl's names (as verl's `register_adv_est` and
`register_policy_loss`).

An advantage estimator is one function in :mod:`trainer.algos.core_algos` under
:func:`register_adv_est`, which declares once what it needs (a critic's values, groups of
`rollout.n >= 2` samples per prompt); the configuration (`algorithm.adv_estimator`, the derived
`use_critic`) and hpcrl's preflight read those declarations instead of lists of names. Policy
losses register the same way under :func:`register_policy_loss` (verl's
`actor_rollout_ref.actor.policy_loss.loss_mode`).

This module imports no torch: the functions register when :mod:`trainer.algos.core_algos` is
imported, which the lookups below do on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
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
    """A registered advantage estimator and what it needs."""

    name: str
    """verl's `algorithm.adv_estimator` value."""
    fn: Callable[..., Any]
    """`fn(token_level_rewards=, response_mask=, values=, index=, gamma=, lam=,
    norm_adv_by_std_in_grpo=) -> (advantages, returns)`; it ignores the inputs it does not use."""
    needs_critic: bool
    """It bootstraps from a value model: the run trains a critic (`derived.use_critic`)."""
    min_group_size: int
    """Samples per prompt it compares (`actor_rollout_ref.rollout.n` at least this); above 1 it
    also needs the prompt uid of each row."""


_ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
_POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def register_adv_est(name: str, *, needs_critic: bool = False, min_group_size: int = 1) -> Callable[[F], F]:
    """Register the decorated function as the advantage estimator `name`."""

    def wrap(fn: F) -> F:
        _add(_ADV_ESTIMATORS, name, AdvEstimator(name, fn, needs_critic, min_group_size), "register_adv_est")
        return fn

    return wrap


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register the decorated function as the policy loss `name` (verl's `loss_mode`)."""

    def wrap(fn: F) -> F:
        _add(_POLICY_LOSSES, name, fn, "register_policy_loss")
        return fn

    return wrap


def _add(table: dict[str, Any], name: str, entry: Any, decorator: str) -> None:
    if name in table:
        raise ValueError(f"`{decorator}({name!r})` was called twice; each name is registered once, "
                         f"and `{name}` is already taken")
    table[name] = entry


def _load() -> None:
    """Import the module whose decorators fill the registries (torch)."""
    import trainer.algos.core_algos  # noqa: F401


def adv_estimator_names() -> list[str]:
    """Registered estimator names, in registration order."""
    _load()
    return list(_ADV_ESTIMATORS)


def adv_estimator(name: str) -> AdvEstimator:
    """The estimator registered as `name`; an unknown name lists the valid ones."""
    _load()
    if name not in _ADV_ESTIMATORS:
        raise ValueError(f"Unknown `algorithm.adv_estimator={name!r}`. Valid values: "
                         f"{', '.join(_ADV_ESTIMATORS)}.")
    return _ADV_ESTIMATORS[name]


def policy_loss_names() -> list[str]:
    """Registered policy-loss names, in registration order."""
    _load()
    return list(_POLICY_LOSSES)


def policy_loss(name: str) -> Callable[..., Any]:
    """The policy loss registered as `name`; an unknown name lists the valid ones."""
    _load()
    if name not in _POLICY_LOSSES:
        raise ValueError(f"Unknown `actor_rollout_ref.actor.policy_loss.loss_mode={name!r}`. Valid "
                         f"values: {', '.join(_POLICY_LOSSES)}.")
    return _POLICY_LOSSES[name]
