"""Reading verl's tool and interaction config files: the entries of one list, and a `class_name`
resolved to a class here (verl's `verl/tools/utils/tool_registry.py` and
`verl/interactions/utils/interaction_registry.py` import the dotted path as it is).

A `class_name` under `verl.` names verl's own class: the ones ported here map to their port, any
other is refused by name (verl is not a dependency of the trainer). Any other dotted path is
imported and must subclass the base class the file is for.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["AgentConfigError", "check_config_keys", "check_schema", "function_schema", "read_entries",
           "resolve_class"]


class AgentConfigError(ValueError):
    """A tool or interaction config file (or one of its entries) that cannot be used."""


def read_entries(path: str | Path, list_key: str) -> list[dict[str, Any]]:
    """The entries of `list_key` in the YAML file `path`, interpolations resolved (OmegaConf,
    as verl loads it). Each entry is a mapping with a string `class_name`."""
    path = Path(path)
    if not path.is_file():
        raise AgentConfigError(f"config file `{path}` does not exist: give the path of a YAML "
                               f"file with a `{list_key}:` list")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, OSError, ValueError) as e:
        raise AgentConfigError(f"`{path}` is not a YAML file OmegaConf can read: {e}") from e
    if not isinstance(data, Mapping) or not isinstance(data.get(list_key), list):
        raise AgentConfigError(f"`{path}` has no `{list_key}:` list at its top (found "
                               f"{type(data).__name__}); write `{list_key}:` followed by "
                               f"`- class_name: ...` entries, as verl's example files do")
    entries: list[dict[str, Any]] = data[list_key]
    for i, entry in enumerate(entries):
        where = f"`{path}` {list_key}[{i}]"
        if not isinstance(entry, Mapping):
            raise AgentConfigError(f"{where} is a {type(entry).__name__}, not a mapping with a "
                                   f"`class_name`")
        if not isinstance(entry.get("class_name"), str) or "." not in entry["class_name"]:
            raise AgentConfigError(f"{where} needs `class_name`, a dotted path such as "
                                   f"`module.Class` (found {entry.get('class_name')!r})")
    return entries


def resolve_class(class_name: str, ported: Mapping[str, type], base: type, where: str,
                  own: str = "") -> type:
    """The class `class_name` names: verl's ported classes map to `ported[class_name]`; another
    `verl.*` name is refused (`own`: this project's other classes, for the message); any other
    dotted path is imported and must subclass `base`."""
    if class_name in ported:
        return ported[class_name]
    kind = base.__name__
    if class_name.split(".")[0] == "verl":
        have = ", ".join(f"`{name}` (-> `{cls.__module__}.{cls.__qualname__}`)"
                         for name, cls in ported.items())
        raise AgentConfigError(
            f"{where}: verl's `{class_name}` has no port here; the ported ones are {have}"
            f"{'; this project' + chr(39) + 's own: ' + own if own else ''}. "
            f"Use one of those, or port it as a subclass of "
            f"`trainer.agent.base.{kind}` and give its dotted path as `class_name`")
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AgentConfigError(f"{where}: cannot import module `{module_name}` of `class_name` "
                               f"`{class_name}` ({e}); check the path and that the module is "
                               f"importable where the trainer runs") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise AgentConfigError(f"{where}: module `{module_name}` has no `{attr}` (`class_name` "
                               f"`{class_name}`)")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise AgentConfigError(f"{where}: `{class_name}` is not a subclass of "
                               f"`trainer.agent.base.{kind}`; subclass it (verl's `Base{kind}` "
                               f"methods, the same signatures)")
    return cls


def check_config_keys(owner: str, config: Mapping[str, Any], known: Mapping[str, Any]) -> None:
    """Refuse a key of `config` not in `known` (verl's `type` is always allowed), listing the
    valid ones."""
    unknown = sorted(set(config) - set(known) - {"type"})
    if unknown:
        raise AgentConfigError(f"{owner} config: unknown key(s) {unknown}; the valid keys are "
                               f"{sorted(known)} (and `type`)")


def function_schema(name: str, description: str, parameters: Mapping[str, str]) -> dict[str, Any]:
    """An OpenAI function schema whose parameters are all required strings (`{name: description}`),
    the shape of verl's example tool configs."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {p: {"type": "string", "description": d}
                                      for p, d in parameters.items()},
                       "required": list(parameters)}}}


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """`schema` as given, after the checks verl's `OpenAIFunctionToolSchema` makes
    (`verl/tools/schemas.py`): `type`, `function.name`, `function.description`, and when present
    `function.parameters` with `type`, `properties` and `required`."""
    fix = "write it as verl's `tool_schema: {type: function, function: {name, description, parameters}}`"
    if not isinstance(schema, Mapping) or not isinstance(schema.get("type"), str):
        raise AgentConfigError(f"{where}: `tool_schema` needs a string `type` (`function`); {fix}")
    function = schema.get("function")
    if not isinstance(function, Mapping):
        raise AgentConfigError(f"{where}: `tool_schema` has no `function` mapping; {fix}")
    for key in ("name", "description"):
        if not isinstance(function.get(key), str) or not function[key]:
            raise AgentConfigError(f"{where}: `tool_schema.function.{key}` is missing or not a "
                                   f"non-empty string; {fix}")
    params = function.get("parameters")
    if params is not None:
        if not (isinstance(params, Mapping) and isinstance(params.get("type"), str)
                and isinstance(params.get("properties"), Mapping)
                and isinstance(params.get("required"), list)):
            raise AgentConfigError(f"{where}: `tool_schema.function.parameters` needs `type`, a "
                                   f"`properties` mapping and a `required` list; {fix}")
    return dict(schema)
