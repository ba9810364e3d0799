"""verl's tool config file (`multi_turn.tool_config_path`), and the tools shipped here.

The file is verl's, unchanged (`examples/sglang_multiturn/config/tool_config/*.yaml`)::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool   # or a dotted path to a `Tool` subclass
        config: {type: native, ...}                   # given to the tool as `config`
        tool_schema: {type: function, function: {name, description, parameters}}

`tool_schema` may be left out for a tool that has a default (:attr:`default_schema`); it is kept
as verl's schema models dump it (:func:`~trainer.agent.tools.loading.check_schema`), which the
loop passes to the chat template (`tools=`). Only `native` tools
exist here: verl's `mcp` type is refused.

Shipped: verl's, ported: :class:`~trainer.agent.tools.gsm8k.Gsm8kTool`,
:class:`~trainer.agent.tools.search.SearchTool` (Search-R1) and
:class:`~trainer.agent.tools.sandbox_fusion.SandboxFusionTool` (its service, or `local`: this
project's sandbox); this project's own:
:class:`~trainer.agent.tools.calculator.CalculatorTool` (`calculator`) and
:class:`~trainer.agent.tools.python_tool.PythonTool` (`python`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.agent.base import Tool
from trainer.agent.tools.calculator import CalculatorTool
from trainer.agent.tools.gsm8k import Gsm8kTool
from trainer.agent.tools.loading import AgentConfigError, check_schema, read_entries, resolve_class
from trainer.agent.tools.python_tool import PythonTool
from trainer.agent.tools.sandbox_fusion import SandboxFusionTool
from trainer.agent.tools.search import SearchTool

__all__ = ["PORTED_TOOLS", "AgentConfigError", "CalculatorTool", "Gsm8kTool", "PythonTool",
           "SandboxFusionTool", "SearchTool", "load_tools"]

PORTED_TOOLS: dict[str, type[Tool]] = {"verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
                                       "verl.tools.search_tool.SearchTool": SearchTool,
                                       "verl.tools.sandbox_fusion_tools.SandboxFusionTool": SandboxFusionTool}
"""verl's tool classes by verl's `class_name`, and their ports here."""

OWN_TOOLS = ("`trainer.agent.tools.calculator.CalculatorTool` (`calculator`), "
             "`trainer.agent.tools.python_tool.PythonTool` (`python`: code run on the trainer's "
             "node in a sandbox; verl's `SandboxFusionTool` with `sandbox_fusion_url: local` runs "
             "there too)")
"""The tools of this project with no verl counterpart, as the refusal of a verl tool names them."""


def _build(entry: Mapping[str, Any], where: str) -> Tool:
    cls = resolve_class(entry["class_name"], PORTED_TOOLS, Tool, where, OWN_TOOLS)
    config = entry.get("config")
    if not isinstance(config, Mapping):
        raise AgentConfigError(f"{where}: needs a `config` mapping with `type: native` (verl's "
                               f"tool files always carry one)")
    if config.get("type") != "native":
        raise AgentConfigError(f"{where}: `config.type` is {config.get('type')!r}; only `native` "
                               f"tools exist here (verl's `mcp` tools are not built): write "
                               f"`type: native` and a native tool's `class_name`")
    schema = entry.get("tool_schema")
    if schema is None:
        schema = getattr(cls, "default_schema", None)
        if schema is None:
            raise AgentConfigError(f"{where}: `{entry['class_name']}` has no default schema; "
                                   f"give its `tool_schema`")
    schema = check_schema(schema, where)
    try:
        return cls(config=dict(config), tool_schema=schema)
    except Exception as e:  # the tool's own refusal of its config, with the entry named
        raise AgentConfigError(f"{where}: {e}") from e


def load_tools(path: str | Path) -> list[Tool]:
    """The tools of verl's tool config file `path`, in file order (verl's
    `initialize_tools_from_config`, `verl/tools/utils/tool_registry.py`). Tool names are unique."""
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(read_entries(path, "tools")):
        where = f"`{path}` tools[{i}] (`{entry['class_name']}`)"
        known = {"class_name", "config", "tool_schema", "mcp"}  # `mcp`: verl's, refused by type
        if set(entry) - known:
            raise AgentConfigError(f"{where}: unknown key(s) {sorted(set(entry) - known)}; an "
                                   f"entry has {sorted(known)}")
        tool = _build(entry, where)
        if tool.name in seen:
            raise AgentConfigError(f"{where}: tool name `{tool.name}` is already used by "
                                   f"tools[{seen[tool.name]}]; names must be unique (the model "
                                   f"calls a tool by its name)")
        seen[tool.name] = i
        tools.append(tool)
    return tools
