"""Reading values: override text and YAML defaults checked against a key's declared type."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from trainer.config.base import ConfigError


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_mapping(tp: Any) -> bool:
    """A free-form mapping (`dict[str, Any]`): any sub-keys, values as the grammar reads them
    (verl's `profiler`, `apply_chat_template_kwargs`)."""
    return typing.get_origin(tp) is dict


def _split_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def with_article(name: str) -> str:
    """`name` after "a" or "an", as it is spoken: "an int", "a float", "an int or null"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = " | ".join(repr(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        name = f"list of {_type_name(typing.get_args(inner)[0])}"
    elif _is_mapping(inner):
        name = "mapping (any sub-keys)"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _split_list(text: str) -> list[str]:
    """`[a, 'b', "c,d"]` -> ['a', 'b', 'c,d'] (commas inside quotes kept)."""
    items, current, quote = [], "", ""
    for ch in text[1:-1]:
        if quote:
            current += ch
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            current, quote = current + ch, ch
        elif ch == ",":
            items.append(current)
            current = ""
        else:
            current += ch
    if current.strip() or items:
        items.append(current)
    return [_unquote(i) for i in items]


_NULLS = ("null", "None", "~", "none", "NULL")
_TRUE = ("true", "True", "TRUE", "yes", "on")
_FALSE = ("false", "False", "FALSE", "no", "off")


def parse_value(text: str, tp: Any) -> Any:
    """Parse override text into a value of type `tp`; raise ValueError naming the rule."""
    inner, optional = _split_optional(tp)
    if text.strip() in _NULLS:
        if optional:
            return None
        raise ValueError("null is not allowed here")
    origin = typing.get_origin(inner)
    if origin is list:
        stripped = _unquote(text)
        parts = _split_list(stripped) if stripped.startswith("[") and stripped.endswith("]") else [stripped]
        return [parse_value(p, typing.get_args(inner)[0]) for p in parts]
    text = _unquote(text)
    if origin is Literal:
        choices = typing.get_args(inner)
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}")
        return text
    if inner is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError("must be true or false")
    if inner is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("not a whole number") from None
    if inner is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("not a number") from None
    if inner is str:
        return text
    raise TypeError(f"unsupported config type {inner!r}")


def _coerce_default(value: Any, tp: Any, key: str) -> Any:
    """Check a value coming from YAML against `tp` (ints widen to float, str to [str])."""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"`{key}` is null but must be a {_type_name(tp)}")
    if typing.get_origin(inner) is list:
        seq = value if isinstance(value, list) else [value]
        return [_coerce_default(v, typing.get_args(inner)[0], key) for v in seq]
    if _is_mapping(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}`={value!r} must be a {_type_name(tp)}")
        return value
    if typing.get_origin(inner) is Literal:
        if value not in typing.get_args(inner):
            raise ConfigError(f"`{key}`={value!r} must be a {_type_name(tp)}")
        return value
    if inner is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, inner) or (inner is int and isinstance(value, bool)):
        raise ConfigError(f"`{key}`={value!r} must be a {_type_name(tp)}")
    return value



def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def typed_value(value: Any, text: str | None, tp: Any) -> Any:
    """A value read by the grammar (`text` is its unquoted text, when it has one) as type `tp`;
    raise ValueError naming the rule. `tp` Any (a sub-key of a free-form mapping): the value as
    the grammar reads it."""
    if tp is Any:
        return value
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError("null is not allowed here")
    if _is_mapping(inner):
        if not isinstance(value, dict):
            raise ValueError("a mapping is expected: `key={a: 1}`, or set one entry with `key.a=1`")
        return value
    if typing.get_origin(inner) is list:
        seq = value if isinstance(value, list) else [value]
        return [typed_value(v, text if len(seq) == 1 and not isinstance(value, list) else None,
                            typing.get_args(inner)[0]) for v in seq]
    if isinstance(value, dict):
        raise ValueError("got a dict")
    if isinstance(value, list):
        raise ValueError("got a list")
    if isinstance(value, str):
        return value if inner is str else parse_value(value, tp)
    raw = text.strip() if text is not None and not _quoted(text) else _scalar_text(value)
    return parse_value(raw, tp)


def _quoted(text: str) -> bool:
    text = text.strip()
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""



def _valid_keys(cls: type) -> str:
    return ", ".join(f"`{k}`" for k in _hints(cls))

