"""Starting a run's worker groups: the actor group, the critic group and the rollout pool's
group, on Ray across the job's nodes or in this process (:func:`start_worker_groups`), with the
models they read resolved first (:func:`fetch_models`). Every loop's driver starts them so."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from trainer import flight_recorder as FR
from trainer import models as M
from trainer import startup
from trainer.config import Config
from trainer.config.async_training import has_rollout_pool
from trainer.memplan import plan_config
from trainer.run_state import run_dir_of
from trainer.watchdog import WATCHDOG_DIR, Bounds
from trainer.workers.actor import ActorRolloutRefWorker
from trainer.workers.critic import CriticWorker
from trainer.workers.group import LocalWorkerGroup, WorkerGroup
from trainer.workers.memory_samples import MEMORY_DIR
from trainer.workers.ray_group import RayWorkerGroup, connect, make_pools, start_colocated
from trainer.workers.rollout_pool import RolloutWorker

__all__ = ["WorkerGroups", "fetch_models", "start_worker_groups", "use_ray"]


def use_ray(cfg: Config) -> bool:
    """`trainer.distributed`, or when null: Ray as soon as there is more than one worker."""
    chosen = cfg.trainer.distributed
    if chosen is None and has_rollout_pool(cfg):  # the pool's ranks are processes of their own
        return True
    return bool(chosen) if chosen is not None else cfg.derived.world_size > 1


def fetch_models(cfg: Config) -> None:
    """Resolve every model path now, in the driver: a hub id is found in the Hugging Face cache,
    or downloaded into it where the hub is reachable, before the workers (offline) read it."""
    paths = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path,
             "data.tokenizer": cfg.data.tokenizer}
    if cfg.derived.use_critic:
        paths["critic.model.path"] = cfg.critic.model.path
    for key, path in paths.items():
        if path:
            M.resolve_model_path(path, key)


class WorkerGroups(NamedTuple):
    actor: WorkerGroup
    critic: WorkerGroup | None
    """None without a critic."""
    pool: WorkerGroup | None
    """The rollout pool's ranks (a separate deployment), or None."""
    where: str
    """Where they run, in words."""


def start_worker_groups(cfg: Config, total_steps: int, clock: startup.Clock) -> WorkerGroups:
    """The actor group, the critic group and the rollout pool's group, on Ray or in this
    process, with their process groups formed. The pool (`rollout.nnodes` x
    `rollout.n_gpus_per_node`, verl's `rollout_pool`) is placed on nodes of its own, beside the
    trainer's (`trainer_pool`)."""
    pool: WorkerGroup | None = None
    if not use_ray(cfg):
        actor: WorkerGroup = LocalWorkerGroup("actor_rollout_ref", ActorRolloutRefWorker, cfg, total_steps)
        critic: WorkerGroup | None = (LocalWorkerGroup("critic", CriticWorker, cfg, total_steps)
                                      if cfg.derived.use_critic else None)
        where, watched = "this process", []
    else:
        t, world, r = cfg.trainer, cfg.derived.world_size, cfg.rollout
        pool_size = r.nnodes * r.n_gpus_per_node if has_rollout_pool(cfg) else 0
        where = f"Ray at {connect(world + pool_size)}"
        clock.mark("ray_connected")
        tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        slots = make_pools([(t.nnodes, world // t.nnodes)] + ([(r.nnodes, r.n_gpus_per_node)] if pool_size else []), tp)
        roles: dict[str, type] = {"actor_rollout_ref": ActorRolloutRefWorker,
                                  **({"critic": CriticWorker} if cfg.derived.use_critic else {})}
        run_dir = run_dir_of(cfg)
        stacks = run_dir / "stacks" if t.watchdog.enable else None
        traces = run_dir / FR.TRACE_DIR if t.watchdog.enable else None  # flight-recorder dumps
        groups = start_colocated(roles, cfg, total_steps, slot=slots[0], world_size=world, stacks=stacks,
                                 traces=traces)
        actor, critic = groups["actor_rollout_ref"], groups.get("critic")
        watched = list(groups.values())
        if pool_size:  # its ranks' stacks and memory samples in folders of their own
            pool = start_colocated({"rollout": RolloutWorker}, cfg, total_steps, slot=slots[1], world_size=pool_size,
                                   stacks=stacks / "rollout" if stacks else None,
                                   traces=traces / "rollout" if traces else None,
                                   samples=run_dir / MEMORY_DIR / "rollout",
                                   control=cfg.async_training.partial_rollout)["rollout"]
            watched.append(pool)
    clock.mark("workers_spawned")
    for group in (actor, critic, pool):
        if group is not None:
            group.init_dist()
    for group in (actor, critic, pool):  # a rank out of GPU memory is named with the plan's figure
        if isinstance(group, RayWorkerGroup):
            group.device_plan = partial(plan_config, cfg)
    w = cfg.trainer.watchdog
    for ray_group in watched if w.enable else []:  # from the first step: a large model may load for longer
        ray_group.watchdog = Bounds.load(run_dir_of(cfg) / WATCHDOG_DIR / f"{ray_group.name}.json", floor_s=w.floor_s,
                                         multiple=w.multiple, min_s=w.min_s, warmup=w.warmup, poll_s=w.poll_s)
    clock.mark("models_built")
    return WorkerGroups(actor, critic, pool, where)
