"""The stages of one PPO step over the run's worker groups, each a call of its own.

:class:`Stages` owns what a step needs and no loop: the worker groups, the rollout, the reward
engine, the KL controller, the per-rank figures. A training step is four calls, which a loop
makes in its own order: :meth:`Stages.begin` (the step's seed and timer), :meth:`Stages.sample`
(rollout, and ReMax's greedy baselines), :meth:`Stages.prepare` (reward, old and reference
log-probs, values, advantages, the rollout dump) and :meth:`Stages.update` (critic and actor
updates, weight sync); then :meth:`Stages.step_metrics`. The synchronous loop
(:class:`trainer.driver.PPODriver`) makes them in turn through :meth:`Stages.train_step`. Every
stage takes the step it belongs to, so an asynchronous loop may sample step k+1's batch while it
prepares and updates on step k's; the per-rank figures and the rollout's agent-loop metrics are
kept for the last step begun, not per step. Each stage itself lives in :mod:`trainer.stages`;
this class orders them and keeps their metrics under verl's names.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from trainer.algos import core_algos, registry
from trainer.batch import StepBatch, need, step_seed
from trainer.config import Config
from trainer.data import Example, PromptDataset
from trainer.metrics import rollout_probs_diff
from trainer.stages import logprobs, update
from trainer.stages.advantage import compute_advantages
from trainer.stages.dump import ValidationDump, dump_rollout
from trainer.stages.logprobs import entropy_metric, reuses_update_log_probs, split_batch
from trainer.stages.metrics import Timer, memory_metrics, step_metrics
from trainer.stages.reward import RewardEngine, set_reward_baselines
from trainer.stages.rollout import SALT, Rollout
from trainer.stages.sync import sync_pool, sync_weights
from trainer.stages.validate import log_generations, validate
from trainer.startup import Clock
from trainer.watchdog import at
from trainer.workers.group import WorkerGroup, while_alive

__all__ = ["Stages"]


class Stages:
    """One step's stages (rollout, reward, log-probs, values, advantages, updates, weight sync,
    metrics) over the actor group and the critic group (None without a critic)."""

    def __init__(self, cfg: Config, actor: WorkerGroup, critic: WorkerGroup | None, reward: RewardEngine,
                 tokenizer: Any, clock: Clock, pool: WorkerGroup | None = None) -> None:
        self.cfg, self.actor_group, self.critic_group, self.reward = cfg, actor, critic, reward
        self.tokenizer, self.clock = tokenizer, clock
        self.world = actor.world_size
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.pool = pool
        """The rollout pool's group (a separate deployment), or None: the actor's ranks generate."""
        # a pool's ranks run their engines in-process whatever `rollout.mode` says (agent loops
        # under `mode=async`, verl's only mode for its pools: the same sampling as its servers')
        self.rollout = Rollout(cfg, pool or actor, tokenizer.pad_token_id, in_process=pool is not None)
        self.rank_metrics: dict[str, float] = {}
        self.broadcast_address: Any = None
        """The pool's weight broadcast, once the first sync asked for it (:func:`sync_pool`)."""
        self._reward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor_group, self.critic_group) if g is not None]

    def note(self, phase: str, per_rank: list[float]) -> float:
        """Record a per-rank figure (`dp/rank_<r>/<phase>`); return the largest."""
        for rank, value in enumerate(per_rank):
            self.rank_metrics[f"dp/rank_{rank}/{phase}"] = float(value)
        return max(per_rank) if per_rank else 0.0

    # ------------------------------------------------------------------------------ before the updates

    def begin(self, step: int) -> Timer:
        """Start training step `step`: its torch seed, fresh per-rank figures; returns the timer
        of its phases."""
        torch.manual_seed(step_seed(self.cfg.trainer.seed, step))
        self.rank_metrics = {}
        return Timer()

    def generate(self, examples: list[Example], step: int, validate: bool = False, greedy: bool = False
                 ) -> StepBatch:
        """The rollout stage (:class:`trainer.stages.rollout.Rollout`), seeded by `step`."""
        return self.rollout.generate(examples, step, self.note, validate=validate, greedy=greedy)

    def sample(self, examples: list[Example], step: int, timer: Timer) -> StepBatch:
        """A training step's rollout (phase `gen`) and, for an estimator with a greedy baseline
        (ReMax), each prompt's greedy response scored (phase `gen_max`)."""
        with timer.phase("gen"):
            batch = self.generate(examples, step)
        if registry.adv_estimator(self.cfg.algorithm.adv_estimator).greedy_baseline:
            with timer.phase("gen_max"):
                self.compute_reward_baselines(examples, batch, step)
        return batch

    def compute_rewards(self, batch: StepBatch) -> dict[str, float]:
        """The reward stage: the run's reward engine (:class:`trainer.stages.reward.RewardEngine`)."""
        return self.reward.score(batch)

    def split(self, batch: StepBatch) -> list[list[int]]:
        """Rows of each rank (:func:`trainer.stages.logprobs.split_batch`)."""
        return split_batch(batch, self.world, self.cfg.trainer.balance_batch)

    def compute_reward_baselines(self, examples: list[Example], batch: StepBatch, step: int) -> None:
        """ReMax's baseline (verl ray_trainer `gen_max`): each prompt's greedy response, generated
        with the weights that sampled `batch` and scored like it; its score is the baseline of
        every row of that prompt."""
        greedy = self.generate(examples, step, greedy=True)
        self.compute_rewards(greedy)
        set_reward_baselines(batch, greedy)

    def reuses_update_log_probs(self, batch: StepBatch) -> bool:
        """Whether the actor update supplies the old log-probs itself
        (:func:`trainer.stages.logprobs.reuses_update_log_probs`)."""
        return reuses_update_log_probs(self.cfg, batch)

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        agg, bypass = self.cfg.actor_rollout_ref.actor.loss_agg_mode, self.cfg.algorithm.rollout_correction.bypass_mode
        return logprobs.old_log_probs(batch, self.actor_group, self.split(batch), agg, self.note, bypass)

    def compute_advantages(self, batch: StepBatch, step: int) -> dict[str, float]:
        """The advantage stage (:func:`trainer.stages.advantage.compute_advantages`); PF-PPO's
        redraw is seeded by the run's seed and the step."""
        seed = step_seed(self.cfg.trainer.seed, step, SALT["pf_ppo"])
        return compute_advantages(batch, self.cfg.algorithm, self.kl_ctrl, pf_ppo_seed=seed)

    def prepare(self, batch: StepBatch, step: int, timer: Timer) -> dict[str, float]:
        """Everything between rollout and the updates: reward, old and reference log-probs,
        values, advantages; then the batch written to `trainer.rollout_data_dir` when set (where
        verl dumps it, before the updates)."""
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
            metrics["actor/entropy"] = entropy_metric(batch.entropy, batch.response_mask,
                                                      self.cfg.actor_rollout_ref.actor.loss_agg_mode)
        if self.cfg.derived.use_reference:
            with timer.phase("ref"):
                logprobs.ref_log_probs(batch, self.actor_group, self.split(batch), self.note)
        if self.cfg.derived.use_critic:
            assert self.critic_group is not None
            with timer.phase("values"):
                logprobs.values(batch, self.critic_group, self.split(batch), self.note)
        if rewards is not None:
            with timer.phase("reward"):  # only the wait for the scoring thread
                metrics.update(rewards.result())
        with timer.phase("adv"):
            metrics.update(self.compute_advantages(batch, step))
        if self.cfg.trainer.rollout_data_dir:
            dump_rollout(self.cfg.trainer.rollout_data_dir, step, batch, self.tokenizer)
        return metrics

    # ------------------------------------------------------------------------------ updates

    def batcher(self, step: int) -> update.MiniBatcher:
        t = self.cfg.trainer
        return update.MiniBatcher(self.world, self.split, t.seed, step,
                                  model_engine=t.use_legacy_worker_impl == "disable")

    def update_critic(self, batch: StepBatch, step: int) -> dict[str, float]:
        assert self.critic_group is not None
        return update.update_critic(batch, self.critic_group, self.cfg, self.batcher(step), self.note)

    def update_actor(self, batch: StepBatch, step: int) -> dict[str, float]:
        """The actor update; rows whose loss has no gradient are not computed unless the update
        needs every row (:func:`trainer.stages.update.keeps_every_row`)."""
        every_row = update.keeps_every_row(self.cfg, update.measures_entropy(batch))
        return update.update_actor(batch, self.actor_group, self.cfg, self.batcher(step), self.note,
                                   skip=None if every_row else self.rows_to_update)

    @staticmethod
    def rows_to_update(mini: StepBatch) -> list[int]:
        """Rows of `mini` whose loss has a gradient (:func:`trainer.stages.update.rows_to_update`)."""
        return update.rows_to_update(mini)

    def sync_weights(self, version: int = 0) -> None:
        """The sync stage: the actor's weights to its ranks' engines
        (:func:`trainer.stages.sync.sync_weights`), or to the rollout pool as weight version
        `version` (:func:`trainer.stages.sync.sync_pool`)."""
        if self.pool is None:
            sync_weights(self.actor_group, self.note)
        else:
            self.broadcast_address = sync_pool(self.actor_group, self.pool, version, self.note,
                                               self.cfg.async_training.checkpoint_engine, self.broadcast_address)

    def sample_ahead(self, examples: list[Example], step: int) -> tuple[StepBatch, dict[str, float]]:
        """Step `step`'s rollout on the rollout pool, run beside the training of the step before
        (a thread of the loop's): its batch, tagged with the weight version that generated it,
        and its own metrics (verl's `timing_s/generate_async`, the agent loops', and the pool's
        per-rank figures as `rollout_pool/rank_<r>/...`), kept apart from the step in training."""
        metrics: dict[str, float] = {}

        def note(phase: str, per_rank: list[float]) -> float:
            for rank, value in enumerate(per_rank):
                metrics[f"rollout_pool/rank_{rank}/{phase}"] = float(value)
            return max(per_rank) if per_rank else 0.0

        start = time.perf_counter()
        batch = self.rollout.generate(examples, step, note)
        metrics["timing_s/generate_async"] = time.perf_counter() - start
        metrics.update(self.rollout.agent_metrics)
        return batch, metrics

    def update(self, batch: StepBatch, step: int, timer: Timer) -> dict[str, float]:
        """Critic update, actor update (after `critic_warmup` steps), weight sync."""
        metrics: dict[str, float] = {}
        if self.cfg.derived.use_critic:
            with timer.phase("update_critic"):
                metrics.update(self.update_critic(batch, step))
        if self.cfg.trainer.critic_warmup <= step:
            with timer.phase("update_actor"):
                metrics.update(self.update_actor(batch, step))
            if self.pool is None:  # a rollout pool is synced when its loop says
                with timer.phase("update_weights"):  # verl's name for the weight sync
                    self.sync_weights()
        return metrics

    # ------------------------------------------------------------------------------ one step

    def train_step(self, examples: list[Example], step: int) -> tuple[StepBatch, dict[str, float], Timer]:
        """One synchronous PPO step on a batch of prompts, its stages in turn: its batch,
        metrics and phase times."""
        timer = self.begin(step)
        with at(step=step), timer.phase("step"):
            batch = self.sample(examples, step, timer)
            self.clock.mark("first_rollout")
            metrics = self.prepare(batch, step, timer)
            metrics.update(self.update(batch, step, timer))
        return batch, metrics, timer

    def step_metrics(self, batch: StepBatch, timer: Timer, agent: dict[str, float] | None = None) -> dict[str, float]:
        """The metrics stage's step metrics, the agent loops' (`agent`: those of the batch's own
        rollout, where another may have run since) and the ranks' figures, the peak device memory
        of every group's ranks."""
        metrics = step_metrics(batch, timer.seconds, self.cfg.data, self.world)
        metrics.update(self.rollout.agent_metrics if agent is None else agent)
        metrics.update(self.rank_metrics)
        metrics.update(memory_metrics(self.groups()))
        return metrics

    # ------------------------------------------------------------------------------ validation

    def validate(self, val_set: PromptDataset, step: int, run_dir: Path) -> dict[str, float]:
        """The validation stage (:func:`trainer.stages.validate.validate`); the generations it
        keeps are logged."""
        t = self.cfg.trainer
        dump = ValidationDump(t.validation_data_dir, self.tokenizer)
        with at("validate", step):  # its rollout bounded by earlier validations', not by training's
            # on a rollout pool the trainer's ranks sit idle meanwhile: one that dies ends the run now
            metrics, samples = while_alive(
                self.groups() if self.pool is not None else [], validate,
                val_set, self.cfg.data.val_batch_size, lambda examples: self.generate(examples, step, validate=True),
                dump.scoring(self.compute_rewards), self.tokenizer, step, t.log_val_generations)
        dump.write(step)
        if samples:
            log_generations(run_dir, samples, "console" in t.logger)
        return metrics
