"""Loading site profiles (:mod:`hpcrl.profiles` holds their schema): the search path, reading a
profile's ``extends:`` chain and merging it, interpolating ``${env:...}`` and ``${sys:...}``
references, building the frozen :class:`~hpcrl.profiles.SiteProfile` with every key, type and
range checked and each value's source file recorded; and the same checks for a profile read back
from ``job.json`` (:func:`profile_from_dict`) or changed on the command line (:func:`replace_slurm`)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hpcrl.agent.ports import PortError, PortRange, site_port_range
from hpcrl.allocation import AllocationError, RayOverrides
from hpcrl.profiles import (
    _FILE_ONLY_KEYS,
    _REF_RE,
    _REF_START_RE,
    ENV_NAME_RE,
    PROFILE_NAME_RE,
    SIGNAL_NAMES,
    SLURM_NAME_RE,
    SYS_REFS,
    ContainerConfig,
    LoadedProfile,
    ProfileError,
    SiteProfile,
    is_mapping_hint,
    parse_time_seconds,
    parse_version,
    source_of,
    type_name,
)
from hpcrl.resources import data_dir
from hpcrl.suggest import did_you_mean

__all__ = ["check_profile_name", "user_sites_dir", "search_path", "available_profiles", "load_profile", "interpolate", "_sys_value", "profile_from_dict", "container_from_dict", "replace_slurm"]


# ----------------------------------------------------------------------------- search path


def user_sites_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's profile directory: `$XDG_CONFIG_HOME/hpcrl/sites` (`~/.config/hpcrl/sites`)."""
    environ = os.environ if environ is None else environ
    config_home = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME", "~")) / ".config")
    return Path(config_home).expanduser() / "hpcrl" / "sites"


def search_path(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Directories holding profiles, lowest priority first."""
    environ = os.environ if environ is None else environ
    dirs = [data_dir("site_profiles"), user_sites_dir(environ)]
    user = [Path(p).expanduser() for p in environ.get("HPCRL_SITE_PATH", "").split(":") if p]
    dirs.extend(reversed(user))
    return dirs


def available_profiles(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """name -> winning file, for every profile on the search path."""
    found: dict[str, Path] = {}
    for d in search_path(environ):
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                found[p.stem] = p
    return dict(sorted(found.items()))


def _candidates(name: str, environ: Mapping[str, str]) -> list[Path]:
    """Files named `name`, highest priority first."""
    return [d / f"{name}.yaml" for d in reversed(search_path(environ))
            if (d / f"{name}.yaml").is_file()]


# ----------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML ({exc}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a mapping of keys, got "
                           f"{type(data).__name__}")
    return data


def check_profile_name(name: str, requested_by: Path | None) -> None:
    """A profile name, checked before any file is looked for: never a path."""
    if not PROFILE_NAME_RE.match(name):
        where = f"`extends:` of {requested_by}" if requested_by else "the site (`--site`)"
        raise ProfileError(
            f"{where} names {name!r}, not a profile name: names are letters, digits, `.`, `_` "
            "and `-`, starting with a letter or digit (a name, never a path); no file was read. "
            "Fix: pass a name `hpcrl sites` lists, or put the file in `~/.config/hpcrl/sites/` "
            "(or a directory of `HPCRL_SITE_PATH`) and pass its name")


def _raw_chain(name: str, environ: Mapping[str, str]) -> list[tuple[Path, dict[str, Any]]]:
    """[(file, raw dict)] from the root ancestor down to `name`."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    seen: set[Path] = set()
    current: str | None = name
    requested_by: Path | None = None
    while current is not None:
        check_profile_name(current, requested_by)
        candidates = _candidates(current, environ)
        files = [p for p in candidates if p.resolve() not in seen]
        if candidates and not files:
            loop = [*(str(p) for p, _ in chain), str(candidates[0])]
            raise ProfileError(
                f"site profile `{name}` extends itself: {' -> '.join(loop)} (each file's "
                f"`extends:`); remove the `extends: {current}` of {requested_by} or point it "
                "at another profile")
        if not files:
            where = f" (extended by {requested_by})" if requested_by else ""
            known = ", ".join(available_profiles(environ)) or "none"
            raise ProfileError(
                f"no site profile `{current}`{did_you_mean(current, available_profiles(environ))}{where}; "
                f"known profiles: {known}. Add "
                f"`{current}.yaml` to `~/.config/hpcrl/sites/` or a directory in "
                "`HPCRL_SITE_PATH`")
        path = files[0]
        seen.add(path.resolve())
        raw = _read_yaml(path)
        _check_keys(raw, SiteProfile, path, "", top=True)
        chain.append((path, raw))
        parent = raw.get("extends")
        if parent is not None and not isinstance(parent, str):
            raise ProfileError(f"{path}: key `extends` must be a profile name (string), got "
                               f"{parent!r}")
        if len(chain) > 32:
            raise ProfileError(f"{path}: `extends` chain longer than 32; is there a cycle?")
        requested_by, current = path, parent
    return list(reversed(chain))


def _valid_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "name"]


def _check_keys(raw: Mapping[str, Any], cls: type, path: Path, prefix: str,
                top: bool = False) -> None:
    valid = _valid_keys(cls) + (list(_FILE_ONLY_KEYS) if top else [])
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in valid:
            raise ProfileError(
                f"{path}: unknown key `{dotted}`{did_you_mean(key, valid, '`' + prefix + '{}`')}; "
                f"valid keys{' in `' + prefix[:-1] + '`' if prefix else ''}: {', '.join(valid)}")
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub) and isinstance(value, Mapping):
            _check_keys(value, typing.cast(type, sub), path, f"{dotted}.")


def _merge(base: dict[str, Any], over: Mapping[str, Any], cls: type, path: Path,
           prov: dict[str, str], prefix: str = "") -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    out = dict(base)
    for key, value in over.items():
        if key in _FILE_ONLY_KEYS and not prefix:
            continue
        dotted = f"{prefix}{key}"
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            out[key] = _merge(dict(out.get(key) or {}), value, typing.cast(type, hint), path,
                              prov, f"{dotted}.")
        elif is_mapping_hint(hint) and isinstance(value, Mapping):
            merged = dict(out.get(key) or {})
            for k, v in value.items():
                if v is None:
                    merged.pop(k, None)
                    prov.pop(f"{dotted}.{k}", None)
                else:
                    merged[k] = v
                    prov[f"{dotted}.{k}"] = str(path)
            out[key] = merged
        else:
            out[key] = value
            for stale in [k for k in prov if k.startswith(f"{dotted}.")]:
                del prov[stale]
            prov[dotted] = str(path)
    return out


def load_profile(name: str, environ: Mapping[str, str] | None = None) -> LoadedProfile:
    """Load profile `name` from the search path, resolved, checked, with provenance."""
    environ = dict(os.environ if environ is None else environ)
    chain = _raw_chain(name, environ)
    prov: dict[str, str] = {}
    merged: dict[str, Any] = {}
    for path, raw in chain:
        merged = _merge(merged, raw, SiteProfile, path, prov)
    merged = _interpolate(merged, environ, prov, "")
    merged["name"] = name
    profile = _build(SiteProfile, merged, prov, "")
    _check_profile(profile, prov, str(chain[-1][0]))
    return LoadedProfile(profile, types.MappingProxyType(prov), tuple(str(p) for p, _ in chain))


# ----------------------------------------------------------------------------- interpolation


def _sys_value(name: str) -> str:
    if name == "prefix":
        return sys.prefix
    if name == "base_prefix":
        return sys.base_prefix
    if name == "executable":
        return sys.executable
    return str(Path(__file__).resolve().parent.parent)  # source_root


def interpolate(text: str, environ: Mapping[str, str], where: str = "value") -> str:
    """Replace `${env:NAME}`, `${env:NAME:-default}` and `${sys:NAME}` in `text`."""

    def repl(m: re.Match[str]) -> str:
        ns, name, default = m.group(1), m.group(2), m.group(3)
        if ns == "sys":
            if name not in SYS_REFS:
                raise ProfileError(f"{where}: unknown reference `${{sys:{name}}}`; valid: "
                                   + ", ".join(f"`${{sys:{n}}}`" for n in SYS_REFS))
            return _sys_value(name)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ProfileError(
            f"{where}: environment variable `{name}` is not set (referenced as "
            f"`${{env:{name}}}`); set it, or give a default as `${{env:{name}:-VALUE}}`")

    out = _REF_RE.sub(repl, text)
    leftover = _REF_START_RE.search(_REF_RE.sub("", text))
    if leftover:
        raise ProfileError(f"{where}: malformed reference in {text!r}; write `${{env:NAME}}`, "
                           "`${env:NAME:-default}` or `${sys:prefix}`")
    return out


def _interpolate(value: Any, environ: Mapping[str, str], prov: Mapping[str, str],
                 dotted: str) -> Any:
    if isinstance(value, str):
        where = f"{prov.get(dotted, '<profile>')}: key `{dotted}`"
        return interpolate(value, environ, where)
    if isinstance(value, Mapping):
        return {k: _interpolate(v, environ, prov, f"{dotted}.{k}" if dotted else k)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, environ, prov, dotted) for v in value]
    return value


# ----------------------------------------------------------------------------- building


def _type_error(prov: Mapping[str, str], dotted: str, hint: Any, value: Any,
                extra: str = "") -> ProfileError:
    src = prov.get(dotted) or next((v for k, v in prov.items() if k.startswith(dotted + ".")),
                                   "<profile>")
    return ProfileError(f"{src}: key `{dotted}` must be a {type_name(hint)}, got {value!r}"
                        f"{extra}")


def _convert(hint: Any, value: Any, prov: Mapping[str, str], dotted: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner, value, prov, dotted)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise _type_error(prov, dotted, hint, value)
        return _build(typing.cast(type, hint), value, prov, f"{dotted}.")
    if origin is tuple:
        if not isinstance(value, list):
            raise _type_error(prov, dotted, hint, value)
        inner = typing.get_args(hint)[0]
        return tuple(_convert(inner, v, prov, f"{dotted}[{i}]") for i, v in enumerate(value))
    if is_mapping_hint(hint):
        if not isinstance(value, Mapping):
            raise _type_error(prov, dotted, hint, value)
        out: dict[str, str] = {}
        for k, v in value.items():
            if not isinstance(k, str) or not ENV_NAME_RE.match(k):
                raise ProfileError(f"{prov.get(f'{dotted}.{k}', '<profile>')}: key `{dotted}` "
                                   f"holds {k!r}, not a valid variable name "
                                   "(letters, digits, `_`, not starting with a digit)")
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise _type_error(prov, f"{dotted}.{k}", str, v,
                                  " (quote it in YAML, e.g. \"true\")")
            out[k] = str(v)
        return types.MappingProxyType(out)
    if hint is bool:
        if not isinstance(value, bool):
            raise _type_error(prov, dotted, hint, value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(prov, dotted, hint, value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(prov, dotted, hint, value)
        return float(value)
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _type_error(prov, dotted, hint, value)
        return str(value)
    raise TypeError(f"unsupported field type {hint!r}")  # schema bug, not user input


def _build(cls: type, raw: Mapping[str, Any], prov: Mapping[str, str], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        dotted = f"{prefix}{f.name}"
        value = _convert(hints[f.name], raw[f.name], prov, dotted)
        choices = f.metadata.get("choices") or ()
        if choices and value not in choices:
            raise ProfileError(f"{prov.get(dotted, '<profile>')}: key `{dotted}` must be one of "
                               f"{', '.join(choices)}; got {value!r}")
        kwargs[f.name] = value
    unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        key = sorted(unknown)[0]
        src = source_of(prov, re.sub(r"\[\d+\]", "", prefix.rstrip(".")))
        raise ProfileError(f"{src}: unknown key `{prefix}{key}`"
                           f"{did_you_mean(key, _valid_keys(cls), '`' + prefix + '{}`')}; "
                           f"valid keys: {', '.join(_valid_keys(cls))}")
    return cls(**kwargs)


def _out_of_bounds(obj: Any, prefix: str = "") -> tuple[str, str] | None:
    """The first number of `obj` (a profile or section) that is not finite or not within its
    field's bounds: (dotted key, what is wrong and the fix)."""
    for f in dataclasses.fields(obj):
        value, dotted = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found = _out_of_bounds(value, f"{dotted}.")
            if found:
                return found
            continue
        bounds = f.metadata.get("bounds")
        if bounds is None or value is None or isinstance(value, bool):
            continue
        low, high = bounds
        if not math.isfinite(value) or not low <= value <= high:
            return dotted, (f"must be a number from {low:g} to {high:g} ({f.metadata['rule']}), "
                            f"got {value!r}. Fix: set `{dotted}` within that range in the "
                            "profile (or on the command line)")
    return None


def _check_profile(p: SiteProfile, prov: Mapping[str, str], own_file: str) -> None:
    """Rules spanning several keys (errors name the file of the key, else the profile's own)."""

    def err(key: str, msg: str) -> ProfileError:
        src = source_of(prov, re.sub(r"\[\d+\]", "", key))
        return ProfileError(f"{own_file if src == 'default' else src}: key `{key}` {msg}")

    bad = _out_of_bounds(p)
    if bad:
        raise err(*bad)
    c = p.container
    if c.runtime != "none" and not c.image:
        raise err("container.image", f"is missing: runtime `{c.runtime}` needs an image; set "
                  "`container.image` (or `container.runtime: none`)")
    if c.shm_size and c.ipc_host:
        raise err("container.ipc_host", "cannot be true together with `container.shm_size`; "
                  "drop one of them")
    for i, name in enumerate(p.secrets):
        if not ENV_NAME_RE.match(name):
            raise err(f"secrets[{i}]", f"holds {name!r}, not a variable name")
    sizes = {k: getattr(p.ray, k) for k in ("num_cpus", "num_gpus", "memory",
                                            "object_store_memory")}
    for key in sizes:  # each alone first, so that the error names the key's own file
        try:
            RayOverrides.from_profile({key: sizes[key]})
        except AllocationError as exc:
            raise err(f"ray.{key}", str(exc).split("` ", 1)[-1]) from None
    try:
        RayOverrides.from_profile(sizes)
    except AllocationError as exc:
        raise err("ray.object_store_memory", str(exc).split("` ", 1)[-1]) from None
    for i, rule in enumerate(p.ray.version_env):
        if rule.min_version is None and rule.below_version is None:
            raise err("ray.version_env", f"rule {i} needs `min_version` or `below_version`")
    if not PROFILE_NAME_RE.match(p.name):
        raise ProfileError(f"{own_file}: profile name {p.name!r} must be letters, digits, `.`, "
                           "`_` or `-` (rename the file)")
    if p.slurm.signal.upper().removeprefix("SIG") not in SIGNAL_NAMES:
        raise err("slurm.signal", f"must be a signal name such as `USR1` or `TERM`, got "
                  f"{p.slurm.signal!r}")
    if p.agent.stop_signal.upper().removeprefix("SIG") not in SIGNAL_NAMES:
        raise err("agent.stop_signal", f"must be a signal name such as `USR2` or `TERM`, got "
                  f"{p.agent.stop_signal!r}")
    for key in ("partition", "account", "qos"):
        value = getattr(p.slurm, key)
        if value is not None and not SLURM_NAME_RE.match(str(value)):
            raise err(f"slurm.{key}", f"must be Slurm names (letters, digits, `_`, `.`, `-`; "
                      f"several joined by `,`), got {value!r}")
    if p.slurm.max_requeues < 0:
        raise err("slurm.max_requeues", f"must be 0 or more, got {p.slurm.max_requeues}")
    if p.slurm.nodes < 1:
        raise err("slurm.nodes", f"must be at least 1, got {p.slurm.nodes}")
    if p.slurm.min_nodes is not None and not 1 <= p.slurm.min_nodes <= p.slurm.nodes:
        raise err("slurm.min_nodes", f"must be between 1 and `slurm.nodes` ({p.slurm.nodes}), "
                  f"got {p.slurm.min_nodes}")
    if p.python is not None and not os.path.isabs(p.python):
        raise err("python", f"must be an absolute path (jobs may start with an empty PATH), "
                  f"got {p.python!r}")
    try:
        limit_s = parse_time_seconds(p.slurm.time)
    except ProfileError as exc:
        raise err("slurm.time", str(exc)) from None
    if limit_s and p.slurm.signal_lead_s >= limit_s:  # `0`: no limit
        raise err("slurm.signal_lead_s", f"is {p.slurm.signal_lead_s} s, not less than the time "
                  f"limit `slurm.time` {p.slurm.time!r} ({limit_s} s): the warning would come "
                  "at the start and the job would checkpoint and requeue itself until "
                  "`slurm.max_requeues`. Fix: a lead well below the time limit (e.g. "
                  f"{max(1, limit_s // 10)}), or a longer `slurm.time`")
    try:
        site_port_range(p.ray.port_base)
    except PortError as exc:
        raise err("ray.port_base", f"is {p.ray.port_base}: {exc}. Fix: a `ray.port_base` from "
                  f"1024 to {65536 - PortRange().block_size} (e.g. 20000), or null") from None
    for i, rule in enumerate(p.ray.version_env):
        for v in (rule.min_version, rule.below_version):
            try:
                parse_version(v or "0")
            except ProfileError as exc:
                raise err(f"ray.version_env[{i}]", str(exc)) from None



def profile_from_dict(data: Mapping[str, Any]) -> SiteProfile:
    """Rebuild a resolved profile from :func:`profile_to_dict` output (no interpolation)."""
    prov = {"": "<job.json>"}
    profile = _build(SiteProfile, data, prov, "")
    _check_profile(profile, prov, "<job.json>")
    return typing.cast(SiteProfile, profile)


def container_from_dict(data: Mapping[str, Any]) -> ContainerConfig:
    """The `container` section of a resolved profile (:func:`profile_to_dict` output) alone."""
    return typing.cast(ContainerConfig, _build(ContainerConfig, data, {"": "<job.json>"}, "container"))


def replace_slurm(p: SiteProfile, **changes: Any) -> SiteProfile:
    """`p` with some Slurm settings changed (command-line overrides)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    changed = dataclasses.replace(p, slurm=dataclasses.replace(p.slurm, **changes))
    prov = {f"slurm.{k}": "the command line" for k in changes}
    _check_profile(changed, prov, "the command line")
    return changed
