"""Checks before a job is submitted, for the mistakes a newcomer makes first.

Each check returns problems as one message each (what was received, the rule, the fix). For the
`local` site every problem stops the submission before anything is created; for a Slurm site
the path checks are warnings (a path may exist only on the compute nodes) and a missing `sbatch`
stops it. Each side effect is one argument (`which`, `disk_free`, `read_columns`) that tests
replace.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hpcrl.runreport import reading_env, trainer_dirs
from trainer import hub
from trainer.algos import registry
from trainer.config import ConfigError, check_overrides, load_defaults, override_values
from trainer.data import (
    configured_tool_names,
    tools_file_refusal,
)

GIB = 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DEMO_HINT = "`make demo` shows a complete command line"


class PreflightError(ValueError):
    """The job would fail on its first step; the message says why and how to fix it."""


# ----------------------------------------------------------------------------- Slurm


def check_scheduler(site: str, scheduler: str, which: Callable[[str], str | None] = shutil.which
                    ) -> list[str]:
    """A Slurm site needs `sbatch` on PATH."""
    if scheduler != "slurm" or which("sbatch") is not None:
        return []
    return [f"site `{site}` submits to Slurm, but `sbatch` is not on PATH on this machine. Fix: "
            "run hpcrl on the cluster's login node (or load Slurm's client tools, e.g. `module "
            f"load slurm`); `hpcrl render --site {site} -- ...` prints the script to submit "
            "there; to run on this machine instead use `--site local`"]


def check_local_nodes(site: str, scheduler: str, nodes: int) -> list[str]:
    """A local site is this one machine: one node."""
    if scheduler != "local" or nodes <= 1:
        return []
    return [f"`--nodes {nodes}` on site `{site}`: a local run is this machine alone (1 node). "
            "Fix: drop `--nodes`, or submit to a Slurm site for more nodes"]


# ----------------------------------------------------------------------------- overrides


def parse_overrides(args: Sequence[str], job_env: Mapping[str, str] | None = None, loop: str = "sync"
                    ) -> tuple[dict[str, Any], list[str]]:
    """The trainer overrides among `args`, read by the trainer's own rules (verl's grammar,
    interpolations resolved, with `job_env`: what the agent will give the trainer): the value
    each key ends with, or the problem the trainer would stop on at its start."""
    try:
        values = override_values(args, job_env)
        check_overrides(args, job_env, loop)
        return values, []
    except ConfigError as err:
        return {}, [f"the trainer overrides are refused: {err}"]


@functools.cache
def trainer_defaults() -> Mapping[str, Any]:
    """The trainer's defaults (`trainer/config/*.yaml`), flattened to dotted keys; read once
    (the checks of one submission each ask for them), and read-only."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node

    walk("", load_defaults())
    return MappingProxyType(flat)


def setting(key: str, overrides: Mapping[str, str], defaults: Mapping[str, Any]) -> tuple[Any, bool]:
    """(value, given on the command line)."""
    if key in overrides:
        return overrides[key], True
    return defaults.get(key), False


def as_list(value: Any) -> list[str]:
    """`a.parquet`, `[a.parquet, b.parquet]` or a YAML list -> file names."""
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        return [p.strip().strip("'\"") for p in text[1:-1].split(",") if p.strip()]
    return [text]


def is_true(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _where(key: str, given: bool) -> str:
    return f"`{key}`" + ("" if given else " (its default; you did not set it)")


def check_path(key: str, value: str, given: bool, workdir: Path, what: str) -> tuple[Path | None, list[str]]:
    """An existing absolute path, or the problem."""
    if value in ("", "null", "None"):
        return None, []
    path = Path(os.path.expandvars(value)).expanduser()
    if not path.is_absolute():
        return None, [f"{_where(key, given)} is the relative path `{value}`, but the trainer runs "
                      f"in the run directory `{workdir}`. Fix: give an absolute path, e.g. "
                      f"`{key}=$PWD/{value}`"]
    if not path.exists():
        return None, [f"{_where(key, given)} is `{value}`, which does not exist. Fix: pass "
                      f"`{key}=<{what}>`; {DEMO_HINT}"]
    return path, []


def check_model(overrides: Mapping[str, str], defaults: Mapping[str, Any], workdir: Path,
                hub_env: Mapping[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """The model directory (or `.gguf` file), or the problem. A hub id (`org/name`) is looked up
    in the Hugging Face cache the job will read (`HF_HOME` of `hub_env`: this environment with
    the profile's `env` over it), as the trainer does."""
    value, given = setting("actor_rollout_ref.model.path", overrides, defaults)
    if value is None:
        return None, []
    if hub.is_hub_id(str(value)):
        env = os.environ if hub_env is None else hub_env
        cached = hub.resolve_hub_model(str(value), env)
        if cached is not None:
            return cached, []
        why = (" and `HF_HUB_OFFLINE=1` forbids downloading" if hub.is_offline(env) else
               "; the trainer downloads it only where the hub is reachable, which compute nodes "
               "often are not")
        return None, [hub.missing_message("actor_rollout_ref.model.path", str(value), env, why)]
    path, problems = check_path("actor_rollout_ref.model.path", str(value), given, workdir,
                                "a directory written by `save_pretrained`, or a `.gguf` file")
    if path is not None and path.is_dir() and not (path / "config.json").is_file():
        problems.append(f"`actor_rollout_ref.model.path={value}` has no `config.json`: it is not "
                        "a model written by `save_pretrained`. Fix: point it at the model's "
                        "directory (the one holding `config.json` and the weights)")
    return path, problems


def parquet_columns(path: Path) -> list[str] | None:
    """Column names of a parquet file; None when pyarrow is not installed here."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    return list(pq.read_schema(path).names)


def data_keys(overrides: Mapping[str, str], defaults: Mapping[str, Any]) -> list[str]:
    """The data files the trainer reads: the training files, and the validation files when
    validation runs."""
    val_before, _ = setting("trainer.val_before_train", overrides, defaults)
    test_freq, _ = setting("trainer.test_freq", overrides, defaults)
    validates = is_true(val_before) or (str(test_freq).lstrip("-").isdigit() and int(str(test_freq)) > 0)
    return ["data.train_files", *(["data.val_files"] if validates else [])]


def check_data(overrides: Mapping[str, str], defaults: Mapping[str, Any], workdir: Path,
               read_columns: Callable[[Path], list[str] | None] = parquet_columns) -> list[str]:
    """Training (and, when validation runs, validation) files exist and have verl's columns; the
    files of `data.custom_cls`/`data.sampler` classes exist (imported by the trainer alone), and
    with a dataset class of the user's the data files are the class's to read: only their
    existence is checked."""
    problems = check_class_files(overrides, defaults, workdir)
    custom = setting("data.custom_cls.path", overrides, defaults)[0] not in (None, "", "null", "None")
    keys = data_keys(overrides, defaults)
    needed = [str(setting(f"data.{k}", overrides, defaults)[0] or d)
              for k, d in (("prompt_key", "prompt"), ("reward_fn_key", "data_source"))]
    needed.append("reward_model")
    tool_config, _ = setting("actor_rollout_ref.rollout.multi_turn.tool_config_path", overrides, defaults)
    tools = configured_tool_names(Path(str(tool_config)).expanduser()) if tool_config else set()
    for key in keys:
        value, given = setting(key, overrides, defaults)
        for name in as_list(value):
            path, found = check_path(key, name, given, workdir, "a verl-format parquet file")
            problems += found
            if path is None or not path.is_file() or custom:
                continue
            try:
                columns = read_columns(path)
            except Exception as exc:  # pyarrow's errors for a file that is not parquet
                problems.append(f"`{key}`: `{path}` cannot be read as parquet ({exc}). Fix: "
                                "write it with `python -m trainer.preprocess`")
                continue
            if columns is not None and "extra_info" in columns and tools is not None:
                refusal = tools_file_refusal(path, tools)
                if refusal is not None:
                    problems.append(f"`{key}`: {refusal}")
            missing = [c for c in needed if columns is not None and c not in columns]
            if missing and columns is not None:
                problems.append(
                    f"`{key}`: `{path}` lacks column(s) {', '.join(f'`{c}`' for c in missing)} "
                    f"(it has {', '.join(columns)}); the trainer reads verl's format. Fix: "
                    "convert it with `python -m trainer.preprocess gsm8k --input FILE --output "
                    "DIR`, or name your columns with `data.prompt_key=`/`data.reward_fn_key=`")
    return problems


def check_class_files(overrides: Mapping[str, str], defaults: Mapping[str, Any], workdir: Path) -> list[str]:
    """The Python files of `data.custom_cls.path` and `data.sampler.class_path` exist (a
    `pkg://module` is the trainer's to import)."""
    problems: list[str] = []
    for key in ("data.custom_cls.path", "data.sampler.class_path"):
        value, given = setting(key, overrides, defaults)
        if value is None or str(value).startswith("pkg://"):
            continue
        problems += check_path(key, str(value).removeprefix("file://"), given, workdir,
                               "the Python file defining the class")[1]
    return problems


# ----------------------------------------------------------------------------- disk space


def model_bytes(path: Path) -> int:
    """Bytes of the model's weight files."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def checkpoint_bytes(model: Path, with_critic: bool) -> int:
    """About one checkpoint: fp32 actor, AdamW's two moments and an HF export (x4 of the fp32
    weights), a critic's weights and moments (x3) when the estimator trains one, plus 10%."""
    weights = model_bytes(model)
    if model.suffix == ".gguf":
        weights *= 2  # stored at 16 bits or less, trained in fp32
    else:
        config = model / "config.json"
        text = config.read_text() if config.is_file() else ""
        if "bfloat16" in text or "float16" in text:
            weights *= 2
    factor = 4 + (3 if with_critic else 0)
    return int(weights * factor * 1.1)


def format_bytes(n: int) -> str:
    """`4.2 MB`, `1.50 GiB`."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1e6:.1f} MB"


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_free(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def check_space(ckpt_root: Path, model: Path, with_critic: bool,
                free: Callable[[Path], int] = disk_free) -> list[str]:
    need = checkpoint_bytes(model, with_critic)
    have = free(ckpt_root)
    if have >= need:
        return []
    return [f"checkpoints go to `{ckpt_root}`, whose filesystem has {format_bytes(have)} free; one "
            f"checkpoint of `{model}` needs about {format_bytes(need)} (weights, optimizer state "
            "and an HF export). Fix: free space there, or set `trainer.default_local_dir=` (or "
            "`--run-dir`) to a filesystem with room"]


# ----------------------------------------------------------------------------- all together


def check_trainer_job(payload_args: Sequence[str], run_dir: Path,
                      read_columns: Callable[[Path], list[str] | None] = parquet_columns,
                      free: Callable[[Path], int] = disk_free, nodes: int = 1,
                      profile: Mapping[str, Any] | None = None) -> list[str]:
    """Every check of a trainer job on `nodes` nodes of the site `profile` (plain data) whose
    payload overrides are `payload_args`."""
    overrides, problems = parse_overrides(payload_args, reading_env(nodes, run_dir, profile))
    return problems or check_job_inputs(overrides, run_dir, read_columns, free)


def check_job_inputs(overrides: Mapping[str, Any], run_dir: Path,
                     read_columns: Callable[[Path], list[str] | None] = parquet_columns,
                     free: Callable[[Path], int] = disk_free,
                     hub_env: Mapping[str, str] | None = None) -> list[str]:
    """What the trainer will read and write, from its parsed `overrides`: the model (a hub id
    in the cache of `hub_env`), the datasets and their columns, room for a checkpoint."""
    defaults = trainer_defaults()
    model, problems = check_model(overrides, defaults, run_dir, hub_env)
    problems += check_data(overrides, defaults, run_dir, read_columns)
    if model is not None and not problems:
        estimator, _ = setting("algorithm.adv_estimator", overrides, defaults)
        _, ckpt_root = trainer_dirs(run_dir, overrides)
        problems += check_space(ckpt_root, model, trains_critic(str(estimator)), free)
    return problems


#: Runtimes whose containers see only what is bound into them (the OCI ones): Apptainer binds
#: the home directory, /tmp and more by its own configuration, which this host cannot read.
BIND_ONLY_RUNTIMES = ("podman", "docker")


def bind_target(bind: str) -> str:
    """Where `SRC[:DST[:OPTS]]` shows up in the container: DST, or SRC without one."""
    parts = bind.split(":")
    return parts[1] if len(parts) > 1 and parts[1] else parts[0]


def check_binds(overrides: Mapping[str, Any], run_dir: Path, runtime: str, binds: Sequence[str]) -> list[str]:
    """Each absolute path the trainer reads (the model, the data files it reads, the reward
    function's file) that the job's container will not see: outside the run directory and every `container.binds` target, under a runtime that
    shows a container nothing else (:data:`BIND_ONLY_RUNTIMES`)."""
    if runtime not in BIND_ONLY_RUNTIMES:
        return []
    seen = [run_dir.absolute(), *(Path(bind_target(b)) for b in binds)]
    defaults, problems = trainer_defaults(), []
    for key in ("actor_rollout_ref.model.path", *data_keys(overrides, defaults), "custom_reward_function.path"):
        value, given = setting(key, overrides, defaults)
        for name in as_list(value):
            path = Path(os.path.expandvars(name)).expanduser()
            if not path.is_absolute() or any(path == d or d in path.parents for d in seen):
                continue
            problems.append(
                f"{_where(key, given)} is `{name}`, which the job's container will not see: {runtime} shows it only "
                f"the run directory and `container.binds` ({', '.join(map(str, seen[1:])) or 'none'}). Fix: add "
                f"`{path.parent}` (or a folder above it) to the site profile's `container.binds`, unless the "
                "image holds it")
    return problems


def trains_critic(estimator: str) -> bool:
    """Whether the advantage estimator `estimator` needs a critic, as its declaration in
    `trainer.algos.registry` says (no torch needed). For an unknown name (the trainer refuses it
    at start) the answer is yes: the space check then asks for the larger checkpoint."""
    try:
        return registry.adv_estimator(estimator).needs_critic
    except ValueError:
        return True


def report(problems: Sequence[str], fatal: bool) -> None:
    """Raise for fatal problems; print the others as warnings."""
    if not problems:
        return
    if fatal:
        raise PreflightError("\n  ".join(problems) if len(problems) == 1 else
                             f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))
    import sys

    for p in problems:
        print(f"hpcrl: warning: {p} (if it exists only on the compute nodes, ignore this)",
              file=sys.stderr)
