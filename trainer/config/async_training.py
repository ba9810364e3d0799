"""`async_training.*` and the top-level `rollout.*` pool: the keys of verl's asynchronous recipes
(`verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml`,
`verl/experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml`). Defaults:
`trainer/config/async_training.yaml`.

A rollout pool (`rollout.nnodes` x `rollout.n_gpus_per_node` of their own) is verl's separate
deployment, `actor_rollout_ref.hybrid_engine=false`: generation runs on the rollout pool's
replicas while the trainer trains on `trainer.nnodes` x `trainer.n_gpus_per_node`. The two are
asked for together, and both pools must fit the job's allocation; both are checked when the
config is read (:func:`validate_pools`, :func:`check_allocation`), before any queue exists.

The queue's size and the staleness bound are verl's arithmetic
(`FullyAsyncRollouter.set_max_required_samples` in
`verl/experimental/fully_async_policy/fully_async_rollouter.py`), computed once by
:func:`queue_bounds`; the rollouter and the trainer read them from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer.algos import registry
from trainer.config.base import ConfigError, h, require

if TYPE_CHECKING:
    from trainer.config.schema import Config


@dataclass(frozen=True)
class CheckpointEngineConfig:
    enable: bool = h(
        "sync a rollout pool's weights by a collective broadcast from actor rank 0 (NCCL/RCCL between GPUs, "
        "gloo between CPUs; buckets of `actor_rollout_ref.rollout.update_weights_bucket_megabytes`); false: "
        "through Ray's object store in host memory")
    overlap_broadcast_and_consume: bool = h(
        "pipeline the broadcast: the next bucket moves while the engine loads the last (one more bucket "
        "buffer on each side)")
    device_buffer_size_M: int = h("verl's README names it; verl 0.9.1 reads it nowhere (see COMPAT)")


@dataclass(frozen=True)
class AsyncTrainingConfig:
    staleness_threshold: float = h(
        "how many sync intervals' worth of samples the rollouter may generate ahead of the trainer: "
        "at most `required_samples` x (1 + staleness_threshold) x `trigger_parameter_sync_step` "
        "samples are queued or in flight between two weight syncs (verl's `max_required_samples`); "
        "0 = none ahead")
    trigger_parameter_sync_step: int = h(
        "trainer updates (each on `require_batches` mini-batches) between two weight syncs to the "
        "rollout pool")
    require_batches: int = h(
        "`ppo_mini_batch_size` prompts' worth of samples the trainer takes from the queue per update "
        "(verl's `required_samples` = ppo_mini_batch_size x require_batches)")
    partial_rollout: bool = h(
        "at a weight sync, abort the requests in flight and continue them under the new weights "
        "rather than waiting for them to finish (each part keeps its weights' log-probs; staleness "
        "counts from the version that finished a sample); single-turn rows, HF or vLLM")
    use_rollout_log_probs: bool = h(
        "train with the rollout's log-probs as the old log-probs (no recomputation by the trainer)")
    compute_prox_log_prob: bool = h(
        "recompute the log-probs with the trainer's current weights before the update "
        "(verl: experimental)")
    use_trainer_do_validate: bool = h("validate on the training pool's GPUs rather than the rollout pool's")
    checkpoint_engine: CheckpointEngineConfig = h("weight sync between the pools")
    use_dynamic_resource_scheduling: bool = h(
        "verl 0.9.1: lend the training pool's GPUs to rollout while it waits (false only)")
    dynamic_schedule_policy: str = h("verl 0.9.1: the policy of dynamic resource scheduling (see COMPAT)")
    dynamic_schedule_deactivate_ratio: float = h(
        "verl 0.9.1: share of a step's samples after which lent replicas return (see COMPAT)")
    dynamic_schedule_enable_rebalance: bool = h(
        "verl 0.9.1: rebalance requests over lent replicas (see COMPAT)")
    concurrent_samples_per_replica: int = h(
        "requests one rollout replica runs at once (verl caps the rollouter's concurrency at "
        "replicas x this, and at `max_required_samples`)")


@dataclass(frozen=True)
class RolloutPoolConfig:
    nnodes: int = h("nodes of the rollout pool (0: no pool of its own, generation on the training "
                    "GPUs, the colocated default)")
    n_gpus_per_node: int = h("GPUs per node of the rollout pool")
    n: int = h("verl's async configs set it; verl 0.9.1 reads no top-level `rollout.n` (see COMPAT)")
    total_rollout_steps: int | None = h(
        "prompts the rollouter generates in all, at most epochs x dataset; null = "
        "`len(dataset)` x `trainer.total_epochs` (verl's `total_rollout_steps`)")
    total_epochs: int = h("verl's async scripts set it; verl 0.9.1 reads no top-level "
                          "`rollout.total_epochs` (see COMPAT)")
    test_freq: int = h("verl's async scripts set it; verl 0.9.1 reads no top-level `rollout.test_freq` "
                       "(see COMPAT)")


_UNREAD = ("verl 0.9.1's async entries never read the top-level `rollout.{}` "
           "(`fully_async_main.py` copies only `nnodes` and `n_gpus_per_node` into "
           "`actor_rollout_ref.rollout`); the trainer uses `{}`")
_DYNAMIC = ("verl reads it only with `async_training.use_dynamic_resource_scheduling=true` "
            "(refused here)")

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "rollout.n": _UNREAD.format("n", "actor_rollout_ref.rollout.n"),
    "rollout.total_epochs": _UNREAD.format("total_epochs", "trainer.total_epochs"),
    "rollout.test_freq": _UNREAD.format("test_freq", "trainer.test_freq"),
    "async_training.checkpoint_engine.device_buffer_size_M": (
        "verl 0.9.1 reads no `device_buffer_size_M` (only its README names it): its NCCL engine's bucket "
        "is `rollout.checkpoint_engine.update_weights_bucket_megabytes`, read here as "
        "`actor_rollout_ref.rollout.update_weights_bucket_megabytes`"),
    "async_training.dynamic_schedule_policy": _DYNAMIC,
    "async_training.dynamic_schedule_deactivate_ratio": _DYNAMIC,
    "async_training.dynamic_schedule_enable_rebalance": _DYNAMIC,
}

#: Keys read and checked here that act only in the separate-pool loops (one-step-off, fully
#: async), which are not built yet: a value away from the default is refused with the colocated
#: trainer (:func:`_check_unused`), and a config with a rollout pool is refused when the trainer
#: starts (:func:`check_separate_pools_built`). Nothing is accepted and then ignored.
ACT_IN_POOL_LOOPS: dict[str, str] = {
    f"async_training.{key}": why for key, why in (
        ("partial_rollout", "continue the requests in flight across a weight sync"),
        ("use_rollout_log_probs", "the rollout's log-probs as the old ones in the fully-async trainer"),
        ("compute_prox_log_prob", "the trainer's recomputed log-probs before the update"),
        ("use_trainer_do_validate", "validation on the training pool"),
        ("checkpoint_engine.enable", "the weight sync between the pools by collective broadcast"),
        ("checkpoint_engine.overlap_broadcast_and_consume", "the pipelined weight broadcast between the pools"),
    )
}

#: Keys of this section that name features not built.
NOT_SUPPORTED: dict[str, str] = {
    "async_training.use_dynamic_resource_scheduling": ("verl 0.9.1's dynamic resource scheduling "
                                                       "(training GPUs lent to rollout)"),
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": (
        "a GPU memory share of the rollout pool's own (verl 0.9.1's fully-async config; null: "
        "`actor_rollout_ref.rollout.gpu_memory_utilization`)"),
}

#: Accepted only at verl's default.
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "async_training.use_dynamic_resource_scheduling": False,
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": None,
}


@dataclass(frozen=True)
class QueueBounds:
    """verl's sizes of the fully-async queue, all counted in prompts (one prompt = one sample of
    verl's rollouter, with its `actor_rollout_ref.rollout.n` responses: `data.gen_batch_size=1`)."""

    required_samples: int
    """Prompts per trainer update: `ppo_mini_batch_size` x `require_batches`."""
    max_required_samples: int
    """Prompts queued or in flight that the rollouter may hold before it pauses, between two syncs:
    int(required_samples x (staleness_threshold + 1) x trigger_parameter_sync_step)."""
    max_queue_size: int
    """The message queue's capacity (verl sets it to `max_required_samples`)."""
    total_train_steps: int
    """Trainer steps (each `trigger_parameter_sync_step` updates): int(total_rollout_steps /
    (required_samples x trigger_parameter_sync_step))."""

    trigger_parameter_sync_step: int
    """Trainer updates between two weight syncs."""

    @property
    def per_sync(self) -> int:
        """Prompts the trainer consumes between two weight syncs."""
        return self.required_samples * self.trigger_parameter_sync_step

    @property
    def ahead(self) -> int:
        """Prompts the rollouter may generate beyond those the trainer consumes before the next sync."""
        return self.max_required_samples - self.per_sync


def queue_bounds(ppo_mini_batch_size: int, async_cfg: AsyncTrainingConfig, total_rollout_steps: int) -> QueueBounds:
    """verl's `required_samples`, `max_required_samples`, `max_queue_size` and `total_train_steps`
    (`FullyAsyncRollouter.__init__` and `set_max_required_samples`, verl 0.9.1), the same `int()`
    truncations."""
    required = ppo_mini_batch_size * async_cfg.require_batches
    trigger = async_cfg.trigger_parameter_sync_step
    max_required = int(required * (async_cfg.staleness_threshold + 1) * trigger)
    return QueueBounds(required_samples=required, max_required_samples=max_required,
                       max_queue_size=max_required,
                       total_train_steps=int(total_rollout_steps / (required * trigger)),
                       trigger_parameter_sync_step=trigger)


def total_rollout_steps(cfg: Config, prompts: int) -> int:
    """Prompts the rollouter generates in all over a dataset of `prompts`: every prompt once per
    epoch, capped by `rollout.total_rollout_steps` (`FullyAsyncRollouter.__init__`:
    `len(train_dataloader) * trainer.total_epochs`, its dataloader handing out
    `data.gen_batch_size=1` prompt at a time)."""
    total = prompts * cfg.trainer.total_epochs
    cap = cfg.rollout.total_rollout_steps
    return total if cap is None else min(cap, total)


def has_rollout_pool(cfg: Config) -> bool:
    return cfg.rollout.nnodes > 0 or cfg.rollout.n_gpus_per_node > 0


def validate_pools(cfg: Config) -> None:
    """verl's assertions on the async keys (`FullyAsyncRollouter.__init__`), the pairing of a
    rollout pool with `hybrid_engine=false`, and a staleness bound the queue can reach. Raises
    ConfigError naming the fix."""
    a, pool = cfg.async_training, cfg.rollout
    require(a.staleness_threshold >= 0,
            f"`async_training.staleness_threshold={a.staleness_threshold}` must be 0 or more (verl asserts "
            "it): the samples the rollouter may generate ahead, as a share of one sync interval's. Fix: "
            "e.g. 0.1, verl's default")
    for key, value in (("trigger_parameter_sync_step", a.trigger_parameter_sync_step),
                       ("require_batches", a.require_batches),
                       ("concurrent_samples_per_replica", a.concurrent_samples_per_replica),
                       ("checkpoint_engine.device_buffer_size_M", a.checkpoint_engine.device_buffer_size_M)):
        require(value >= 1, f"`async_training.{key}={value}` must be at least 1")
    for key, value in (("rollout.nnodes", pool.nnodes), ("rollout.n_gpus_per_node", pool.n_gpus_per_node)):
        require(value >= 0, f"`{key}={value}` must be 0 (no rollout pool) or more")
    require(pool.total_rollout_steps is None or pool.total_rollout_steps >= 1,
            f"`rollout.total_rollout_steps={pool.total_rollout_steps}` must be at least 1, or null for "
            "the dataset times `trainer.total_epochs`")
    hybrid = cfg.actor_rollout_ref.hybrid_engine
    pool_size = pool.nnodes * pool.n_gpus_per_node
    require(hybrid or pool_size > 0,
            f"`actor_rollout_ref.hybrid_engine=false` asks for rollout replicas apart from the trainer, and "
            f"the rollout pool is empty (`rollout.nnodes={pool.nnodes}` x `rollout.n_gpus_per_node="
            f"{pool.n_gpus_per_node}`). Fix: give the pool its nodes and GPUs (e.g. `rollout.nnodes=1 "
            "rollout.n_gpus_per_node=8`), or drop `hybrid_engine=false` to generate on the training GPUs")
    if hybrid:
        _check_unused(cfg.async_training)
    require(not hybrid or not has_rollout_pool(cfg),
            f"`rollout.nnodes={pool.nnodes}` x `rollout.n_gpus_per_node={pool.n_gpus_per_node}` is a rollout "
            "pool of its own, which only the separate deployment uses; with "
            "`actor_rollout_ref.hybrid_engine=true` the rollout shares the training GPUs. Fix: add "
            "`actor_rollout_ref.hybrid_engine=false`, or set `rollout.nnodes=0 rollout.n_gpus_per_node=0`")
    gen, train = cfg.data.gen_batch_size, cfg.data.train_batch_size
    require(gen in (None, train) or (gen == 1 and not hybrid),
            f"`data.gen_batch_size={gen}`: a generation batch apart from `data.train_batch_size={train}` is "
            "built only as verl's fully-async rollouter uses it (1: one prompt at a time, with a rollout "
            "pool). Fix: remove the override (null: the generation batch is the training batch)")
    if not hybrid:
        _check_reachable(cfg)


DEFAULTS_FILE = Path(__file__).with_name("async_training.yaml")


def _changed(given: dict[str, Any], default: dict[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for key, value in default.items():
        if isinstance(value, dict):
            out += _changed(given[key], value, f"{prefix}{key}.")
        elif given[key] != value:
            out.append(f"{prefix}{key}={given[key]}")
    return out


def _check_unused(a: AsyncTrainingConfig) -> None:
    """The colocated trainer (`hybrid_engine=true`) has no queue, no staleness and no sync
    between pools: an `async_training.*` value away from its default would be read by nothing,
    so it is refused (verl's own `ppo_trainer` has no such section at all)."""
    default = yaml.safe_load(DEFAULTS_FILE.read_text())["async_training"]
    changed = _changed(asdict(a), default, "async_training.")
    if changed:
        raise ConfigError(
            f"`{changed[0]}`{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''} sets verl's "
            "asynchronous training, which acts only with a rollout pool of its own: the colocated trainer "
            "(`actor_rollout_ref.hybrid_engine=true`) generates and trains in turn, with no queue. Fix: "
            "`actor_rollout_ref.hybrid_engine=false rollout.nnodes=N rollout.n_gpus_per_node=G` (verl's "
            "async recipes), or remove the override")


LOOPS = ("sync", "one_step_off", "fully_async")
"""The trainer's loops, each with its entry: `python -m trainer` (the colocated, synchronous
one), `python -m trainer.one_step_off`, `python -m trainer.fully_async`."""

ENTRY = {"sync": "python -m trainer", "one_step_off": "python -m trainer.one_step_off",
         "fully_async": "python -m trainer.fully_async"}

#: What an entry's own config file sets beneath the command line's overrides, as verl's entry
#: composes its file (`@hydra.main(config_name=...)`) when no `--config-name` is given: verl
#: 0.9.1's `one_step_off_ppo_trainer.yaml` (the pool's size, the engine kept awake, the rollout's
#: log-probs computed and used as the old ones), less `rollout.checkpoint_engine.backend=nccl`: here
#: `naive` and `nccl` act alike (the pools sync by the collective broadcast of
#: `trainer.stages.sync.sync_pool` either way), and leaving it out spares every run its note.
ENTRY_DEFAULTS: dict[str, tuple[str, ...]] = {
    "sync": (),
    "one_step_off": ("rollout.nnodes=1", "rollout.n_gpus_per_node=8", "actor_rollout_ref.rollout.free_cache_engine=false",
                     "actor_rollout_ref.rollout.calculate_log_probs=true",
                     "algorithm.rollout_correction.bypass_mode=true"),
    # verl 0.9.1's `fully_async_ppo_trainer.yaml`, less `checkpoint_engine.backend=nccl` (as above),
    # with verl's `rollout.mode=async` (the default of verl's `ppo_trainer`, not of this one) and
    # its `async_training.*` (already this trainer's defaults, `async_training.yaml`)
    "fully_async": ("rollout.nnodes=1", "rollout.n_gpus_per_node=8", "rollout.n=4", "rollout.total_rollout_steps=100",
                    "data.gen_batch_size=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
                    "actor_rollout_ref.rollout.mode=async", "algorithm.rollout_correction.bypass_mode=true"),
}


def check_separate_pools_built(cfg: Config, loop: str = "sync") -> None:
    """At the trainer's start: the loop of the entry that started it (`loop`) fits the config.
    A rollout pool runs under one-step-off (built) or fully async (not built); the colocated
    trainer runs under the synchronous loop. Raises ConfigError naming the entry to use."""
    if loop not in LOOPS:
        raise ValueError(f"unknown loop {loop!r}; one of {', '.join(LOOPS)}")
    pool = f"`rollout.nnodes={cfg.rollout.nnodes}` x `rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node}`"
    if loop == "sync":
        require(cfg.actor_rollout_ref.hybrid_engine,
                f"`actor_rollout_ref.hybrid_engine=false` with a rollout pool of {pool} asks for verl's "
                "separate deployment, which the synchronous loop does not run. Fix: start it with "
                f"`{ENTRY['one_step_off']}` (the same arguments: verl's `one_step_off_policy.main_ppo`; "
                "`hpcrl submit --loop one-step-off`), "
                "or drop `hybrid_engine=false` and the `rollout.*` overrides to train colocated")
        return
    arr = cfg.actor_rollout_ref
    require(not arr.hybrid_engine,
            f"`{ENTRY[loop]}` generates on a rollout pool of its own, and this config has none "
            "(`actor_rollout_ref.hybrid_engine=true`). Fix: `actor_rollout_ref.hybrid_engine=false "
            "rollout.nnodes=N rollout.n_gpus_per_node=G` (verl's one-step-off scripts), or start with "
            f"`{ENTRY['sync']}` to train colocated")
    if loop == "fully_async":
        _check_fully_async(cfg)
    else:
        _check_one_step_off(cfg)
    require(arr.rollout.tensor_model_parallel_size == 1,
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size={arr.rollout.tensor_model_parallel_size}` "
            "on a rollout pool: each pool rank is an engine of its own here; tensor-parallel engines in a "
            "pool are not built. Fix: `actor_rollout_ref.rollout.tensor_model_parallel_size=1`")
    require(cfg.trainer.distributed is not False,
            "a rollout pool runs on Ray (its own processes and GPUs), and `trainer.distributed=false` "
            "keeps the trainer in this process. Fix: remove `trainer.distributed=false`")
    require(not registry.adv_estimator(cfg.algorithm.adv_estimator).greedy_baseline,
            f"`algorithm.adv_estimator={cfg.algorithm.adv_estimator}` scores a greedy baseline with the "
            "weights that sampled each batch; on a rollout pool one step behind that is not built. Fix: "
            "another estimator (e.g. grpo), or the colocated trainer")


def _check_one_step_off(cfg: Config) -> None:
    gen = cfg.data.gen_batch_size
    require(gen in (None, cfg.data.train_batch_size),
            f"`data.gen_batch_size={gen}` feeds verl's fully-async rollouter one prompt at a time; one-step-off "
            f"generates a whole training batch (`data.train_batch_size={cfg.data.train_batch_size}`) ahead. "
            f"Fix: remove the override, or start with `{ENTRY['fully_async']}`")
    default = yaml.safe_load(DEFAULTS_FILE.read_text())["async_training"]
    changed = _changed(asdict(cfg.async_training), default, "async_training.")
    require(not changed,
            f"`{changed[0] if changed else ''}`: verl's one-step-off reads no `async_training.*` (its queue, "
            "staleness and sync interval belong to the fully-async recipe): one-step-off syncs after every "
            f"step and trains each batch one step behind. Fix: remove the override, or start with "
            f"`{ENTRY['fully_async']}`")


def _check_fully_async(cfg: Config) -> None:
    """verl's assertions when its fully-async rollouter starts (`FullyAsyncRollouter.__init__`,
    `_init_async_rollout_manager`, verl 0.9.1), and what is not built here."""
    d, a, arr = cfg.data, cfg.async_training, cfg.actor_rollout_ref
    require(d.train_batch_size == 0,
            f"`data.train_batch_size={d.train_batch_size}`: verl's fully-async trainer takes `ppo_mini_batch_size` "
            "x `async_training.require_batches` prompts per update from its queue, not training batches, and "
            "asserts `data.train_batch_size=0` ('train_batch_size must be zero'). Fix: `data.train_batch_size=0`")
    require(d.gen_batch_size == 1,
            f"`data.gen_batch_size={d.gen_batch_size}`: verl's fully-async rollouter hands out one prompt at a "
            "time and asserts it ('gen_batch_size must be one'). Fix: `data.gen_batch_size=1`")
    require(arr.rollout.calculate_log_probs,
            "`actor_rollout_ref.rollout.calculate_log_probs=false`: verl's fully-async rollouter asserts it is "
            "true ('must rollout calculate log_probs'): each sample keeps the log-probs of the weights that "
            "generated it. Fix: `actor_rollout_ref.rollout.calculate_log_probs=true`")
    require(arr.rollout.mode == "async",
            f"`actor_rollout_ref.rollout.mode={arr.rollout.mode}`: verl's fully-async rollouter runs agent loops "
            "and asserts `mode=async`. Fix: `actor_rollout_ref.rollout.mode=async` (the pool's ranks run "
            "their engines in-process, the loops' turns batched into them)")
    # `partial_rollout` (verl's default): built for single-turn rows on the HF engine and vLLM's in-process one
    # (`trainer.async_rl.partial`)
    require(not a.partial_rollout or not arr.rollout.multi_turn.enable,
            "`async_training.partial_rollout=true` with `actor_rollout_ref.rollout.multi_turn.enable=true` is not "
            "built: a multi-turn trajectory paused at a weight sync cannot be continued between its turns. Fix: "
            "`async_training.partial_rollout=false`")
    require(cfg.algorithm.rollout_correction.bypass_mode or a.trigger_parameter_sync_step == 1,
            f"`algorithm.rollout_correction.bypass_mode=false` with `async_training.trigger_parameter_sync_step="
            f"{a.trigger_parameter_sync_step}`: verl then recomputes the old log-probs of every update with "
            "the weights of the sync interval's first update (kept on the host, `save_model_to_cpu`), which "
            "is not built. Fix: `algorithm.rollout_correction.bypass_mode=true` (verl's fully-async default: "
            "the rollout's log-probs are the old ones), or `trigger_parameter_sync_step=1`")
    steps = cfg.trainer.total_training_steps
    require(steps is None,
            f"`trainer.total_training_steps={steps}`: verl's fully-async trainer reads none; its run is "
            "int(`rollout.total_rollout_steps` / (`ppo_mini_batch_size` x `require_batches` x "
            "`trigger_parameter_sync_step`)) steps, `total_rollout_steps` capped by the data times "
            "`trainer.total_epochs`. Fix: set `rollout.total_rollout_steps` (prompts) instead")
    for key, built in (("compute_prox_log_prob", not a.compute_prox_log_prob),
                       ("use_trainer_do_validate", not a.use_trainer_do_validate)):
        require(built, f"`async_training.{key}=true` is not built. Fix: `async_training.{key}=false`")


def _check_reachable(cfg: Config) -> None:
    """A positive staleness threshold whose `int()` in verl's `max_required_samples` leaves no
    prompt to generate ahead: the queue then never holds a stale sample, and the bound the user
    set is never reached. Refused, with the smallest threshold that allows one prompt ahead."""
    a = cfg.async_training
    if a.staleness_threshold == 0:
        return
    b = queue_bounds(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, a, 1)
    per_sync = b.per_sync
    require(b.ahead > 0,
            f"`async_training.staleness_threshold={a.staleness_threshold}` allows no prompt ahead: the queue "
            f"holds int({b.required_samples} x (1 + {a.staleness_threshold}) x {a.trigger_parameter_sync_step}) "
            f"= {b.max_required_samples} prompts (verl's `max_required_samples`), exactly the {per_sync} the "
            "trainer takes between two syncs (`ppo_mini_batch_size` x `require_batches` x "
            "`trigger_parameter_sync_step`), so the bound is never reached. Fix: "
            f"`async_training.staleness_threshold` >= {1 / per_sync:.4g} (one prompt ahead), or 0 for none")


def check_allocation(cfg: Config, env: Mapping[str, str]) -> None:
    """Both pools fit the job hpcrl launched: `trainer.nnodes` + `rollout.nnodes` nodes of the
    `HPCRL_NUM_NODES` allocated, and a pool's GPUs per node within `HPCRL_GPUS_PER_NODE` (each pool
    holds nodes of its own, as verl's `ResourcePoolManager` places `trainer_pool` and
    `rollout_pool`). Outside hpcrl (no `HPCRL_NUM_NODES`) nothing is known to check."""
    if not has_rollout_pool(cfg) or "HPCRL_NUM_NODES" not in env:
        return
    nodes = int(env["HPCRL_NUM_NODES"])
    t, r = cfg.trainer, cfg.rollout
    require(t.nnodes + r.nnodes <= nodes,
            f"the pools need `trainer.nnodes={t.nnodes}` + `rollout.nnodes={r.nnodes}` = {t.nnodes + r.nnodes} "
            f"nodes, and the job has {nodes}. Fix: submit with --nodes {t.nnodes + r.nnodes}, or shrink "
            "one of the pools")
    gpus = env.get("HPCRL_GPUS_PER_NODE")
    if gpus is not None and int(gpus) > 0:
        require(r.n_gpus_per_node <= int(gpus),
                f"`rollout.n_gpus_per_node={r.n_gpus_per_node}` is more than the {gpus} GPUs per node the "
                f"job asked for. Fix: `rollout.n_gpus_per_node={gpus}` or fewer")
