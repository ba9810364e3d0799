"""Reading verl's tool and interaction config files: the entries of one list, and a `class_name`
resolved to a class here (verl's `verl/tools/utils/tool_registry.py` and
`verl/interactions/utils/interaction_registry.py` import the dotted path as it is).

A `class_name` under `verl.` names verl's own class: the ones ported here map to their port, any
other is refused by name (verl is not a dependency of the trainer). Any other dotted path is
imported and must subclass the base class the file is for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
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


# verl's tool schema models (`verl/tools/schemas.py`, verl 0.9.1): each field, in the models'
# order (`model_dump` writes fields in that order, whatever the order given), its parser, and
# whether it is `required`, `optional` (a default) or `nullable` (`X | None = None`). Keys outside
# a model are dropped (pydantic's `extra="ignore"`).
_Field = tuple[str, Callable[[Any, str], Any], str]


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _SchemaError(f"`{where}` is {value!r}; verl's schema models need a string there")
    return value


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise _SchemaError(f"`{where}` is {value!r}; verl's schema models need a list of strings there")
    return [_str(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _type(value: Any, where: str) -> str | list[str]:
    """`type: str | list[str]` (a union such as `[integer, number]`)."""
    return value if isinstance(value, str) else _str_list(value, where)


def _any_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _SchemaError(f"`{where}` is {value!r}; verl's schema models need a list there")
    return list(value)


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _bool(value: Any, where: str) -> bool:
    """pydantic's lax `bool`: booleans, 0/1, and its true/false words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _SchemaError(f"`{where}` is {value!r}; verl's schema models need a boolean there")


def _model(fields: tuple[_Field, ...], model: str) -> Callable[[Any, str], dict[str, Any]]:
    """A parser of one verl schema model: its fields in the model's order, a field left out or
    given as None is left out (`exclude_unset=True, exclude_none=True`), other keys dropped."""
    def parse(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise _SchemaError(f"`{where}` is {value!r}; verl's `{model}` needs a mapping there")
        out: dict[str, Any] = {}
        for key, field_parser, kind in fields:
            if key not in value:
                if kind == "required":
                    raise _SchemaError(f"`{where}.{key}` is missing; verl's `{model}` requires it")
                continue
            if value[key] is None:
                if kind != "nullable":
                    raise _SchemaError(f"`{where}.{key}` is null; verl's `{model}` needs a value there")
                continue  # exclude_none
            out[key] = field_parser(value[key], f"{where}.{key}")
        return out
    return parse


_property = _model((("type", _type, "required"), ("description", _str, "nullable"),
                    ("enum", _any_list, "nullable")),
                   "OpenAIFunctionPropertySchema")


def _properties(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _SchemaError(f"`{where}` is {value!r}; verl's schema models need a mapping from "
                           f"parameter names to their schemas there")
    return {name: _property(prop, f"{where}.{name}") for name, prop in value.items()}


_parameters = _model((("type", _str, "required"), ("properties", _properties, "required"),
                      ("required", _str_list, "optional")), "OpenAIFunctionParametersSchema")
_function = _model((("name", _str, "required"), ("description", _str, "required"),
                    ("parameters", _parameters, "optional"), ("strict", _bool, "optional")),
                   "OpenAIFunctionSchema")
_tool = _model((("type", _str, "required"), ("function", _function, "required")), "OpenAIFunctionToolSchema")


class _SchemaError(ValueError):
    pass


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """`schema` as verl renders it into the prompt: parsed by `OpenAIFunctionToolSchema`
    (`verl/tools/schemas.py`; `verl/tools/tool_registry.py`, `load_all_tools`) and dumped with
    `model_dump(exclude_unset=True, exclude_none=True)` (`ToolAgentLoop.__init__`,
    `verl/experimental/agent_loop/tool_agent_loop.py`; `RLHFDataset.__init__`,
    `verl/utils/dataset/rl_dataset.py`). So only the models' keys are kept, in the models'
    order (`type`, `function`; `name`, `description`, `parameters`, `strict`; `type`,
    `properties`, `required`; a property's `type`, `description`, `enum`): a property's `items`,
    `minimum`, `default` or nested `properties` are dropped, and defaults are not filled in (a
    missing `required` stays missing). A name or description that is empty is refused here
    (verl accepts it). Idempotent."""
    fix = "write it as verl's `tool_schema: {type: function, function: {name, description, parameters}}`"
    try:
        out = _tool(schema, "tool_schema")
    except _SchemaError as e:
        raise AgentConfigError(f"{where}: {e}; {fix}") from e
    for key in ("name", "description"):
        if not out["function"][key]:
            raise AgentConfigError(f"{where}: `tool_schema.function.{key}` is empty; give it a "
                                   f"non-empty string; {fix}")
    return out
