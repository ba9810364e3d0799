"""The trainer's configuration: verl-named keys, frozen dataclasses, dotted overrides.

One module per verl section holds that section's keys (type and help line), its defaults in the
YAML file of the same name, and the verl keys of that section accepted only for compatibility or
refused:

- `data` (`data.*`), `actor` (`actor_rollout_ref.*`: model, actor, ref), `rollout`
  (`actor_rollout_ref.rollout.*`), `critic`, `reward` (`reward_model.*`,
  `custom_reward_function.*`), `algorithm`, `trainer` (`trainer.*`);
- `base`: what the sections share (`ConfigError`, the optimizer and FSDP sections);
- `schema`: the whole `Config` and the merged tables; `values`: typed value reading;
  `overrides`: verl's override grammar; `compose`: `--config-path`/`--config-name` files;
  `load`: defaults + overrides -> validated `Config`; `at_default`: verl's keys accepted only at
  verl's default (the table `at_default.yaml`, one group per feature not built here).

`load_config(["data.train_batch_size=64", ...])` applies verl/Hydra-style dotted overrides,
rejects unknown keys (listing the valid ones at that level) and keys verl has that this trainer
does not implement yet, fills the derived values once and validates the whole.
"""

from trainer.config.actor import (
    ActorConfig,
    ActorRolloutRefConfig,
    ModelConfig,
    PolicyLossConfig,
    RefConfig,
    RefFsdpConfig,
)
from trainer.config.algorithm import AlgorithmConfig, KLCtrlConfig
from trainer.config.base import GPUS_ENV, RUN_DIR_ENV, ConfigError, FsdpConfig, OptimConfig
from trainer.config.compose import expand_args, file_overrides, split_config_flags
from trainer.config.critic import CriticConfig, CriticModelConfig
from trainer.config.data import DataConfig
from trainer.config.load import (
    DEFAULTS_DIR,
    DEFAULTS_FILES,
    check_overrides,
    check_run,
    compat_notes,
    config_from_dict,
    config_to_dict,
    describe_keys,
    dump_config,
    load_config,
    load_defaults,
    override_values,
    validate,
)
from trainer.config.overrides import (
    Override,
    _resolve_key,
    apply_overrides,
    is_override,
    parse_override,
)
from trainer.config.reward import CustomRewardConfig, OverlongBufferConfig, RewardModelConfig
from trainer.config.rollout import RolloutConfig, ValKwargs
from trainer.config.schema import (
    ACCEPTED_ONLY_AS,
    COMPAT,
    NOT_SUPPORTED,
    UNSUPPORTED_VALUES,
    Config,
    DerivedConfig,
)
from trainer.config.trainer import TrainerConfig
from trainer.config.values import parse_value, typed_value

__all__ = [
    "ACCEPTED_ONLY_AS", "COMPAT", "DEFAULTS_DIR", "DEFAULTS_FILES", "GPUS_ENV", "NOT_SUPPORTED", "RUN_DIR_ENV",
    "UNSUPPORTED_VALUES", "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "Config",
    "ConfigError", "CriticConfig", "CriticModelConfig", "CustomRewardConfig", "DataConfig",
    "DerivedConfig", "FsdpConfig", "KLCtrlConfig", "ModelConfig", "OptimConfig",
    "OverlongBufferConfig", "Override", "PolicyLossConfig", "RefConfig", "RefFsdpConfig",
    "RewardModelConfig", "RolloutConfig", "TrainerConfig", "ValKwargs", "_resolve_key",
    "apply_overrides", "check_overrides", "check_run", "compat_notes", "config_from_dict", "config_to_dict", "describe_keys",
    "dump_config", "expand_args", "file_overrides", "is_override", "load_config", "load_defaults", "override_values",
    "parse_override", "parse_value", "split_config_flags", "typed_value", "validate",
]
