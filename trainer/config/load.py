"""Loading the config: the section defaults merged, overrides applied, derived values filled,
the whole validated and frozen; and its printed forms (`--print-config`, `--list-keys`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.algos import registry
from trainer.config import at_default
from trainer.config.actor import validate_checkpoint, validate_lora
from trainer.config.algorithm import estimator, validate_pf_ppo, validate_rollout_correction
from trainer.config.async_training import (
    ENTRY_DEFAULTS,
    check_allocation,
    check_separate_pools_built,
    validate_pools,
)
from trainer.config.base import RUN_DIR_ENV, ConfigError, check_optim, require
from trainer.config.compose import expand_args, split_config_flags
from trainer.config.data import check_data_classes
from trainer.config.overrides import (
    Override,
    _apply,
    _lookup,
    _reading_env,
    apply_overrides,
    at_default_keys,
    is_override,
)
from trainer.config.reward import (
    derive_overlong,
    validate_reward_kwargs,
    validate_reward_model,
    validate_sandbox_fusion,
)
from trainer.config.rollout import (
    NO_VLLM_NOTE,
    default_rollout_name,
    server_mode,
    validate_engine_kwargs,
)
from trainer.config.schema import ALIASES, COMPAT, Config
from trainer.config.trainer import default_gpus_per_node
from trainer.config.values import _coerce_default, _hints, _is_section, _type_name, _valid_keys

DEFAULTS_DIR = Path(__file__).parent
#: The defaults, one YAML file per section module (`data.yaml` beside `data.py`), merged in
#: this order into one tree with verl's layout.
DEFAULTS_FILES = tuple(DEFAULTS_DIR / f"{name}.yaml"
                       for name in ("data", "actor", "rollout", "critic", "reward", "algorithm", "trainer",
                                    "async_training"))


def _merge(into: dict[str, Any], extra: dict[str, Any], where: Path) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, where)
        elif key in into:
            raise ConfigError(f"the default of `{key}` is set twice (again in {where}); keep one")
        else:
            into[key] = value


def load_defaults() -> dict[str, Any]:
    """The defaults of every key, as one nested tree (verl's layout)."""
    tree: dict[str, Any] = {}
    for path in DEFAULTS_FILES:
        with open(path) as fh:
            _merge(tree, yaml.safe_load(fh) or {}, path)
    return tree


def _build(cls: type, tree: Any, prefix: str) -> Any:
    if not isinstance(tree, dict):
        raise ConfigError(f"`{prefix}` must be a section with keys {_valid_keys(cls)}")
    hints = _hints(cls)
    unknown = set(tree) - set(hints)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'`{prefix}.{k}`' for k in sorted(unknown))}; "
            f"valid keys of `{prefix}`: {_valid_keys(cls)}"
        )
    values = {}
    for name, tp in hints.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in tree:
            raise ConfigError(f"`{key}` is missing from the defaults ({DEFAULTS_DIR}/*.yaml)")
        sub = tree[name]
        values[name] = _build(tp, sub, key) if _is_section(tp) else _coerce_default(sub, tp, key)
    return cls(**values)


def _expand(path: str) -> str:
    return os.path.expanduser(os.path.expandvars(path))


def _derive(tree: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Fill the null "derived" values in place, verl's interpolations done once; under hpcrl
    (`HPCRL_RUN_DIR` in `env`) checkpoints and metrics default to the job's run directory."""
    arr = tree["actor_rollout_ref"]
    actor, critic, trainer = arr["actor"], tree["critic"], tree["trainer"]
    for section in (arr["ref"], arr["rollout"]):
        if section["log_prob_use_dynamic_bsz"] is None:
            section["log_prob_use_dynamic_bsz"] = actor["use_dynamic_bsz"]
        if section["log_prob_max_token_len_per_gpu"] is None:
            section["log_prob_max_token_len_per_gpu"] = actor["ppo_max_token_len_per_gpu"]
    for section in (actor, critic):
        if section["optim"]["clip_grad"] is not None:
            section["grad_clip"] = section["optim"]["clip_grad"]
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if actor[name] is None:
            actor[name] = actor["clip_ratio"]
    for name in ("ppo_mini_batch_size", "ppo_epochs", "shuffle", "use_dynamic_bsz", "loss_agg_mode"):
        if critic[name] is None:
            critic[name] = actor[name]
    if critic["forward_max_token_len_per_gpu"] is None:
        critic["forward_max_token_len_per_gpu"] = critic["ppo_max_token_len_per_gpu"]
    if critic["model"]["path"] is None:
        critic["model"]["path"] = arr["model"]["path"]
    if critic["model"]["tokenizer_path"] is None:
        critic["model"]["tokenizer_path"] = critic["model"]["path"]
    derive_overlong(tree["reward_model"])
    for section in (actor, critic):  # verl's deprecated name of `lr_scheduler_type`
        if section["optim"]["warmup_style"] is not None:
            section["optim"]["lr_scheduler_type"] = section["optim"]["warmup_style"]
    if arr["rollout"]["name"] is None:
        arr["rollout"]["name"] = default_rollout_name()
    if trainer["n_gpus_per_node"] is None:
        trainer["n_gpus_per_node"] = default_gpus_per_node(env or {})
    launched = (env or {}).get(RUN_DIR_ENV)

    if trainer["default_local_dir"] is None:
        trainer["default_local_dir"] = (
            os.path.join(launched, "checkpoints") if launched
            else f"checkpoints/{trainer['project_name']}/{trainer['experiment_name']}"
        )
    if trainer["run_dir"] is None:
        trainer["run_dir"] = launched or trainer["default_local_dir"]
    data = tree["data"]
    data["train_files"] = [_expand(p) for p in _as_list(data["train_files"])]
    data["val_files"] = [_expand(p) for p in _as_list(data["val_files"])]
    arr["model"]["path"] = _expand(arr["model"]["path"])
    critic["model"]["path"] = _expand(critic["model"]["path"])
    algo = tree["algorithm"]
    tree["derived"] = {
        "use_critic": estimator(str(algo["adv_estimator"])).needs_critic,
        "use_reference": bool(algo["use_kl_in_reward"] or actor["use_kl_loss"]),
        "world_size": trainer["nnodes"] * trainer["n_gpus_per_node"],
    }
    return tree



def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]



def validate(cfg: Config) -> None:
    """Cross-key rules (batch divisibility, algorithm requirements)."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    # verl's fully-async trainer takes no training batches: `train_batch_size=0` with one prompt
    # per generation batch (its rollouter asserts both; the loop's start checks the rest)
    streamed = data.train_batch_size == 0 and data.gen_batch_size == 1 and not arr.hybrid_engine
    for key, value in ((("data.train_batch_size", data.train_batch_size),) if not streamed else ()) + (
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                       ("actor_rollout_ref.rollout.n", rollout.n),
                       ("trainer.nnodes", cfg.trainer.nnodes),
                       ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node or 0),  # derived: never null
                       ("data.max_prompt_length", data.max_prompt_length),
                       ("data.max_response_length", data.max_response_length),
                       ("actor_rollout_ref.rollout.update_weights_bucket_megabytes",
                        rollout.update_weights_bucket_megabytes)):
        require(value >= 1, f"`{key}`={value} must be at least 1")
    require(
        streamed or data.train_batch_size % actor.ppo_mini_batch_size == 0,
        f"`data.train_batch_size`={data.train_batch_size} must be a multiple of "
        f"`actor_rollout_ref.actor.ppo_mini_batch_size`={actor.ppo_mini_batch_size}; "
        "change one of them",
    )
    world = cfg.derived.world_size
    samples = actor.ppo_mini_batch_size * rollout.n
    require(
        samples % world == 0,
        f"a mini-batch holds `ppo_mini_batch_size` x `rollout.n` = {samples} samples, which "
        f"must split evenly over {world} workers (`trainer.nnodes` x `trainer.n_gpus_per_node`)",
    )
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro is not None and not actor.use_dynamic_bsz:
        require(
            (samples // world) % micro == 0,
            f"`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`={micro} must divide the "
            f"{samples // world} samples per worker of one mini-batch",
        )
    group = estimator(cfg.algorithm.adv_estimator).min_group_size
    require(
        rollout.n >= group,
        f"`algorithm.adv_estimator={cfg.algorithm.adv_estimator}` compares responses within a "
        f"group and needs `actor_rollout_ref.rollout.n` >= {group} (got {rollout.n})",
    )

    require(
        actor.policy_loss.loss_mode in registry.policy_loss_names(),
        f"`actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode}` is not a "
        f"registered policy loss; valid values: {', '.join(registry.policy_loss_names())}",
    )
    for key, name in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
                      ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        require(name in registry.KL_ESTIMATORS,
                f"`{key}={name}` is not a KL estimator; valid values: {', '.join(registry.KL_ESTIMATORS)}")
    require(actor.loss_scale_factor is None or actor.loss_scale_factor > 0,
            f"`actor_rollout_ref.actor.loss_scale_factor={actor.loss_scale_factor}` must be positive (the "
            "divisor of seq-mean-token-sum-norm) or null for the padded response length")
    check_data_classes(data)
    check_optim("actor_rollout_ref.actor", actor.optim)
    check_optim("critic", cfg.critic.optim)
    require(actor.clip_ratio_c > 1.0, f"`actor_rollout_ref.actor.clip_ratio_c`={actor.clip_ratio_c} must be > 1")
    require(
        cfg.trainer.resume_mode != "resume_path" or cfg.trainer.resume_from_path is not None,
        "`trainer.resume_mode=resume_path` needs `trainer.resume_from_path=<checkpoint dir>`",
    )
    tp = rollout.tensor_model_parallel_size
    require(tp >= 1, f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` must be at least 1")
    require(
        world % tp == 0,
        f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` must divide the {world} "
        "ranks (`trainer.nnodes` x `trainer.n_gpus_per_node`): each group of that many ranks runs "
        "one rollout engine (verl's rollout mesh, dp x tp). Fix: pick a divisor of the world size",
    )
    dp = rollout.data_parallel_size
    require(dp >= 1 and world % (tp * dp) == 0,
            f"`actor_rollout_ref.rollout.data_parallel_size={dp}` with `tensor_model_parallel_size={tp}`: verl's "
            f"rollout server spans tp x dp = {tp * dp} GPUs, which must be at least 1 and divide the {world} ranks "
            "(`trainer.nnodes` x `trainer.n_gpus_per_node`). Fix: a `data_parallel_size` with tp x dp dividing the "
            "world size (here every one of those engines is a replica of its own either way)")
    require(
        not server_mode(cfg) or cfg.trainer.n_gpus_per_node % tp == 0,
        f"`actor_rollout_ref.rollout.mode=async` with `tensor_model_parallel_size={tp}` and "
        f"`trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}`: a server-mode replica's workers are "
        "vLLM's processes on one node, so its GPUs must be one node's. Fix: a "
        "`tensor_model_parallel_size` that divides `trainer.n_gpus_per_node`, or `rollout.mode=sync` "
        "(the in-process engine, whose ranks may span nodes)",
    )
    w = cfg.trainer.watchdog
    require(w.floor_s > 0 and w.multiple >= 1 and w.min_s >= 0 and w.warmup >= 1 and w.poll_s > 0,
            f"`trainer.watchdog`: floor_s={w.floor_s:g}, multiple={w.multiple:g}, min_s={w.min_s:g}, "
            f"warmup={w.warmup}, poll_s={w.poll_s:g}: need floor_s > 0, multiple >= 1, min_s >= 0, warmup >= 1 "
            "and poll_s > 0 (to switch it off: `trainer.watchdog.enable=false`)")
    require(w.slow_factor > 1 and w.slow_steps >= 1,
            f"`trainer.watchdog.slow_factor={w.slow_factor:g}` and `slow_steps={w.slow_steps}`: a node is named slow "
            "when its rollout is slower per token than `slow_factor` (> 1) times the others' for `slow_steps` (>= 1) steps "
            "in a row. Fix: e.g. `trainer.watchdog.slow_factor=2 trainer.watchdog.slow_steps=3`")
    require(not cfg.trainer.val_only or bool(data.val_files),
             "`trainer.val_only=true` validates and exits, and needs a validation set: set "
             "`data.val_files`")
    require(cfg.trainer.log_val_generations >= 0,
             f"`trainer.log_val_generations={cfg.trainer.log_val_generations}` must be 0 or more")
    require(arr.nccl_timeout > 0, f"`actor_rollout_ref.nccl_timeout={arr.nccl_timeout}` must be positive")
    validate_reward_model(cfg.reward_model, cfg.custom_reward_function)
    validate_sandbox_fusion(cfg.reward_model, cfg.custom_reward_function)
    buffer = cfg.reward_model.overlong_buffer
    max_len = validate_reward_kwargs(cfg.reward_model, data.max_response_length)
    require(
        not buffer.enable or 0 < buffer.len <= max_len,
        f"`reward_model.overlong_buffer.len={buffer.len}` must be between 1 and the length the "
        f"penalty counts to ({max_len}: `reward_model.reward_kwargs.max_resp_len`, else "
        "`data.max_response_length`) when the buffer is enabled",
    )
    require(
        not buffer.enable or cfg.reward_model.reward_manager == "dapo",
        "`reward_model.overlong_buffer.enable=true` acts only with `reward_model.reward_manager=dapo` "
        f"(it is `{cfg.reward_model.reward_manager}`); set both",
    )
    validate_pools(cfg)
    validate_lora(arr)
    validate_engine_kwargs(rollout)
    validate_rollout_correction(cfg.algorithm, rollout.calculate_log_probs)
    validate_pf_ppo(cfg.algorithm)
    validate_checkpoint(arr)
    keep = cfg.trainer.max_critic_ckpt_to_keep
    require(
        keep is None or keep == cfg.trainer.max_actor_ckpt_to_keep,
        f"`trainer.max_critic_ckpt_to_keep={keep}`: the critic is saved inside each checkpoint "
        "with the actor, so one limit applies to both; set `trainer.max_actor_ckpt_to_keep` "
        f"instead (it is {cfg.trainer.max_actor_ckpt_to_keep})",
    )
    c = cfg.critic
    if cfg.derived.use_critic and c.ppo_mini_batch_size is not None:
        critic_samples = c.ppo_mini_batch_size * rollout.n
        require(
            critic_samples % world == 0,
            f"a critic mini-batch holds `critic.ppo_mini_batch_size` x `rollout.n` = {critic_samples} "
            f"samples, which must split evenly over {world} workers",
        )


def check_run(cfg: Config, loop: str = "sync") -> None:
    """The checks verl makes when its trainer starts rather than when the config is composed
    (`verl/utils/config.py::validate_config`, after `main_ppo` reads the config): the trainer's
    start (`PPODriver`), the launcher's preflight (:func:`check_overrides`) and `--plan-memory` run
    them; reading a config (:func:`load_config`, `--print-config`) does not. `loop`: the loop of
    the entry that runs the config (`sync`: `python -m trainer`; `one_step_off`). Raises ConfigError."""
    require(loop != "fully_async" or cfg.data.sampler.class_path is None,
            f"`data.sampler.class_path={cfg.data.sampler.class_path}` under the fully-async loop: its rollouter "
            "hands prompts out one at a time by their position in the epoch's order and gives back those "
            "unfinished at a stop, which a sampler drawing lazily (and updated after each step) cannot "
            "replay. Fix: train with the sampler under the synchronous or one-step-off loop, or remove "
            "`data.sampler.*`")
    check_separate_pools_built(cfg, loop)
    c, actor = cfg.critic, cfg.actor_rollout_ref.actor
    dynamic = actor.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    require(
        not cfg.derived.use_critic or dynamic or c.ppo_micro_batch_size_per_gpu is not None,
        f"`algorithm.adv_estimator={cfg.algorithm.adv_estimator}` trains a critic, and it has no "
        "micro-batch size: neither `critic.ppo_micro_batch_size_per_gpu` nor dynamic batching "
        "(`critic.use_dynamic_bsz`, which follows `actor_rollout_ref.actor.use_dynamic_bsz`). verl's "
        "CriticConfig refuses this ('[critic] Please set at least one of ...'); one micro-batch would "
        "otherwise hold a worker's whole mini-batch (activations of every sample at once). Fix: set "
        "`critic.ppo_micro_batch_size_per_gpu` (e.g. 4) or `critic.use_dynamic_bsz=true` with "
        "`critic.ppo_max_token_len_per_gpu`",
    )


def load_config(
    overrides: Sequence[str | Override] = (), env: Mapping[str, str] | None = None
) -> Config:
    """Defaults + dotted overrides -> validated, derived, frozen `Config`; `env` (default: the
    process environment) supplies `HPCRL_RUN_DIR` and `HPCRL_GPUS_PER_NODE` when hpcrl launched
    the trainer."""
    tree = apply_overrides(load_defaults(), list(overrides))
    env = os.environ if env is None else env
    cfg = _build(Config, _derive(tree, env), "")
    validate(cfg)
    check_allocation(cfg, env)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a `Config` from `config_to_dict` output (e.g. the copy in a checkpoint)."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


class _Dumper(yaml.SafeDumper):
    """Sections as blocks (one key per line), lists inline."""


_Dumper.add_representer(
    list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def dump_config(cfg: Config) -> str:
    """The config as YAML; the keys accepted only for compatibility carry a comment saying so."""
    text = yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    lines, path = [], []
    for line in text.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.strip().split(":", 1)[0]
        path = [*path[:depth], name]
        why = COMPAT.get(".".join(path))
        lines.append(f"{line}  # compatibility only: {why}" if why and ":" in line else line)
    return "\n".join(lines) + "\n"


def describe_keys() -> list[tuple[str, str, str]]:
    """(dotted key, type, help) for every settable key, in file order."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if cls is Config and f.name == "derived":
                continue
            tp = _hints(cls)[f.name]
            key = f"{prefix}{f.name}"
            if _is_section(tp):
                walk(tp, key + ".")
            else:
                why = COMPAT.get(key)
                rows.append((key, _type_name(tp),
                             f.metadata["help"] + (f" [compatibility only: {why}]" if why else "")))

    walk(Config, "")
    return rows


def compat_notes(overrides: Sequence[str | Override], cfg: Config) -> list[str]:
    """One line for each override among `overrides` that is accepted without acting (a `COMPAT`
    key set away from its default, a newer verl spelling read as this trainer's key, a setting
    LoRA makes moot): what runs instead, and that the numbers are the same. `cfg`: their config."""
    items = [a for a in overrides if is_override(a)]
    defaults = load_defaults()
    tree, keys = _apply(defaults, items)
    lines: list[str] = []
    for compat in dict.fromkeys(_compat_key(key) for key in keys):
        if compat is None or _lookup(tree, compat)[1] == _lookup(defaults, compat)[1]:
            continue
        shown = compat if compat in keys else f"{compat}.*"
        lines.append(f"`{shown}` is accepted and changes nothing here: {COMPAT[compat]}; "
                     "the numbers are the same")
    for key in dict.fromkeys(item.key if isinstance(item, Override) else item.lstrip("+~").split("=", 1)[0]
                             for item in items):
        if key in ALIASES:
            lines.append(f"`{key}` is verl's newer name of `{ALIASES[key]}`, read as it")
    lines += at_default.notes(at_default_keys(items))
    arr = cfg.actor_rollout_ref
    if "actor_rollout_ref.rollout.name" not in keys and arr.rollout.name == "hf":
        lines.append(NO_VLLM_NOTE)
    r = arr.rollout
    if r.mode == "async" and r.name != "vllm":
        lines.append(f"`actor_rollout_ref.rollout.mode=async` changes nothing with `rollout.name={r.name}`: "
                     "server-mode replicas are vLLM's; the in-process engine batches every live "
                     "trajectory's turn, sampling the same distribution; the numbers are the same")
    if arr.model.uses_lora and arr.ref.fsdp_config.param_offload:
        lines.append("`actor_rollout_ref.ref.fsdp_config.param_offload=true` changes nothing with LoRA: "
                     "the reference policy is the actor with its adapters disabled (as in verl), with no "
                     "weights of its own to offload; the numbers are the same")
    return lines


def _compat_key(key: str) -> str | None:
    """The `COMPAT` key that `key` is or lies under (a sub-key of a free-form mapping); the
    longest when several are."""
    return max((k for k in COMPAT if key == k or key.startswith(k + ".")), key=len, default=None)


def override_values(args: Sequence[str], job_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keys the overrides among `args` (with a `--config-name` file's) set and the value each ends with (verl's grammar,
    interpolations resolved, `~key` back to its default): how the launcher reads a payload's
    overrides (submit's checks, the run directory's paths), by the trainer's own rules. Keys
    this trainer does not have are left out. `job_env`: variables the job will have that this
    process lacks (`${oc.env:HPCRL_NUM_NODES}`), for the reading only. Raises ConfigError as the
    trainer would."""
    with _reading_env(job_env):
        tree, keys = _apply(load_defaults(), expand_args(args))
    return {key: _lookup(tree, key)[1] for key in keys}


def check_overrides(args: Sequence[str], job_env: Mapping[str, str] | None = None, loop: str = "sync") -> Config:
    """The trainer's whole check of the overrides among `args` (types, ranges, the settings it
    refuses), as its start on the job's nodes runs it (`loop`: the entry's, as in
    :func:`check_run`), with `job_env` as in `override_values`; files are not looked at (they
    may exist only on the compute nodes). Raises ConfigError."""
    with _reading_env(job_env):
        named = split_config_flags(args)[1] is not None  # else the entry's own file, as its start reads it
        cfg = load_config([*(() if named else ENTRY_DEFAULTS[loop]), *expand_args(args)], env=dict(os.environ))
        check_run(cfg, loop)
        return cfg

