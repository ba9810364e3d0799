"""Site profiles: one YAML file per cluster, resolved into frozen dataclasses.

A profile (``site_profiles/<name>.yaml``) describes one cluster as data: Slurm defaults, the
container runtime and its flags, the network policy, the Ray settings and the environment applied
on every node. This module loads profiles, follows their ``extends:`` chains, interpolates
``${env:NAME}`` / ``${env:NAME:-default}`` / ``${sys:prefix}`` references from the submitting
environment, checks every key and type, and records which file each value came from.

Search path, lowest priority first (a later directory wins for the same name):

1. the profiles shipped with hpcrl (``site_profiles/``),
2. ``$XDG_CONFIG_HOME/hpcrl/sites/`` (default ``~/.config/hpcrl/sites/``),
3. the directories of ``$HPCRL_SITE_PATH`` (``:``-separated; the first entry wins).

Merging along ``extends:``: mappings (sections, ``env``) merge key by key, lists and scalars
replace; ``env: {NAME: null}`` removes an inherited variable. A profile may extend a profile of
the same name found lower in the search path (a user file refining a shipped one).

Interfaces other parts rely on:

- :func:`load_profile` -> :class:`SiteProfile`; :func:`profile_to_dict` /
  :func:`profile_from_dict` convert the fully resolved profile to and from plain data (this is
  what ``job.json`` carries, see :mod:`hpcrl.jobspec`).
- ``profile.ray.version_env`` holds rules choosing environment variables by Ray version at run
  time on the node (the login node may not have Ray): :func:`env_for_ray_version` applies them.
- Secrets are names only (``secrets:``); their values are read from the submitting environment
  by the launcher and never written into a profile, script, ``job.json`` or log.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcrl.agent.ports import PortError, PortRange, site_port_range
from hpcrl.allocation import AllocationError, RayOverrides
from hpcrl.resources import data_dir
from hpcrl.runtimes import NAMES as RUNTIME_NAMES
from hpcrl.suggest import did_you_mean

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REF_RE = re.compile(r"\$\{(env|sys):([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_REF_START_RE = re.compile(r"\$\{(env|sys):")
SYS_REFS = ("prefix", "base_prefix", "executable", "source_root")
PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Partition, account and QOS names (`--partition=a,b` lists several).
SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+(?:,[A-Za-z0-9_.-]+)*$")
SIGNAL_NAMES = frozenset(("HUP", "INT", "QUIT", "USR1", "USR2", "TERM", "ALRM", "CONT", "URG",
                          "XCPU", "XFSZ", "VTALRM", "PROF", "WINCH", "PWR"))


MAX_NODES = 100_000
MAX_CPUS = 100_000
MAX_DEVICES = 1024


class ProfileError(ValueError):
    """A site profile is missing, malformed, or holds a value that breaks a rule."""


def _f(help: str, default: Any = dataclasses.MISSING, *, choices: tuple[str, ...] = (),
       factory: Any = dataclasses.MISSING, bounds: tuple[float, float] | None = None,
       rule: str = "") -> Any:
    """A profile field: its help line, and for a number its `bounds` (inclusive) and the
    `rule` they come from (every number has bounds: `test_every_number_has_bounds`)."""
    meta = {"help": help, "choices": choices, "bounds": bounds, "rule": rule}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _frozen_map() -> Mapping[str, str]:
    return types.MappingProxyType({})


@dataclass(frozen=True)
class SlurmConfig:
    """Slurm defaults for the site (each may be overridden on the command line)."""

    @property
    def node_range(self) -> str | None:
        """`MIN-MAX` when the job may resume on fewer nodes than `nodes` (`min_nodes`)."""
        low = self.min_nodes
        return f"{low}-{self.nodes}" if low is not None and low < self.nodes else None

    partition: str | None = _f("partition (`#SBATCH --partition`); null: the cluster default", None)
    account: str | None = _f("account to charge (`--account`)", None)
    qos: str | None = _f("quality of service (`--qos`)", None)
    nodes: int = _f("number of nodes", 1, bounds=(1, MAX_NODES), rule="a Slurm node count")
    min_nodes: int | None = _f(
        "fewest nodes the job may resume on: after a node died, a requeued job that finds no "
        "spare node free asks for fewer nodes (not below this) and the trainer resumes on "
        "them (hpcrl sets `trainer.nnodes` from the nodes granted); null: always `nodes`", None,
        bounds=(1, MAX_NODES), rule="a Slurm node count")
    exclude_slow: bool = _f(
        "when the trainer names a node slow (`trainer.watchdog.slow_factor`) and the job can go on "
        "without it (a spare node is idle, or `min_nodes` allows fewer), checkpoint and requeue the "
        "job with the node in its `ExcNodeList` (`hpcrl submit --exclude-slow`); false: name it and "
        "go on", False)
    gpus_per_node: int = _f("GPUs per node (`--gpus-per-node`); 0: none requested", 0,
                            bounds=(0, MAX_DEVICES), rule="GPUs of one node")
    gpu_memory_gib: float = _f("memory of one GPU in GiB: the device the memory plan of "
                               "`hpcrl submit` checks each phase against (with `gpus_per_node` > 0)", 80.0,
                               bounds=(1, 65536), rule="GiB of one GPU")
    memory_plan: bool = _f("refuse before queueing a configuration the memory plan says cannot fit; "
                           "false: print the refusal as a warning and submit (as `--force` does)", True)
    cpus_per_task: int | None = _f("CPUs for the one task per node (`--cpus-per-task`)", None,
                                   bounds=(1, MAX_CPUS), rule="CPUs of one node")
    mem: str | None = _f("memory per node (`--mem`, e.g. `200G`, `0` for all)", None)
    time: str = _f("time limit (`--time`, `MM`, `HH:MM:SS` or `D-HH:MM:SS`)", "01:00:00")
    signal: str = _f("signal sent before the time limit (`--signal=B:SIG@lead`)", "USR1")
    signal_lead_s: int = _f("seconds before the time limit the signal is sent (less than "
                            "`time`)", 300, bounds=(1, 65535),
                            rule="Slurm's `--signal` lead is 0 to 65535 s, and 0 gives no warning")
    exclusive: bool = _f("ask for whole nodes (`--exclusive`)", False)
    job_name: str = _f("job name prefix (`--job-name`)", "hpcrl")
    max_requeues: int = _f("how many times the job may requeue itself", 3,
                           bounds=(0, 10_000), rule="a count of requeues")
    extra_sbatch: tuple[str, ...] = _f("extra `#SBATCH` options, e.g. `--constraint=mi300x`",
                                       factory=tuple)
    setup: tuple[str, ...] = _f("shell lines run by the batch script before the node agents "
                                "start; the job starts with only `SLURM_*` and the secrets "
                                "(`--export`), so source what modules need first (e.g. "
                                "`source /etc/profile`, `module load rocm`)", factory=tuple)


@dataclass(frozen=True)
class ContainerConfig:
    """How each node runs the Ray processes and the payload."""

    runtime: str = _f("container runtime (one module each in `hpcrl.runtimes`)", "none",
                      choices=RUNTIME_NAMES)
    binary: str | None = _f("path of the runtime executable; null: the runtime's name on PATH",
                            None)
    image: str | None = _f("image: registry ref or local tag (podman/docker), `.sif` path "
                           "(apptainer), `.sqsh` path or container name (enroot)", None)
    devices: tuple[str, ...] = _f("host devices passed in (`--device`; apptainer shares /dev)",
                                  factory=tuple)
    binds: tuple[str, ...] = _f("bind mounts `SRC[:DST[:OPTS]]`", factory=tuple)
    workdir: str | None = _f("working directory inside the container; null: the run directory",
                             None)
    shm_size: str | None = _f("size of /dev/shm (`--shm-size`, podman/docker)", None)
    cap_add: tuple[str, ...] = _f("capabilities to add (`--cap-add`, podman/docker)",
                                  factory=tuple)
    security_opt: tuple[str, ...] = _f("security options (`--security-opt`, podman/docker)",
                                       factory=tuple)
    group_add: tuple[str, ...] = _f("extra groups (`--group-add`, podman/docker); rootless podman "
                                    "gets `keep-groups` instead (the user's own host groups)",
                                    factory=tuple)
    network_host: bool = _f("use the host network (`--network=host`; apptainer always does)",
                            True)
    pid_host: bool = _f("share the host PID namespace (`--pid=host`): a Ray driver finds its node's "
                        "raylet by listing processes, so Ray and payload containers must see each "
                        "other", True)
    ipc_host: bool = _f("share the host IPC namespace (`--ipc=host`; not with `shm_size`)", False)
    privileged: bool = _f("`--privileged` (podman/docker)", False)
    gpu: str = _f("GPUs under apptainer: `nv` (`--nv`), `rocm` (the image's own ROCm, the "
                  "devices bound: `--bind /dev/kfd --bind /dev/dri`), `rocm-host` (`--rocm`: the "
                  "host's ROCm libraries over the image's; only when both versions match)", "none",
                  choices=("none", "rocm", "rocm-host", "nv"))
    cleanenv: bool = _f("apptainer `--cleanenv`: only the variables hpcrl passes arrive", True)
    python: str | None = _f("Python inside the container for the payload; null: the same "
                            "absolute path as the node agent's Python", None)
    extra_flags: tuple[str, ...] = _f("extra flags for `run`/`exec`, placed before the image",
                                      factory=tuple)
    recipe: str | None = _f("recipe `hpcrl image build` uses: a file in hpcrl's `containers/`, "
                            "a path, or (apptainer) `docker-archive://FILE.tar` / `docker://REF`",
                            None)
    build_args: Mapping[str, str] = _f("`--build-arg NAME=VALUE` for `hpcrl image build`",
                                       factory=_frozen_map)


@dataclass(frozen=True)
class NetworkConfig:
    """Which address the Ray head advertises."""

    interface: str | None = _f("network interface to take the head address from (e.g. `ib0`); "
                               "null: the address of the host name", None)
    family: str = _f("address family", "auto", choices=("auto", "ipv4", "ipv6"))


@dataclass(frozen=True)
class VersionEnvRule:
    """Environment variables that apply only for some Ray versions (decided on the node)."""

    env: Mapping[str, str] = _f("variables to set when the rule matches", factory=_frozen_map)
    min_version: str | None = _f("applies when Ray's version is at least this", None)
    below_version: str | None = _f("applies when Ray's version is below this", None)


@dataclass(frozen=True)
class RayConfig:
    """How the per-job Ray cluster is started."""

    dashboard: bool = _f("start the Ray dashboard", False)
    dashboard_host: str = _f("address the dashboard listens on (loopback unless opted in)",
                             "127.0.0.1")
    port_base: int | None = _f("first of the ports given to Ray (64 blocks of 256 from it, below "
                               "65536); null: chosen per job", None, bounds=(1024, 65535),
                               rule="ports below 1024 are privileged")
    version_env: tuple[VersionEnvRule, ...] = _f("variables chosen by Ray version at run time",
                                                 factory=tuple)
    num_cpus: int | None = _f("CPUs Ray offers on each node (`ray start --num-cpus`); null: what "
                              "Slurm granted the job there (`SLURM_CPUS_ON_NODE`, the cgroup's "
                              "cpuset and CPU quota), never the whole node", None,
                              bounds=(0, MAX_CPUS), rule="CPUs of one node")
    num_gpus: int | None = _f("GPUs Ray offers on each node (`--num-gpus`); null: the job's GPUs "
                              "there (`SLURM_STEP_GPUS`/`SLURM_JOB_GPUS`, `SLURM_GPUS_ON_NODE`, "
                              "`CUDA_`/`ROCR_`/`HIP_VISIBLE_DEVICES`)", None,
                              bounds=(0, MAX_DEVICES), rule="GPUs of one node")
    memory: str | None = _f("memory Ray may use on each node, object store included (e.g. "
                            "`64G`; K/M/G/T are powers of 1024, a bare number is bytes); null: "
                            "the job's memory there (`SLURM_MEM_PER_NODE`/`_PER_CPU`/`_PER_GPU`, "
                            "the cgroup's `memory.max`, the node's available memory)", None)
    object_store_memory: str | None = _f("Ray's object store on each node, part of `memory` "
                                         "(`--object-store-memory`, e.g. `20G`); null: 30% of "
                                         "the memory, at most 200 GB", None)


@dataclass(frozen=True)
class AgentConfig:
    """How the node agents wait for one another and end the job."""

    join_timeout_s: float = _f("seconds the nodes may take to publish, arrive and join Ray", 300.0,
                               bounds=(1, 86_400), rule="a wait of up to a day")
    grace_s: float = _f("seconds between SIGTERM and SIGKILL when the job ends", 10.0,
                        bounds=(0, 3600), rule="a wait of up to an hour")
    heartbeat_timeout_s: float = _f("seconds of silence after which a node counts as dead", 15.0,
                                    bounds=(5, 86_400),
                                    rule="more than two heartbeats (one every 2 s), up to a day")
    stop_signal: str = _f("signal the head's agent sends the payload to ask for a checkpoint and "
                          "a stop when the time limit nears (the trainer takes `USR2` or `TERM`)",
                          "USR2")


@dataclass(frozen=True)
class DoctorConfig:
    """What `hpcrl doctor` expects of the site."""

    allreduce_floor_gbps: float = _f("bus bandwidth (GB/s, nccl-tests' busbw) an all-reduce of "
                                     "64 MiB between nodes must reach, one rank per node", 0.0,
                                     bounds=(0, 10_000), rule="GB/s of one link")


@dataclass(frozen=True)
class SiteProfile:
    """One cluster, fully resolved."""

    name: str = _f("profile name (the file name without `.yaml`)")
    description: str = _f("one line shown by `hpcrl sites`", "")
    scheduler: str = _f("`slurm`, or `local` to run on this machine", "slurm",
                        choices=("slurm", "local"))
    run_root: str = _f("shared directory under which each job gets its run directory",
                       "~/hpcrl-runs")
    python: str | None = _f("absolute path of the Python running `hpcrl.agent` on each node; "
                            "null: the interpreter that renders", None)
    slurm: SlurmConfig = _f("Slurm defaults", factory=SlurmConfig)
    container: ContainerConfig = _f("container runtime", factory=ContainerConfig)
    network: NetworkConfig = _f("network policy", factory=NetworkConfig)
    ray: RayConfig = _f("Ray settings", factory=RayConfig)
    agent: AgentConfig = _f("node agent timeouts and the payload's stop signal",
                            factory=AgentConfig)
    doctor: DoctorConfig = _f("what `hpcrl doctor` checks against", factory=DoctorConfig)
    env: Mapping[str, str] = _f("environment applied on every node (not secret)",
                                factory=_frozen_map)
    secrets: tuple[str, ...] = _f("names of variables passed from the submitting environment "
                                  "(values never written)", factory=tuple)


# Top-level keys that only exist in files.
_FILE_ONLY_KEYS = ("extends",)


@dataclass(frozen=True)
class LoadedProfile:
    """A resolved profile with the file each value came from (dotted key -> file)."""

    profile: SiteProfile
    provenance: Mapping[str, str]
    chain: tuple[str, ...]


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


def _check_name(name: str, requested_by: Path | None) -> None:
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
        _check_name(current, requested_by)
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
        elif _is_mapping_hint(hint) and isinstance(value, Mapping):
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


def _is_mapping_hint(hint: Any) -> bool:
    return typing.get_origin(hint) in (Mapping, dict) or hint in (Mapping, dict)


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


def _type_name(hint: Any) -> str:
    names = {str: "string", int: "integer", bool: "true/false"}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args) + " or null"
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if _is_mapping_hint(hint):
        return "mapping of NAME: string"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _type_error(prov: Mapping[str, str], dotted: str, hint: Any, value: Any,
                extra: str = "") -> ProfileError:
    src = prov.get(dotted) or next((v for k, v in prov.items() if k.startswith(dotted + ".")),
                                   "<profile>")
    return ProfileError(f"{src}: key `{dotted}` must be a {_type_name(hint)}, got {value!r}"
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
    if _is_mapping_hint(hint):
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


# ----------------------------------------------------------------------------- helpers


def parse_version(text: str) -> tuple[int, ...]:
    """`2.45.0rc1` -> (2, 45, 0): the leading numeric release parts."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if not m:
        raise ProfileError(f"version {text!r} does not start with numbers like `2.45`")
    return tuple(int(x) for x in m.group(1).split("."))


def _pad(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (4 - len(v))


def env_for_ray_version(rules: Sequence[VersionEnvRule], ray_version: str) -> dict[str, str]:
    """The variables of every rule matching `ray_version` (later rules win on conflicts)."""
    have = _pad(parse_version(ray_version))
    out: dict[str, str] = {}
    for rule in rules:
        if rule.min_version is not None and have < _pad(parse_version(rule.min_version)):
            continue
        if rule.below_version is not None and have >= _pad(parse_version(rule.below_version)):
            continue
        out.update(rule.env)
    return out


def parse_time_minutes(text: str) -> int:
    """Slurm `--time` (`M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`) -> whole minutes, rounded up."""
    return max(1, -(-parse_time_seconds(text) // 60))


def parse_time_seconds(text: str) -> int:
    """Slurm `--time` -> seconds (see :func:`parse_time_minutes`)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise ProfileError(f"time limit {text!r} is not a Slurm time; use `MM`, `HH:MM:SS` or "
                           "`D-HH:MM:SS`")
    days, a, b, c = m.groups()
    if days is not None:
        h, mi, s = int(a), int(b or 0), int(c or 0)
    elif c is not None:
        h, mi, s = int(a), int(b), int(c)
    elif b is not None:
        h, mi, s = 0, int(a), int(b)
    else:
        h, mi, s = 0, int(a), 0
    return ((int(days or 0) * 24 + h) * 60 + mi) * 60 + s


def profile_to_dict(p: Any) -> Any:
    """A resolved profile (or part) as plain JSON-able data."""
    if dataclasses.is_dataclass(p):
        return {f.name: profile_to_dict(getattr(p, f.name)) for f in dataclasses.fields(p)}
    if isinstance(p, Mapping):
        return {k: profile_to_dict(v) for k, v in p.items()}
    if isinstance(p, tuple):
        return [profile_to_dict(v) for v in p]
    return p


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


def field_help(cls: type) -> dict[str, str]:
    """field name -> help line."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dict -> [(dotted key, leaf value)] in order (lists stay leaves)."""
    if isinstance(data, Mapping) and data:
        out: list[tuple[str, Any]] = []
        for k, v in data.items():
            out.extend(flatten(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}"))
        return out
    return [(prefix, data)]


def source_of(provenance: Mapping[str, str], dotted: str) -> str:
    """The file a dotted key came from, or `default`."""
    key = dotted
    while key:
        if key in provenance:
            return provenance[key]
        key = key.rpartition(".")[0]
    return "default"
