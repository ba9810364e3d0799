"""The KL between the policy and the reference: verl's estimators (`algorithm.kl_penalty`,
`actor.kl_loss_type`), the penalty in the reward (`algorithm.use_kl_in_reward`) and its
coefficient's controllers (`algorithm.kl_ctrl`)."""

from __future__ import annotations

import torch

from trainer.algos import registry
from trainer.algos.masked import masked_mean

__all__ = ["KL_PENALTIES", "AdaptiveKLController", "FixedKLController", "apply_kl_penalty", "kl_penalty",
           "make_kl_controller"]

KL_PENALTIES = registry.KL_ESTIMATORS


def _kl_forward(diff: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return diff
    if name == "abs":
        return diff.abs()
    if name in ("mse", "k2"):
        return 0.5 * diff.square()
    kl = torch.clamp(-diff, min=-20.0, max=20.0)  # low_var_kl / k3
    return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    ``kl``/``k1``: ``logprob - ref``; ``abs``: its absolute value; ``mse``/``k2``: half its
    square; ``low_var_kl``/``k3``: ``exp(ref - logprob) - (ref - logprob) - 1``, with the log
    ratio clamped to [-20, 20] and the result to [-10, 10] as verl does.

    A name ending in ``+`` (``k1+``, ``low_var_kl+``, ``k3+``, ...) is verl's straight-through
    variant: the value of the named estimator, the gradient of ``k2`` (an unbiased KL gradient):
    ``k2 - sg[k2] + sg[named]`` (verl ``kl_penalty``; its documentation, docs/algo/ppo.md). At
    verl b178a3c the value half passes the name with its ``+`` to ``kl_penalty_forward``, which
    knows no such name and raises NotImplementedError; here the value is the named estimator's.
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(
            f"Unknown KL estimator `{kl_penalty!r}` (used by `algorithm.kl_penalty` and "
            f"`actor_rollout_ref.actor.kl_loss_type`). Valid values: {', '.join(KL_PENALTIES)}."
        )
    diff = logprob - ref_logprob
    forward = _kl_forward(diff, kl_penalty.rstrip("+"))
    if not kl_penalty.endswith("+"):
        return forward
    backward = 0.5 * diff.square()
    return backward - backward.detach() + forward.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL in the reward: ``rewards = scores - kl_coef * kl`` on the response tokens.

    Returns ``(token_level_rewards, current_kl)`` where ``current_kl`` is the batch mean of the
    per-sequence mean KL: feed it to the controller's ``update(current_kl, n_steps=batch)``.
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    return rewards, float(current_kl)


class FixedKLController:
    """A KL coefficient that never changes (verl ``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (verl ``algorithm.kl_ctrl.type=adaptive``).

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"The adaptive KL controller needs `kl_ctrl.target_kl` > 0 and `kl_ctrl.horizon` "
                f"> 0, received target_kl={target_kl}, horizon={horizon}. Fix: set both, e.g. "
                "target_kl=0.1 horizon=10000."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by verl's ``algorithm.kl_ctrl.type``."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown `algorithm.kl_ctrl.type={type!r}`. Valid values: fixed, adaptive.")

