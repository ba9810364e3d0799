"""`--config-path` / `--config-name` as verl's Hydra entry takes them: a user's YAML file that
names verl's `ppo_trainer` in its `defaults` list and sets keys over it.

The file's keys are read as overrides applied before the command line's (Hydra composes the
file first, then applies the command line's overrides over it), each checked like any
override: unknown keys, refused features and accepted-only-at-default values are refused
naming the file. The composition rules followed:

- `defaults`: `ppo_trainer` is this trainer's defaults (verl's, key for key); `_self_` places
  the file's own keys (at the end when absent, Hydra 1.1's rule); another name is a YAML file
  beside this one, composed the same way; `ppo_megatron_trainer` is Megatron-LM (refused);
  `override hydra/...` entries only configure Hydra's logging and are skipped.
- `hydra:` (search path, output directories) configures Hydra itself, not the trainer: skipped.
- `_target_` keys name verl's config dataclasses: skipped; so are OmegaConf's mandatory values
  (`???`: not given, as Hydra leaves them missing), so that verl's whole generated config reads.
- A key the command line also sets is left out of the file's overrides (the command line wins,
  as in Hydra, and a value the command line replaces is not refused).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.config.base import ConfigError
from trainer.config.overrides import Override, is_override

#: verl's own top-level configs: `ppo_trainer` is what the defaults here are.
VERL_BASE = "ppo_trainer"
_MEGATRON = "ppo_megatron_trainer"
_SELF = "_self_"
#: The flags of verl's Hydra entry and their short forms.
_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}


def split_config_flags(args: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """(`--config-path`, `--config-name`, the other words) of a trainer command line; each flag
    as `--flag=value` or `--flag value`, as Hydra reads them."""
    found: dict[str, str] = {}
    rest: list[str] = []
    words = iter(args)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in _FLAGS:
            if not eq:
                value = next(words, "")
            found[_FLAGS[flag]] = value.strip("'\"")
        else:
            rest.append(word)
    return found.get("path"), found.get("name"), rest


def expand_args(args: Sequence[str]) -> list[str | Override]:
    """The overrides of a trainer command line (`python -m trainer`'s words after the module):
    the config file's, when `--config-name` is given, then the command line's own."""
    path, name, rest = split_config_flags(args)
    cli = [a for a in rest if is_override(a)]
    return [*file_overrides(path, name, cli), *cli]


def file_overrides(config_path: str | None, config_name: str | None,
                   cli: Sequence[str] = ()) -> list[Override]:
    """The keys set by the config file `config_name` in `config_path` (or by the files its
    `defaults` list names), as overrides in composition order, less those `cli` sets."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError(f"`--config-path={config_path}` without `--config-name`: name the YAML "
                              "file in that directory with `--config-name=<file>`")
        return []
    stem = config_name[:-5] if config_name.endswith(".yaml") else config_name
    if stem == _MEGATRON:
        raise ConfigError(f"`--config-name={config_name}` selects verl's Megatron-LM config: "
                          "Megatron-LM training is not supported (FSDP2 only). Fix: use verl's "
                          f"`{VERL_BASE}` (the default: drop `--config-name`)")
    if stem == VERL_BASE and (config_path is None or not _file(config_path, stem).is_file()):
        return []  # verl's own ppo_trainer: the defaults here
    if config_path is None:
        raise ConfigError(f"`--config-name={config_name}` without `--config-path`: give the directory "
                          f"of `{stem}.yaml` with `--config-path=<dir>`")
    leaves = _compose(Path(os.path.expanduser(config_path)).absolute(), stem, ())
    given = {_cli_key(a) for a in cli}
    return [o for o in leaves if o.key not in given]


def _file(config_path: str | Path, stem: str) -> Path:
    return Path(os.path.expanduser(str(config_path))) / f"{stem}.yaml"


def _cli_key(item: str) -> str:
    return item.lstrip("~+").split("=", 1)[0]


def _compose(directory: Path, stem: str, seen: tuple[str, ...]) -> list[Override]:
    path = directory / f"{stem}.yaml"
    if stem in seen:
        raise ConfigError(f"`{path}`: its `defaults` list includes itself again (through "
                          f"{' -> '.join(seen)}); remove the cycle")
    if not path.is_file():
        raise ConfigError(f"config file `{path}` does not exist (from `--config-path` and "
                          "`--config-name`, or a `defaults` entry); give the directory that holds "
                          "it and the file's name")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file `{path}` is not valid YAML ({err})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file `{path}` must be a mapping of keys, like verl's configs")
    defaults = tree.pop("defaults", [])
    tree.pop("hydra", None)  # Hydra's own settings (search path, output dirs): not the trainer's
    own = list(_leaves(tree, "", path))
    if not isinstance(defaults, list):
        raise ConfigError(f"`{path}`: `defaults` must be a list, e.g. `[{VERL_BASE}, {_SELF}]`")
    if _SELF not in defaults:
        defaults = [*defaults, _SELF]
    out: list[Override] = []
    for entry in defaults:
        if entry == _SELF:
            out += own
        elif isinstance(entry, dict) and all(str(k).startswith("override hydra/") for k in entry):
            continue  # Hydra's logging and launcher choices
        elif isinstance(entry, str) and entry in (VERL_BASE, f"{VERL_BASE}.yaml"):
            continue  # verl's defaults: the defaults here
        elif isinstance(entry, str) and entry.removesuffix(".yaml") == _MEGATRON:
            raise ConfigError(f"`{path}`: `defaults` names verl's `{_MEGATRON}`: Megatron-LM training "
                              f"is not supported (FSDP2 only). Fix: name `{VERL_BASE}`")
        elif isinstance(entry, str):
            out += _compose(directory, entry.removesuffix(".yaml"), (*seen, stem))
        else:
            raise ConfigError(f"`{path}`: the `defaults` entry {entry!r} selects a config group, which "
                              f"this trainer does not have; name `{VERL_BASE}` and set the keys in "
                              "the file")
    return out


def _leaves(node: dict[str, Any], prefix: str, path: Path) -> list[Override]:
    out: list[Override] = []
    for key, value in node.items():
        if key == "_target_":
            continue  # verl's dataclass of the section: no value of the config
        dotted = f"{prefix}{key}"
        if value == "???":
            continue  # OmegaConf's mandatory value: not given here (Hydra leaves it missing)
        if isinstance(value, dict):  # merged into the defaults, as Hydra merges: `{}` sets nothing
            out += _leaves(value, dotted + ".", path)
        else:
            out.append(Override(item=f"{dotted}={_text(value)} (in {path})", key=dotted, op="set",
                                value=value, text=value if isinstance(value, str) and "${" in value else None))
    return out


def _text(value: Any) -> str:
    """A YAML value as an override would spell it (for messages and the accepted-default checks)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
