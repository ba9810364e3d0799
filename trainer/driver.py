"""The PPO driver: one loop for one rank in this process or many ranks on Ray.

The driver keeps the loop and its state (the step, the data position, the KL controller, the
stop request); each stage of a step is a unit of its own in :mod:`trainer.stages`, which the
driver only orders. The models live in worker groups (:mod:`trainer.workers`): actor +
reference + rollout, and the critic when the estimator needs one. A group is one rank in this
process (:class:`~trainer.workers.group.LocalWorkerGroup`, the embedded default) or one Ray
actor per rank across the nodes (:class:`~trainer.workers.ray_group.RayWorkerGroup`); the loop
is the same. It reads top to bottom:
`resume -> for step: rollout -> reward -> old/ref log-probs, values -> advantages -> critic update
-> actor update -> weight sync -> metrics -> maybe validate -> maybe checkpoint -> stop if asked`.

Data flow per step: the prompts are left-padded together and split into contiguous parts, one per
rank; log-probs and values are computed on row shards; for the updates the driver forms the
shuffled mini-batches, drops the rows whose loss has no gradient, and gives every rank its share
of each with the loss normalisers of the whole mini-batch, so the update does not depend on the
number of ranks. Per-rank metrics (`dp/rank_<r>/...`) show every rank working;
`<run_dir>/workers.json` maps ranks to nodes.

A stop request (SIGUSR2/SIGTERM or `<run_dir>/STOP`) ends the run after the current step with a
checkpoint and `REQUEUE_EXIT_CODE`; the next run resumes from it, on any number of ranks.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from trainer import models as M
from trainer import startup
from trainer.agent.manager import agent_data_args
from trainer.algos import core_algos, registry
from trainer.batch import StepBatch, need, seed_everything, step_seed
from trainer.checkpoint import full_state as ckpt
from trainer.config import Config, check_run, config_to_dict, dump_config
from trainer.data import Example, PromptDataset, PromptLoader
from trainer.deadline import Deadline
from trainer.exit_codes import OK_EXIT_CODE, REQUEUE_EXIT_CODE
from trainer.metrics import (
    METRICS_FILE,
    MetricsLogger,
    last_step,
    rollout_probs_diff,
)
from trainer.mlflow_tracking import import_mlflow, tracking_uri
from trainer.stages import checkpoint, logprobs, update
from trainer.stages.advantage import compute_advantages
from trainer.stages.dump import ValidationDump, dump_rollout
from trainer.stages.logprobs import entropy_metric, reuses_update_log_probs, split_batch
from trainer.stages.metrics import Timer, memory_metrics, step_metrics
from trainer.stages.reward import build_reward_engine, set_reward_baselines
from trainer.stages.rollout import SALT, Rollout
from trainer.stages.sync import sync_weights
from trainer.stages.validate import VAL_GENERATIONS_FILE, log_generations, validate
from trainer.stop import StopRequest
from trainer.workers.actor import ActorRolloutRefWorker
from trainer.workers.critic import CriticWorker
from trainer.workers.group import LocalWorkerGroup, WorkerGroup
from trainer.workers.ray_group import connect, make_placement_group, start_colocated

__all__ = ["VAL_GENERATIONS_FILE", "PPODriver", "fetch_models", "launcher_restart", "run_training", "use_ray"]



def use_ray(cfg: Config) -> bool:
    """`trainer.distributed`, or when null: Ray as soon as there is more than one worker."""
    chosen = cfg.trainer.distributed
    return bool(chosen) if chosen is not None else cfg.derived.world_size > 1


def launcher_restart() -> int:
    """Which run of the job this is (`HPCRL_RESTART`, set by hpcrl's node agent; 0 otherwise):
    recorded with each step so that plots can mark where a run resumed."""
    raw = os.environ.get("HPCRL_RESTART", "")
    return int(raw) if raw.strip().isdigit() else 0


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


def start_worker_groups(cfg: Config, total_steps: int, clock: startup.Clock
                        ) -> tuple[WorkerGroup, WorkerGroup | None, str]:
    """The actor group and the critic group (None without a critic), on Ray or in this
    process, with their process groups formed; and where they run, in words."""
    if not use_ray(cfg):
        actor: WorkerGroup = LocalWorkerGroup("actor_rollout_ref", ActorRolloutRefWorker, cfg, total_steps)
        critic: WorkerGroup | None = (LocalWorkerGroup("critic", CriticWorker, cfg, total_steps)
                                      if cfg.derived.use_critic else None)
        where = "this process"
    else:
        t, world = cfg.trainer, cfg.derived.world_size
        where = f"Ray at {connect(world)}"
        clock.mark("ray_connected")
        slot = make_placement_group(t.nnodes, world // t.nnodes,
                                    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
        roles: dict[str, type] = {"actor_rollout_ref": ActorRolloutRefWorker,
                                  **({"critic": CriticWorker} if cfg.derived.use_critic else {})}
        groups = start_colocated(roles, cfg, total_steps, slot=slot, world_size=world)
        actor, critic = groups["actor_rollout_ref"], groups.get("critic")
    clock.mark("workers_spawned")
    for group in (actor, critic):
        if group is not None:
            group.init_dist()
    clock.mark("models_built")
    return actor, critic, where


class PPODriver:
    """The loop, the data and the algorithm state of one run; the models live in worker groups."""

    def __init__(self, cfg: Config, stop: StopRequest | None = None) -> None:
        check_run(cfg)  # verl's start-time checks, before anything is loaded
        self.cfg = cfg
        self.clock = startup.Clock()
        t = cfg.trainer
        self.ckpt_root = Path(t.default_local_dir or ".")
        self.run_dir = Path(t.run_dir) if t.run_dir else self.ckpt_root
        if cfg.actor_rollout_ref.rollout.trace.backend == "mlflow":  # missing: stop before any model loads
            import_mlflow("`actor_rollout_ref.rollout.trace.backend=mlflow`")
        self._run: ckpt.RunIdentity | None = None
        seed_everything(t.seed)
        fetch_models(cfg)
        self._reward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        tokenizer_path, tokenizer_trust = cfg.tokenizer_source
        self.tokenizer = M.load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trust)
        self.reward = build_reward_engine(cfg, self.tokenizer)
        self._build_data()
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.stop = stop or StopRequest()
        self.stop.watch(self.run_dir)
        self.deadline = Deadline.from_env(os.environ, t.deadline_margin_s)
        self.global_step = 0
        self.rank_metrics: dict[str, float] = {}
        start = time.perf_counter()
        self.actor_group, self.critic_group, where = start_worker_groups(cfg, self.total_steps, self.clock)
        self.world = self.actor_group.world_size
        if hasattr(self.reward, "attach"):  # a reward model colocated with the actor
            self.reward.attach(self.actor_group)
        self.rollout = Rollout(cfg, self.actor_group, self.tokenizer.pad_token_id)
        if cfg.actor_rollout_ref.rollout.trace.backend == "mlflow":  # the metrics logger's store
            self.rollout.trace_store = tracking_uri(self.run_dir)
        self._write_workers()
        hosts = len({n["hostname"] for n in self.actor_group.nodes})
        self.clock.mark("driver_ready")
        print(f"trainer: {self.world} rank(s) on {hosts} node(s) in {where}, ready in "
              f"{time.perf_counter() - start:.1f}s", flush=True)

    # ------------------------------------------------------------------------------ set-up

    def _build_data(self) -> None:
        data = self.cfg.data
        common: dict[str, Any] = {"max_prompt_length": data.max_prompt_length, "prompt_key": data.prompt_key,
                                  "reward_fn_key": data.reward_fn_key,
                                  "filter_overlong_prompts": data.filter_overlong_prompts,
                                  "truncation": data.truncation,
                                  "chat_template_kwargs": data.apply_chat_template_kwargs,
                                  **agent_data_args(self.cfg)}
        self.train_set = PromptDataset(data.train_files, self.tokenizer, **common)
        self.loader = PromptLoader(self.train_set, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
        t = self.cfg.trainer
        needs_val = t.val_before_train or t.test_freq > 0 or t.val_only
        self.val_set = PromptDataset(data.val_files, self.tokenizer, **common) if needs_val else None
        per_epoch = self.loader.batches_per_epoch * t.total_epochs
        self.total_steps = t.total_training_steps or per_epoch

    def _groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor_group, self.critic_group) if g is not None]

    def _write_workers(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        layout = {g.name: g.nodes for g in self._groups()}
        (self.run_dir / "workers.json").write_text(json.dumps(layout, indent=1))

    def _note(self, phase: str, per_rank: list[float]) -> float:
        """Record a per-rank figure (`dp/rank_<r>/<phase>`); return the largest."""
        for rank, value in enumerate(per_rank):
            self.rank_metrics[f"dp/rank_{rank}/{phase}"] = float(value)
        return max(per_rank) if per_rank else 0.0

    # ------------------------------------------------------------------------------ phases

    def generate(self, examples: list[Example], validate: bool = False, greedy: bool = False) -> StepBatch:
        """The rollout stage (:class:`trainer.stages.rollout.Rollout`) at this step."""
        return self.rollout.generate(examples, self.global_step, self._note, validate=validate, greedy=greedy)

    def compute_rewards(self, batch: StepBatch) -> dict[str, float]:
        """The reward stage: the run's reward engine (:class:`trainer.stages.reward.RewardEngine`)."""
        return self.reward.score(batch)

    def _split(self, batch: StepBatch) -> list[list[int]]:
        """Rows of each rank (:func:`trainer.stages.logprobs.split_batch`)."""
        return split_batch(batch, self.world, self.cfg.trainer.balance_batch)

    def compute_reward_baselines(self, examples: list[Example], batch: StepBatch) -> None:
        """ReMax's baseline (verl ray_trainer `gen_max`): each prompt's greedy response, generated
        with the weights that sampled `batch` and scored like it; its score is the baseline of
        every row of that prompt."""
        greedy = self.generate(examples, greedy=True)
        self.compute_rewards(greedy)
        set_reward_baselines(batch, greedy)

    def reuses_update_log_probs(self, batch: StepBatch) -> bool:
        """Whether the actor update supplies the old log-probs itself
        (:func:`trainer.stages.logprobs.reuses_update_log_probs`)."""
        return reuses_update_log_probs(self.cfg, batch)

    def _entropy_metric(self, entropy: torch.Tensor, response_mask: torch.Tensor) -> float:
        return entropy_metric(entropy, response_mask, self.cfg.actor_rollout_ref.actor.loss_agg_mode)

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        agg, bypass = self.cfg.actor_rollout_ref.actor.loss_agg_mode, self.cfg.algorithm.rollout_correction.bypass_mode
        return logprobs.old_log_probs(batch, self.actor_group, self._split(batch), agg, self._note, bypass)

    def compute_ref_log_probs(self, batch: StepBatch) -> None:
        logprobs.ref_log_probs(batch, self.actor_group, self._split(batch), self._note)

    def compute_values(self, batch: StepBatch) -> None:
        assert self.critic_group is not None
        logprobs.values(batch, self.critic_group, self._split(batch), self._note)

    def compute_advantages(self, batch: StepBatch) -> dict[str, float]:
        """The advantage stage (:func:`trainer.stages.advantage.compute_advantages`); PF-PPO's
        redraw is seeded by the run's seed and the step."""
        seed = step_seed(self.cfg.trainer.seed, self.global_step, SALT["pf_ppo"])
        return compute_advantages(batch, self.cfg.algorithm, self.kl_ctrl, pf_ppo_seed=seed)

    # ------------------------------------------------------------------------------ updates

    def _batcher(self) -> update.MiniBatcher:
        t = self.cfg.trainer
        return update.MiniBatcher(self.world, self._split, t.seed, self.global_step,
                                  model_engine=t.use_legacy_worker_impl == "disable")

    def _keeps_every_row(self, keep_entropy: bool) -> bool:
        """Whether the actor update computes every row (:func:`trainer.stages.update.keeps_every_row`)."""
        return update.keeps_every_row(self.cfg, keep_entropy)

    @staticmethod
    def _rows_to_update(mini: StepBatch) -> list[int]:
        """Rows of `mini` whose loss has a gradient (:func:`trainer.stages.update.rows_to_update`)."""
        return update.rows_to_update(mini)

    def update_critic(self, batch: StepBatch) -> dict[str, float]:
        assert self.critic_group is not None
        return update.update_critic(batch, self.critic_group, self.cfg, self._batcher(), self._note)

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        every_row = self._keeps_every_row(update.measures_entropy(batch))
        return update.update_actor(batch, self.actor_group, self.cfg, self._batcher(), self._note,
                                   skip=None if every_row else lambda mini: self._rows_to_update(mini))

    def sync_weights(self) -> None:
        """The sync stage (:func:`trainer.stages.sync.sync_weights`)."""
        sync_weights(self.actor_group, self._note)

    # ------------------------------------------------------------------------------ validation

    def validate(self) -> dict[str, float]:
        """The validation stage (:func:`trainer.stages.validate.validate`); the generations it
        keeps are logged."""
        assert self.val_set is not None
        dump = ValidationDump(self.cfg.trainer.validation_data_dir, self.tokenizer)
        metrics, samples = validate(
            self.val_set, self.cfg.data.val_batch_size, lambda examples: self.generate(examples, validate=True),
            dump.scoring(self.compute_rewards), self.tokenizer, self.global_step, self.cfg.trainer.log_val_generations)
        dump.write(self.global_step)
        if samples:
            log_generations(self.run_dir, samples, "console" in self.cfg.trainer.logger)
        return metrics

    # ------------------------------------------------------------------------------ one step

    def _collect(self, batch: StepBatch, timer: Timer) -> dict[str, float]:
        """Everything between rollout and the updates (reward, log-probs, values, advantages)."""
        metrics: dict[str, float] = {}
        rewards: Future[dict[str, float]] | None = None
        if self.cfg.reward_model.launch_reward_fn_async:  # scored while the workers compute
            rewards = self._reward_thread.submit(self.compute_rewards, batch)
        else:
            with timer.phase("reward"):
                metrics.update(self.compute_rewards(batch))
        if not self.reuses_update_log_probs(batch):
            with timer.phase("old_log_prob"):
                metrics.update(self.compute_old_log_probs(batch))
            if batch.rollout_log_probs is not None and batch.old_log_probs is not batch.rollout_log_probs:
                metrics.update(rollout_probs_diff(
                    batch.rollout_log_probs, need(batch.old_log_probs, "old_log_probs"), batch.response_mask))
        elif batch.entropy is not None:  # the rollout's entropies stand in for recomputed ones
            metrics["actor/entropy"] = self._entropy_metric(batch.entropy, batch.response_mask)
        if self.cfg.derived.use_reference:
            with timer.phase("ref"):
                self.compute_ref_log_probs(batch)
        if self.cfg.derived.use_critic:
            with timer.phase("values"):
                self.compute_values(batch)
        if rewards is not None:
            with timer.phase("reward"):  # only the wait for the scoring thread
                metrics.update(rewards.result())
        with timer.phase("adv"):
            metrics.update(self.compute_advantages(batch))
        return metrics

    def _update(self, batch: StepBatch, timer: Timer) -> dict[str, float]:
        """Critic update, actor update (after `critic_warmup` steps), weight sync."""
        metrics: dict[str, float] = {}
        if self.cfg.derived.use_critic:
            with timer.phase("update_critic"):
                metrics.update(self.update_critic(batch))
        if self.cfg.trainer.critic_warmup <= self.global_step:
            with timer.phase("update_actor"):
                metrics.update(self.update_actor(batch))
            with timer.phase("update_weights"):  # verl's name for the weight sync
                self.sync_weights()
        return metrics

    def _step_metrics(self, batch: StepBatch, timer: Timer) -> dict[str, float]:
        """The metrics stage's step metrics, the ranks' figures and the run's progress."""
        metrics = step_metrics(batch, timer.seconds, self.cfg.data, self.world)
        metrics.update(self.rollout.agent_metrics)
        metrics.update(self.rank_metrics)
        metrics.update({"training/global_step": self.global_step, "training/epoch": self.loader.epoch,
                        "training/total_steps": self.total_steps, "training/restart": launcher_restart()})
        return metrics

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        """One PPO step on a batch of prompts; returns its metrics (verl names)."""
        torch.manual_seed(step_seed(self.cfg.trainer.seed, self.global_step))
        self.rank_metrics = {}
        timer = Timer()
        with timer.phase("step"):
            with timer.phase("gen"):
                batch = self.generate(examples)
            if registry.adv_estimator(self.cfg.algorithm.adv_estimator).greedy_baseline:
                with timer.phase("gen_max"):
                    self.compute_reward_baselines(examples, batch)
            self.clock.mark("first_rollout")
            metrics = self._collect(batch, timer)
            if self.cfg.trainer.rollout_data_dir:  # verl dumps after the advantages, before the updates
                dump_rollout(self.cfg.trainer.rollout_data_dir, self.global_step, batch, self.tokenizer)
            metrics.update(self._update(batch, timer))
        metrics.update(self._step_metrics(batch, timer))
        metrics.update(self.memory_metrics())
        return metrics

    def memory_metrics(self) -> dict[str, float]:
        """Peak device memory over every group's ranks (:func:`trainer.stages.metrics.memory_metrics`)."""
        return memory_metrics(self._groups())

    # ------------------------------------------------------------------------------ checkpoints

    @property
    def run(self) -> ckpt.RunIdentity:
        """This run (its run directory's persisted id): whose checkpoints it resumes and prunes."""
        if self._run is None:
            self._run = ckpt.run_identity(self.run_dir)
        return self._run

    def save_checkpoint(self) -> Path:
        """`<default_local_dir>/global_step_N/` (:func:`trainer.stages.checkpoint.save`)."""
        return checkpoint.save(
            self.ckpt_root, self.global_step, self.run, self._groups(), self._trainer_state(),
            files={"config.yaml": dump_config(self.cfg)},
            metadata={"global_step": self.global_step, "epoch": self.loader.epoch, "world_size": self.world},
            keep_last=self.cfg.trainer.max_actor_ckpt_to_keep)

    def _trainer_state(self) -> dict[str, Any]:
        """What the driver owns: step, data position, KL controller, RNG (small, world-size free)."""
        return {"global_step": self.global_step, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "rng": ckpt.capture_rng_state(), "world_size": self.world}

    def load_checkpoint(self, path: Path) -> int | str:
        """Load a checkpoint written on any number of ranks; returns that number."""
        state = checkpoint.load(path, self.actor_group, self.critic_group, self.cfg.algorithm.adv_estimator)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.restore_rng_state(state["rng"])
        return state.get("world_size", "?")  # type: ignore[no-any-return]

    def resume(self) -> Path | None:
        """Load the checkpoint `trainer.resume_mode` selects and give the rollout its weights;
        return the checkpoint (None: fresh start)."""
        t = self.cfg.trainer
        start = time.perf_counter()
        path = ckpt.resolve_resume(self.ckpt_root, t.resume_mode, t.resume_from_path, run=self.run)
        others = ckpt.others_checkpoints(self.ckpt_root, self.run) if t.resume_mode == "auto" else []
        if others:
            print(f"trainer: note: `{self.ckpt_root}` also holds checkpoints of other runs "
                  f"({ckpt.describe_others(others)}); auto-resume takes only this run's "
                  f"(`{self.run.run_id}`)", flush=True)
        if path is not None:
            saved_on = self.load_checkpoint(path)
            print(f"trainer: resumed from {path} (step {self.global_step}) (saved on {saved_on} rank(s)) "
                  f"on {self.world} rank(s) in {time.perf_counter() - start:.1f}s", flush=True)
        self.sync_weights()
        return path

    # ------------------------------------------------------------------------------ the loop

    def _open_metrics(self, resumed: bool) -> MetricsLogger:
        t = self.cfg.trainer
        logged = last_step(self.run_dir / METRICS_FILE)
        if resumed or logged:  # a run killed before its first checkpoint starts over
            self._say_redone(logged)
        return MetricsLogger(self.run_dir, t.logger, keep_through=self.global_step if resumed else -1,
                             project=t.project_name, experiment=t.experiment_name,
                             config=config_to_dict(self.cfg))

    def _say_redone(self, logged: int) -> None:
        """How many steps the earlier run logged after the checkpoint resumed from (they are
        done again): 0 when it saved at its stop."""
        redo = max(0, logged - self.global_step)
        span = ("" if not redo else f" (step {logged})" if redo == 1
                else f" (steps {self.global_step + 1}-{logged})")
        print(f"trainer: {redo} step(s) redone{span}: the last run logged step {logged}, "
              f"its newest checkpoint is step {self.global_step}", flush=True)

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.global_step % freq == 0

    def fit(self) -> int:
        """Run to `total_steps` or to a stop request; return the process exit code."""
        t = self.cfg.trainer
        resumed = self.resume() is not None
        logger = self._open_metrics(resumed)
        owned = not self.stop.installed  # `python -m trainer` keeps its handlers to the end
        self.stop.install()
        try:
            if t.val_only:
                logger.log(self.global_step, self.validate())
                return 0
            if self.val_set is not None and t.val_before_train and not resumed:
                logger.log(self.global_step, self.validate())
            return self._loop(logger)
        finally:
            if owned:
                self.stop.uninstall()
            logger.close()

    def _stop_reason(self) -> str | None:
        """Why to stop after this step: a request, or the job's end time too near for another."""
        if self.stop.requested():
            return self.stop.reason()
        if self.deadline.reached():
            return self.deadline.describe()
        return None

    def _maybe_validate(self, metrics: dict[str, float]) -> None:
        t = self.cfg.trainer
        if self.val_set is not None and t.test_freq > 0 and (self._due(t.test_freq)
                                                             or self.global_step == self.total_steps):
            start = time.perf_counter()
            metrics.update(self.validate())
            metrics["timing_s/testing"] = time.perf_counter() - start

    def _maybe_save(self, stopping: str | None) -> None:
        if self._due(self.cfg.trainer.save_freq) or stopping or self.global_step == self.total_steps:
            start = time.perf_counter()
            path = self.save_checkpoint()
            self.deadline.record_save(time.perf_counter() - start)
            print(f"trainer: saved {path} in {time.perf_counter() - start:.1f}s", flush=True)

    def _loop(self, logger: MetricsLogger) -> int:
        while self.global_step < self.total_steps:
            began = time.time()
            examples = self.loader.next_batch()
            self.global_step += 1
            metrics = self.train_step(examples)
            self._maybe_validate(metrics)
            # Metrics first: a kill between the two leaves a line that resume drops, never a gap.
            logger.log(self.global_step, metrics)
            self.clock.mark("first_step")
            self.clock.write_once(self.run_dir)
            self.deadline.record_step(time.time() - began)
            stopping = self._stop_reason()
            self._maybe_save(stopping)
            if stopping:
                print(f"trainer: stop requested ({stopping}); checkpointed step "
                      f"{self.global_step}, exiting with {REQUEUE_EXIT_CODE} (please requeue)", flush=True)
                self.stop.clear_stop_file()
                return REQUEUE_EXIT_CODE
        return OK_EXIT_CODE


def run_training(cfg: Config, stop: StopRequest | None = None) -> int:
    """Build the driver and its worker groups from `cfg` (on Ray when `trainer.distributed`
    says so), run it, and shut a Ray connection down; the return value is the exit code.
    `stop`: a request whose handlers are already installed (`python -m trainer` does that)."""
    driver: PPODriver | None = None
    try:
        driver = PPODriver(cfg, stop)
        return driver.fit()
    finally:
        if driver is not None:
            driver.reward.close()
        if use_ray(cfg):
            import ray

            if ray.is_initialized():
                ray.shutdown()
