"""Site profiles: one YAML file per cluster, resolved into frozen dataclasses.

A profile (``site_profiles/<name>.yaml``) describes one cluster as data: Slurm defaults, the
container runtime and its flags, the network policy, the Ray settings and the environment applied
on every node. This module holds the profile's schema (the dataclasses, each key's help, type and
range) and the helpers that read a resolved profile; :mod:`hpcrl.profile_load` loads profiles,
follows their ``extends:`` chains, interpolates
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

- :func:`hpcrl.profile_load.load_profile` -> :class:`SiteProfile`; :func:`profile_to_dict` /
  :func:`hpcrl.profile_load.profile_from_dict` convert the fully resolved profile to and from plain data (this is
  what ``job.json`` carries, see :mod:`hpcrl.jobspec`).
- ``profile.ray.version_env`` holds rules choosing environment variables by Ray version at run
  time on the node (the login node may not have Ray): :func:`env_for_ray_version` applies them.
- Secrets are names only (``secrets:``); their values are read from the submitting environment
  by the launcher and never written into a profile, script, ``job.json`` or log.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcrl.runtimes import NAMES as RUNTIME_NAMES

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


# ----------------------------------------------------------------------------- helpers


def is_mapping_hint(hint: Any) -> bool:
    """Whether a field's type hint is a mapping (`env:`-like sections of NAME: value)."""
    return typing.get_origin(hint) in (Mapping, dict) or hint in (Mapping, dict)


def type_name(hint: Any) -> str:
    """A field's type in words, as errors and the reference pages name it."""
    names = {str: "string", int: "integer", bool: "true/false"}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args) + " or null"
    if typing.get_origin(hint) is tuple:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    if is_mapping_hint(hint):
        return "mapping of NAME: string"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


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
