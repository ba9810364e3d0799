"""verl keys accepted only at verl's default value, grouped by the feature a value other than the
default would ask for. The table is data, `trainer/config/at_default.yaml`: each group's
`feature` (named when another value is refused), `note` (why verl's default changes nothing
here, printed once per group given) and `keys` with verl's defaults (the defaults of verl 0.9.1
and of the verl commit followed before, b178a3cd; `{any_of: [...]}` where they differ).

A key here that is also a key of this trainer (`data.seed`, `reward_model.enable`, ...) is a key
whose verl default means "not set" (null): at that value this trainer's default applies; any
other value acts as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TABLE_FILE = Path(__file__).with_name("at_default.yaml")


@dataclass(frozen=True)
class Group:
    name: str
    feature: str
    """What a value other than verl's default asks for (refused, named)."""
    note: str
    """Why verl's default changes nothing here."""
    defaults: dict[str, tuple[Any, ...]]
    """Each key and the values accepted (verl's defaults)."""


def _load(path: Path = TABLE_FILE) -> dict[str, Group]:
    table = yaml.safe_load(path.read_text())
    return {name: Group(name, g["feature"], g["note"],
                        {key: tuple(v["any_of"]) if isinstance(v, dict) and "any_of" in v else (v,)
                         for key, v in g["keys"].items()})
            for name, g in table.items()}


GROUPS: dict[str, Group] = _load()
#: Each key of the table -> its group.
AT_DEFAULT: dict[str, Group] = {key: g for g in GROUPS.values() for key in g.defaults}


def same_value(given: Any, default: Any) -> bool:
    """`given` is `default` as verl's config compares them: numbers by value (an int default
    takes `1.0`), never a bool for a number, lists and mappings item by item."""
    if isinstance(default, bool) or isinstance(given, bool):
        return isinstance(given, bool) and isinstance(default, bool) and given == default
    if isinstance(default, (int, float)) and isinstance(given, (int, float)):
        return float(given) == float(default)
    if isinstance(default, list) and isinstance(given, (list, tuple)):
        return len(given) == len(default) and all(same_value(g, d) for g, d in zip(given, default, strict=True))
    if isinstance(default, dict) and isinstance(given, dict):
        return given.keys() == default.keys() and all(same_value(given[k], default[k]) for k in default)
    return type(given) is type(default) and given == default


def is_default(key: str, value: Any) -> bool:
    """Whether `value` is one of verl's defaults of table key `key`."""
    return any(same_value(value, d) for d in AT_DEFAULT[key].defaults[key])


def shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def refusal(key: str, item: str, why: str | None = None) -> str:
    """The error for table key `key` set away from verl's default by the override `item`;
    `why`: the feature as the section's `NOT_SUPPORTED` names it, when it does."""
    group = AT_DEFAULT[key]
    allowed = " or ".join(f"`{key}={shown(d)}`" for d in group.defaults[key])
    return (f"`{item}`: {why or group.feature} is not supported; only verl's default {allowed} is "
            f"accepted ({group.note}). Fix: remove the override")


def notes(keys: list[str]) -> list[str]:
    """One note per group of the table keys given at verl's default."""
    by_group: dict[str, list[str]] = {}
    for key in dict.fromkeys(keys):
        by_group.setdefault(AT_DEFAULT[key].name, []).append(key)
    lines = []
    for name, given in by_group.items():
        more = f" (and {len(given) - 1} more of its group)" if len(given) > 1 else ""
        lines.append(f"`{given[0]}`{more} is accepted at verl's default and changes nothing here: "
                     f"{GROUPS[name].note}; the numbers are the same")
    return lines
