"""The whole config: one section per verl section, the derived values, and the tables of verl
keys each section accepts without acting on them or refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config import actor, algorithm, async_training, critic, data, reward, rollout, trainer
from trainer.config.actor import ActorRolloutRefConfig
from trainer.config.algorithm import AlgorithmConfig
from trainer.config.async_training import AsyncTrainingConfig, RolloutPoolConfig
from trainer.config.base import h
from trainer.config.critic import CriticConfig
from trainer.config.data import DataConfig
from trainer.config.reward import CustomRewardConfig, RewardModelConfig
from trainer.config.trainer import TrainerConfig


@dataclass(frozen=True)
class DerivedConfig:
    """Values computed once from the others (not settable)."""

    use_critic: bool = h("a critic is trained (the estimator needs one, e.g. gae)")
    use_reference: bool = h("a reference model is needed (KL in reward or KL loss)")
    world_size: int = h("nnodes x n_gpus_per_node")


@dataclass(frozen=True)
class Config:
    data: DataConfig = h("training and validation data")
    actor_rollout_ref: ActorRolloutRefConfig = h("actor, rollout and reference")
    critic: CriticConfig = h("critic (value model)")
    reward_model: RewardModelConfig = h("how responses are scored (rule-based)")
    custom_reward_function: CustomRewardConfig = h("user reward function")
    algorithm: AlgorithmConfig = h("advantage and KL settings")
    trainer: TrainerConfig = h("loop, logging, checkpoints")
    global_profiler: dict[str, Any] = h("verl's profiler settings (compatibility only, see COMPAT)")
    async_training: AsyncTrainingConfig = h("verl's asynchronous recipes: queue, staleness, weight sync")
    rollout: RolloutPoolConfig = h("the rollout pool of verl's separate deployment (`hybrid_engine=false`)")
    derived: DerivedConfig = h("computed values")

    @property
    def tokenizer_source(self) -> tuple[str, bool]:
        """(path, trust_remote_code) of the trainer's tokenizer: `data.tokenizer`, else the actor
        model's; remote code when `data.trust_remote_code` (verl's key for it) or the model's is set."""
        arr = self.actor_rollout_ref
        return (self.data.tokenizer or arr.model.path,
                self.data.trust_remote_code or arr.model.trust_remote_code)


_SECTIONS = (data, actor, rollout, critic, reward, algorithm, trainer, async_training)


def _merged(table: str) -> dict[str, Any]:
    return {k: v for section in _SECTIONS for k, v in getattr(section, table, {}).items()}


#: Keys of verl's config that this trainer does not implement; setting one is an error.
NOT_SUPPORTED: dict[str, str] = _merged("NOT_SUPPORTED")
#: Keys accepted for verl compatibility that change nothing here, and why nothing is lost;
#: `--print-config` and `--list-keys` mark them. Every other key acts or is refused.
COMPAT: dict[str, str] = _merged("COMPAT")
#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = _merged("ACCEPTED_ONLY_AS")
#: Newer verl spellings of a key, read as this trainer's key.
ALIASES: dict[str, str] = _merged("ALIASES")
#: Values of a key that name a feature this trainer does not have: one clear error each.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = _merged("UNSUPPORTED_VALUES")
#: The fix each refusal of `UNSUPPORTED_VALUES` names, by key.
UNSUPPORTED_VALUE_FIX: dict[str, str] = _merged("UNSUPPORTED_VALUE_FIX")
