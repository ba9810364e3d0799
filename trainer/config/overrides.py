"""Overrides in verl's grammar (Hydra's override grammar): parsing them, checking each key
against the schema and the tables of keys verl has and this trainer does not, and applying them
to the defaults' tree."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hpcrl.suggest import did_you_mean
from trainer.config import at_default
from trainer.config.base import ConfigError
from trainer.config.reward import ALIASES as _REWARD_ALIASES
from trainer.config.reward import REWARD_MODEL_WORKER as _REWARD_MODEL_WORKER
from trainer.config.schema import (
    ACCEPTED_ONLY_AS,
    ALIASES,
    NOT_SUPPORTED,
    UNSUPPORTED_VALUE_FIX,
    UNSUPPORTED_VALUES,
    Config,
)
from trainer.config.values import (
    _hints,
    _is_mapping,
    _is_section,
    _type_name,
    _unquote,
    _valid_keys,
    parse_value,
    typed_value,
    with_article,
)


def _not_supported(key: str) -> str | None:
    for prefix, why in NOT_SUPPORTED.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    if ".megatron." in f".{key}." and not key.startswith("reward_model."):
        return "Megatron-LM training (FSDP2 only)"
    if key.startswith("reward_model."):
        try:
            _resolve_key(key)
        except ConfigError:
            return _REWARD_MODEL_WORKER
    return None


def _unsupported_value(key: str, text: str, item: str | None = None) -> str | None:
    """The refusal of a value this trainer does not build, naming `item` (the override as given,
    with the file it came from) when there is one."""
    feature = UNSUPPORTED_VALUES.get(key, {}).get(_unquote(text))
    if feature is None:
        return None
    fix = UNSUPPORTED_VALUE_FIX.get(key)
    given = item if item and item != f"{key}={text}" else f"{key}={_unquote(text)}"
    return (f"`{given}`: {feature} is not supported; this trainer runs FSDP2 training "
            f"with HF or vLLM rollout" + (f". Fix: {fix}" if fix else ""))



def _resolve_key(key: str) -> tuple[list[str], Any]:
    """Walk `a.b.c` through the dataclasses; return the path and the leaf type."""
    cls: Any = Config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        hints = _hints(cls)
        where = f"`{'.'.join(parts[:depth])}`" if depth else "the top level"
        if part not in hints or (cls is Config and part == "derived"):
            valid = _valid_keys(cls).replace("`derived`, ", "").replace(", `derived`", "")
            names = [n for n in _hints(cls) if not (cls is Config and n == "derived")]
            prefix = ".".join(parts[:depth]) + "." if depth else ""
            rest = "." + ".".join(parts[depth + 1:]) if depth < len(parts) - 1 else ""
            raise ConfigError(
                f"unknown key `{key}`{did_you_mean(part, names, '`' + prefix + '{}' + rest + '`')}: "
                f"`{part}` is not a key of {where}; valid keys there: {valid}"
            )
        cls = hints[part]
        if _is_mapping(cls) and depth < len(parts) - 1:
            return parts, Any  # a sub-key of a free-form mapping
        if _is_section(cls) and depth == len(parts) - 1:
            raise ConfigError(
                f"`{key}` is a section, not a value; set one of its keys: {_valid_keys(cls)}"
            )
        if not _is_section(cls) and depth < len(parts) - 1:
            raise ConfigError(f"unknown key `{key}`: `{'.'.join(parts[: depth + 1])}` is a value, not a section")
    return parts, cls


def _check_accepted_only_as(key: str, text: str, item: str | None = None) -> bool:
    """True when `key` is a verl key we accept only with its default value and `text` is it;
    `item`: the override as given (a config file's names the file)."""
    if key not in ACCEPTED_ONLY_AS:
        return False
    allowed = ACCEPTED_ONLY_AS[key]
    tp = type(allowed) if allowed is not None else str | None
    try:
        value = parse_value(text, tp)
    except ValueError:
        value = text
    if value == allowed:
        return True
    shown = "null" if allowed is None else str(allowed).lower() if isinstance(allowed, bool) else str(allowed)
    why = _not_supported(key)
    raise ConfigError(
        f"`{item or f'{key}={text}'}` is not supported yet{f' ({why})' if why else ''}: only "
        f"`{key}={shown}` is accepted; remove the override"
    )


def _not_supported_message(key: str, item: str, why: str) -> str:
    if why.startswith("is derived"):
        return f"`{key}` {why}"
    if why.startswith("deprecated"):
        return f"`{key}` is not supported: {why}"
    if why == _REWARD_MODEL_WORKER:
        return f"`{key}`: {why}; remove the override `{item}`"
    detail = f" ({why})" if why else ""
    return f"`{key}` is not supported yet{detail}; remove the override `{item}`"


@dataclass(frozen=True)
class Override:
    """One command-line override in verl's grammar (Hydra's override grammar, parsed by Hydra)."""

    item: str
    """The override as given."""
    key: str
    """The dotted key."""
    op: Literal["set", "add", "force_add", "delete"]
    """`key=v`, `+key=v`, `++key=v`, `~key` / `~key=v`."""
    value: Any
    """The value as Hydra's grammar reads it (scalars, lists, dicts, None); None for `~key`."""
    text: str | None
    """The value text as given (None for `~key`): unquoted scalars are read from it with this
    trainer's types, so `trainer.experiment_name=007` stays the string `007`."""

    @property
    def interpolated(self) -> bool:
        """The value names other keys (`${a.b}`), resolved against the final config."""
        return self.text is not None and "${" in self.text


_OPS = {"CHANGE": "set", "ADD": "add", "FORCE_ADD": "force_add", "DEL": "delete"}


def _hydra_parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse_override(item: str, parser: Any = None) -> Override:
    """Read one override in verl's grammar: `key=value`, `+key=value` (add), `++key=value`
    (force add), `~key` or `~key=value` (delete), `key=null`, lists `[a,'b,c']`, dicts `{k: v}`,
    quoted strings and `${a.b}` interpolations."""
    from hydra.errors import HydraException

    if "=" not in item and not item.startswith("~"):
        raise ConfigError(
            f"override `{item}` has no `=`; write overrides as `dotted.key=value`, "
            "e.g. `data.train_batch_size=64` (or `~dotted.key` to restore a key's default)"
        )
    try:
        o = (parser or _hydra_parser()).parse_override(item)
    except HydraException as err:
        detail = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"override `{item}` does not parse ({detail}); write `dotted.key=value` and quote "
            "values with spaces or special characters: `key='a b'`"
        ) from None
    if o.is_sweep_override():
        raise ConfigError(
            f"override `{item}` is a sweep in Hydra's grammar (several values); a run takes one "
            "value: write a list as `key=[a,b]`, or quote a string that holds a comma: `key='a,b'`"
        )
    if o.package is not None:
        raise ConfigError(f"override `{item}`: `@package` overrides select config groups, "
                          "which this trainer does not have; write `dotted.key=value`")
    key = o.key_or_group
    text = item.split("=", 1)[1] if "=" in item else None
    return Override(item=item, key=key, op=_OPS[o.type.name], value=o.value() if text is not None else None,
                    text=text)



def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the nested dict `tree` with the overrides applied in order (the last one
    of a key wins, as in Hydra: only its value is checked). `+key`/`++key` set the key like `key=value` (verl scripts add
    with `+` the keys verl's own yaml lacks; here every key has a default); `~key` restores the
    default. Interpolations (`${a.b}`, `${oc.env:NAME}`) are resolved by OmegaConf against the
    config after every override, then typed like any value."""
    return _apply(tree, overrides)[0]


def _apply(defaults: dict[str, Any], overrides: Sequence[str | Override]) -> tuple[dict[str, Any], list[str]]:
    """:func:`apply_overrides`, and the keys the overrides set, in order. An item is an override's
    text, or an `Override` already read (a config file's key)."""
    import copy

    tree = copy.deepcopy(defaults)
    parser = _hydra_parser() if any(isinstance(i, str) for i in overrides) else None
    deferred: list[tuple[Override, list[str], Any]] = []
    keys: list[str] = []
    given_read = [given if isinstance(given, Override) else parse_override(given, parser) for given in overrides]
    read = [_aliased(o) for o in given_read]
    _refuse_two_spellings(given_read, read)
    last = {o.key: i for i, o in enumerate(read) if o.op != "delete"}  # the value each key ends with
    for i, o in enumerate(read):
        item, text = o.item, _text_of(o)
        if o.op == "delete" and _not_supported(o.key) is not None:
            continue  # removing a key this trainer does not have leaves nothing to remove
        if last.get(o.key, i) > i:  # a later override of the key replaces this value (as in Hydra):
            if _not_supported(o.key) is None and o.key not in ACCEPTED_ONLY_AS and o.key not in at_default.AT_DEFAULT:
                _resolve_key(o.key)  # only the key is checked
            continue
        if _at_verl_default(o):
            continue
        if o.op != "delete" and _check_accepted_only_as(o.key, text, item):
            continue
        why = _not_supported(o.key)
        if why is not None:
            raise ConfigError(_not_supported_message(o.key, item, why))
        refused = None if o.op == "delete" else _unsupported_value(o.key, text, item)
        if refused is not None:
            raise ConfigError(refused)
        parts, tp = _resolve_key(o.key)
        keys.append(o.key)
        node = tree
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"`{item}`: `{'.'.join(parts[:depth + 1])}` holds a value, not "
                                  "a mapping; set the mapping itself, e.g. `key={a: 1}`")
        deferred = [d for d in deferred if d[0].key != o.key]
        if o.op == "delete":
            if o.text is not None and node.get(parts[-1]) != _override_value(o, tp):
                raise ConfigError(f"`{item}` deletes `{o.key}` only while it equals the given "
                                  f"value, but it is {node.get(parts[-1])!r}; write `~{o.key}`")
            found, default = _lookup(defaults, o.key)
            if found:
                node[parts[-1]] = copy.deepcopy(default)
            else:  # a sub-key of a free-form mapping that its default lacks
                node.pop(parts[-1], None)
        elif o.interpolated:
            node[parts[-1]] = o.value
            deferred.append((o, parts, tp))
        else:
            node[parts[-1]] = _override_value(o, tp)
    if deferred:
        _resolve_interpolations(tree, deferred)
    return tree, keys


_REWARD_KEYS = frozenset(_REWARD_ALIASES.values())


def _refuse_two_spellings(given: Sequence[Override], read: Sequence[Override]) -> None:
    """Refuse a key set to two different values under two spellings (verl's older key and its
    newer name in verl 0.9.1's `reward.*`, e.g. `reward_model.enable` and
    `reward.reward_model.enable`): which one verl takes depends on its migration
    (`migrate_legacy_reward_impl`), so neither is guessed. A spelling at verl's default (null:
    not set) does not conflict. (Other renamed keys keep verl's own rule: verl's whole config
    holds `lora_alpha` and `lora.alpha` with different defaults.)"""
    first: dict[str, Override] = {}
    for g, o in zip(given, read, strict=True):
        if o.key not in _REWARD_KEYS or o.op == "delete" or o.value is None or (o.key in at_default.AT_DEFAULT and at_default.is_default(o.key, o.value)):
            continue
        seen = first.setdefault(o.key, g)
        if seen.key != g.key and _text_of(seen) != _text_of(g):
            raise ConfigError(
                f"`{seen.item}` and `{g.item}` both set `{o.key}` (one of them by its newer verl name), "
                "to different values. Fix: keep one of them")


def _at_verl_default(o: Override) -> bool:
    """True when `o` sets a key of the at-default table (:mod:`trainer.config.at_default`) to
    verl's default (a value, or verl's own interpolation of the key), or deletes it: accepted,
    with a note. Another value of a key this trainer
    has acts as usual (False); of any other key, it is refused naming the feature."""
    if o.key not in at_default.AT_DEFAULT:
        return False
    try:
        _resolve_key(o.key)
        own = True
    except ConfigError:
        own = False
    if o.op == "delete":
        return not own  # a key of this trainer goes back to its default as usual
    if at_default.is_default(o.key, o.value):
        return True
    if own:
        return False
    why = _not_supported(o.key)
    if why and (why.startswith(("is derived", "deprecated")) or why == _REWARD_MODEL_WORKER):
        raise ConfigError(_not_supported_message(o.key, o.item, why))  # the section's own message
    raise ConfigError(at_default.refusal(o.key, o.item, why or None))


def at_default_keys(overrides: Sequence[str | Override]) -> list[str]:
    """The keys among `overrides` set to verl's default of the at-default table (their notes)."""
    parser = _hydra_parser() if any(isinstance(i, str) for i in overrides) else None
    read = [_aliased(i if isinstance(i, Override) else parse_override(i, parser))
            for i in overrides if is_override(i)]
    return [o.key for o in read if o.key in at_default.AT_DEFAULT and o.op != "delete"
            and at_default.is_default(o.key, o.value)]


def _text_of(o: Override) -> str:
    """The value's text as given; for an `Override` read from a file, as an override spells it."""
    if o.text is not None:
        return o.text
    if o.value is None:
        return "null" if o.op != "delete" else ""
    return str(o.value).lower() if isinstance(o.value, bool) else str(o.value)


def _aliased(o: Override) -> Override:
    """`o` with a newer verl spelling of a key (`ALIASES`) read as this trainer's key."""
    key = ALIASES.get(o.key)
    return o if key is None else dataclasses.replace(o, key=key)


def is_override(arg: str | Override) -> bool:
    """Whether a command-line word is a trainer override (`key=value`, `~key`), not a flag; an
    `Override` read from a config file is one."""
    if isinstance(arg, Override):
        return True
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


@contextlib.contextmanager
def _reading_env(job_env: Mapping[str, str] | None) -> Iterator[None]:
    """The variables of `job_env` this process lacks, set while the overrides are read."""
    added = {k: v for k, v in (job_env or {}).items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _lookup(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(whether dotted `key` is in `tree`, its value)."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _override_value(o: Override, tp: Any) -> Any:
    try:
        return typed_value(o.value, o.text, tp)
    except ValueError as err:
        raise ConfigError(f"`{o.item}`: {err}; expected {with_article(_type_name(tp))}") from None


def _resolve_interpolations(tree: dict[str, Any], deferred: list[tuple[Override, list[str], Any]]) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    conf = OmegaConf.create(tree)
    resolved = []
    for o, parts, tp in deferred:
        try:
            value = OmegaConf.select(conf, o.key, throw_on_resolution_failure=True)
        except OmegaConfBaseException as err:
            detail = str(err).strip().splitlines()[0]
            raise ConfigError(
                f"`{o.item}`: the interpolation cannot be resolved ({detail}); `${{...}}` must "
                "name a key of the final config, e.g. `${data.max_prompt_length}`, or a "
                "variable, `${oc.env:NAME}`"
            ) from None
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        resolved.append((parts, _override_value(dataclasses.replace(o, value=value, text=None), tp)))
    for parts, value in resolved:
        node = tree
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value

