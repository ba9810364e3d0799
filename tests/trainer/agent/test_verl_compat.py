"""hpcrl against verl 0.9.1's own code, in the venv where verl is installed (`make verl-venv`,
`.venv-verl`; the Makefile's verl stage runs this file there): tool schemas normalised as verl's
pydantic models dump them. Tests that need verl skip where it is not importable, except under
CI=true with HPCRL_REQUIRE_VERL=1 (the verl stage), where they fail."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest

from trainer.agent.tools.loading import AgentConfigError, check_schema

REQUIRE_VERL = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
                and os.environ.get("HPCRL_REQUIRE_VERL") == "1")


def require_verl() -> None:
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin and "verl_standin" not in spec.origin:
        return
    reason = "verl 0.9.1 is not importable in this environment (`make verl-venv` builds one)"
    if REQUIRE_VERL:
        pytest.fail(f"{reason}, but CI=true and HPCRL_REQUIRE_VERL=1 require it", pytrace=False)
    pytest.skip(reason)


# ----------------------------------------------------------------------------- tool schemas


def _fn(parameters: Any = None, **function: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "f", "description": "d", **function}
    if parameters is not None:
        out["parameters"] = parameters
    return {"type": "function", "function": out}


def _params(properties: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **rest}


#: Schemas verl accepts: keys outside its models, its defaults, nulls, unions, orders.
ACCEPTED = [
    _fn(_params({"xs": {"type": "array", "items": {"type": "integer"}, "description": "values"}}, required=["xs"])),
    _fn(_params({"n": {"description": "count", "type": "integer", "minimum": 0, "maximum": 9, "default": 3}})),
    _fn(_params({"mode": {"type": "string", "enum": ["a", "b", None], "default": "a"}}, required=[])),
    _fn(_params({"u": {"type": ["integer", "number"], "description": None, "enum": None}})),
    _fn(_params({"enum_any": {"type": "integer", "enum": [1, 2.5, True, {"k": 1}, [1]]}})),
    _fn(_params({"obj": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}},
                required=["obj"], additionalProperties=False)),
    {"function": {"parameters": {"properties": {"b": {"type": "string"}, "a": {"type": "string"}},
                                 "type": "object"}, "description": "reordered", "name": "g"},
     "type": "function", "id": 3},
    _fn(),  # no parameters: none filled in
    _fn(_params({}), strict=True),
    _fn(_params({}), strict=0),
    _fn(_params({}), strict="yes"),
    _fn(_params({}), strict="Off"),
    _fn(_params({}), extra_key={"x": 1}),
]

#: Schemas verl's models refuse.
REFUSED = [
    {"function": _fn()["function"]},
    {"type": "function"},
    {"type": "function", "function": "f"},
    {"type": 3, "function": _fn()["function"]},
    _fn(_params({"a": {"description": "no type"}})),
    _fn(_params({"a": {"type": 3}})),
    _fn(_params({"a": {"type": ["string", 3]}})),
    _fn(_params({"a": {"type": "string", "description": 5}})),
    _fn(_params({"a": {"type": "string", "enum": "ab"}})),
    _fn(_params({}, required=None)),
    _fn(_params({}, required=[1])),
    _fn({"type": "object"}),
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": None}},
    _fn(_params({}), strict="maybe"),
    _fn(_params({}), strict=2),
    _fn(_params({}), strict=None),
    {"type": "function", "function": {"name": "f", "description": None}},
]


@pytest.mark.parametrize("schema", ACCEPTED, ids=lambda s: json.dumps(s)[:60])
def test_schemas_are_normalised_as_verls_models_dump_them(schema: dict[str, Any]) -> None:
    """hpcrl's normalised schema is verl's `model_dump(exclude_unset=True, exclude_none=True)`
    of it (`ToolAgentLoop.__init__`), key order included (the chat template renders it)."""
    require_verl()
    from verl.tools.schemas import OpenAIFunctionToolSchema

    verls = OpenAIFunctionToolSchema.model_validate(schema).model_dump(exclude_unset=True, exclude_none=True)
    ours = check_schema(schema, "test")
    assert json.dumps(ours) == json.dumps(verls)
    assert check_schema(ours, "test") == ours  # idempotent: the loop normalises again


@pytest.mark.parametrize("schema", REFUSED, ids=lambda s: json.dumps(s)[:60])
def test_schemas_verls_models_refuse_are_refused(schema: dict[str, Any]) -> None:
    require_verl()
    from pydantic import ValidationError
    from verl.tools.schemas import OpenAIFunctionToolSchema

    with pytest.raises(ValidationError):
        OpenAIFunctionToolSchema.model_validate(schema)
    with pytest.raises(AgentConfigError, match=r"test: `tool_schema.*; write it as verl's"):
        check_schema(schema, "test")
