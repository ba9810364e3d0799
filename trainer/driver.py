"""The PPO driver: one loop for one rank in this process or many ranks on Ray.

The driver builds the run and keeps the synchronous loop (when to validate, to save, to stop);
one step's stages are :class:`trainer.step.Stages` (each stage a unit of its own in
:mod:`trainer.stages`), the run's state (step, data position, checkpoints, resume, the metrics
file) :class:`trainer.run_state.RunState`. Both serve any loop: an asynchronous one orders the
same stages in its own way and keeps its step in a `RunState` of its own. The models live in
worker groups (:mod:`trainer.workers`): actor + reference + rollout, and the critic when the
estimator needs one. A group is one rank in this process
(:class:`~trainer.workers.group.LocalWorkerGroup`, the embedded default) or one Ray actor per
rank across the nodes (:class:`~trainer.workers.ray_group.RayWorkerGroup`); the loop is the same.
It reads top to bottom:
`resume -> for step: rollout -> reward -> old/ref log-probs, values -> advantages -> critic update
-> actor update -> weight sync -> metrics -> maybe validate -> maybe checkpoint -> stop if asked`.

Data flow per step: the prompts are left-padded together and split into contiguous parts, one per
rank; log-probs and values are computed on row shards; for the updates the stages form the
shuffled mini-batches, drop the rows whose loss has no gradient, and give every rank its share
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
from pathlib import Path
from typing import Any

from hpcrl.diagnosis import write_diagnosis
from trainer import data_classes, startup
from trainer import models as M
from trainer.agent.manager import agent_data_args
from trainer.batch import StepBatch, seed_everything
from trainer.config import Config, check_run
from trainer.data import Example, PromptDataset, PromptLoader
from trainer.deadline import Deadline
from trainer.exit_codes import OK_EXIT_CODE, REQUEUE_EXIT_CODE
from trainer.metrics import MetricsLogger
from trainer.mlflow_tracking import import_mlflow, tracking_uri
from trainer.run_state import RunState, run_dir_of
from trainer.stages.reward import build_reward_engine
from trainer.stages.validate import VAL_GENERATIONS_FILE
from trainer.step import Stages
from trainer.stop import StopRequest
from trainer.stragglers import POOL_RANKS, TRAINER_RANKS, StragglerWatch
from trainer.workers.group import WorkerFailure
from trainer.workers.start import fetch_models, start_worker_groups, use_ray

__all__ = ["VAL_GENERATIONS_FILE", "PPODriver", "launcher_restart", "run_training"]


def launcher_restart() -> int:
    """Which run of the job this is (`HPCRL_RESTART`, set by hpcrl's node agent; 0 otherwise):
    recorded with each step so that plots can mark where a run resumed."""
    raw = os.environ.get("HPCRL_RESTART", "")
    return int(raw) if raw.strip().isdigit() else 0


class PPODriver:
    """The run's construction and its synchronous loop; one step's stages are `stages`
    (:class:`trainer.step.Stages`), the step, data position and checkpoints `state`
    (:class:`trainer.run_state.RunState`)."""

    loop = "sync"
    """The loop this driver runs (:data:`trainer.config.async_training.LOOPS`)."""

    def __init__(self, cfg: Config, stop: StopRequest | None = None) -> None:
        check_run(cfg, self.loop)  # verl's start-time checks, before anything is loaded
        self.cfg = cfg
        self.clock = startup.Clock()
        t = cfg.trainer
        if cfg.actor_rollout_ref.rollout.trace.backend == "mlflow":  # missing: stop before any model loads
            import_mlflow("`actor_rollout_ref.rollout.trace.backend=mlflow`")
        seed_everything(t.seed)
        fetch_models(cfg)
        tokenizer_path, tokenizer_trust = cfg.tokenizer_source
        self.tokenizer = M.load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trust)
        self.reward = build_reward_engine(cfg, self.tokenizer)
        self._build_data()
        self.state = RunState(cfg, self.loader)
        self.stop = stop or StopRequest()
        self.stop.watch(self.run_dir)
        self.deadline = Deadline.from_env(os.environ, t.deadline_margin_s)
        start = time.perf_counter()
        self.actor_group, self.critic_group, pool, where = start_worker_groups(cfg, self.total_steps, self.clock)
        self.world = self.actor_group.world_size
        if hasattr(self.reward, "attach"):  # a reward model colocated with the actor
            self.reward.attach(self.actor_group)
        self.stages = Stages(cfg, self.actor_group, self.critic_group, self.reward, self.tokenizer, self.clock,
                             pool=pool)
        if cfg.actor_rollout_ref.rollout.trace.backend == "mlflow":  # the metrics logger's store
            self.stages.rollout.trace_store = tracking_uri(self.run_dir)
        self._write_workers()
        w = cfg.trainer.watchdog
        self.stragglers = [StragglerWatch(g.nodes, w.slow_factor, w.slow_steps, key) for g, key in
                           ((self.actor_group, TRAINER_RANKS), (pool, POOL_RANKS)) if g is not None]
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
        config = data_classes.data_config(data) if data.custom_cls.path or data.sampler.class_path else None

        def dataset(files: list[str]) -> PromptDataset:  # verl's `create_rl_dataset`: its class, or the files
            rows = data_classes.class_rows(data, files, self.tokenizer, config) if data.custom_cls.path else None
            return PromptDataset(files, self.tokenizer, rows=rows, **common)

        self.train_set = dataset(data.train_files)
        sampler = data_classes.build_sampler(data, self.train_set, config) if data.sampler.class_path else None
        self.loader = PromptLoader(self.train_set, self.loader_batch_size(), shuffle=data.shuffle, seed=data.seed,
                                   sampler=sampler)
        t = self.cfg.trainer
        needs_val = t.val_before_train or t.test_freq > 0 or t.val_only
        self.val_set = dataset(data.val_files) if needs_val else None
        self.total_steps = self.run_steps()

    def loader_batch_size(self) -> int:
        """Prompts the loader hands out at once: a training batch (`data.train_batch_size`)."""
        return self.cfg.data.train_batch_size

    def run_steps(self) -> int:
        """The run's steps: `trainer.total_training_steps`, else every batch of every epoch."""
        t = self.cfg.trainer
        return t.total_training_steps or self.loader.batches_per_epoch * t.total_epochs

    def _write_workers(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        groups = [*self.stages.groups(), *([self.stages.pool] if self.stages.pool is not None else [])]
        layout = {g.name: g.nodes for g in groups}
        (self.run_dir / "workers.json").write_text(json.dumps(layout, indent=1))

    @property
    def run_dir(self) -> Path:
        """The run's directory (:attr:`trainer.run_state.RunState.run_dir`)."""
        return self.state.run_dir

    @property
    def global_step(self) -> int:
        """The last step begun (:attr:`trainer.run_state.RunState.global_step`)."""
        return self.state.global_step

    # ------------------------------------------------------------------------------ one step

    def generate(self, examples: list[Example], validate: bool = False, greedy: bool = False) -> StepBatch:
        """The rollout stage at this step (:meth:`trainer.step.Stages.generate`)."""
        return self.stages.generate(examples, self.global_step, validate=validate, greedy=greedy)

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        """One PPO step on a batch of prompts; returns its metrics (verl names)."""
        batch, metrics, timer = self.stages.train_step(examples, self.global_step)
        self.update_sampler(batch)
        metrics.update(self.stages.step_metrics(batch, timer))
        metrics.update(self.progress_metrics())
        return metrics

    def update_sampler(self, batch: StepBatch) -> None:
        """A curriculum sampler (`data.sampler` with `update`) gets the trained batch, before the
        step's checkpoint (:class:`trainer.data_classes.TrainedBatch`)."""
        if self.loader.curriculum:
            self.loader.update(data_classes.TrainedBatch(batch, self.global_step, self.train_set.positions))

    def progress_metrics(self) -> dict[str, float]:
        """Where the run is: step, epoch, total steps, which run of the job."""
        return {"training/global_step": self.global_step, "training/epoch": self.loader.epoch,
                "training/total_steps": self.total_steps, "training/restart": launcher_restart()}

    def validate(self) -> dict[str, float]:
        """The validation stage at this step (:meth:`trainer.step.Stages.validate`)."""
        assert self.val_set is not None
        return self.stages.validate(self.val_set, self.global_step, self.run_dir)

    # ------------------------------------------------------------------------------ the loop

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.global_step % freq == 0

    def fit(self) -> int:
        """Run to `total_steps` or to a stop request; return the process exit code."""
        t = self.cfg.trainer
        resumed = self.state.resume(self.stages) is not None
        self.stages.sync_weights(self.global_step)  # the rollout gets the trained (or the loaded) weights
        logger = self.state.open_metrics(resumed)
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

    def _note_slow_nodes(self, metrics: dict[str, float]) -> None:
        """Each node's time this step into `metrics`; a node slow for long enough named
        (:mod:`trainer.stragglers`) in the log and the run's diagnoses."""
        observed = [watch.observe({**self.stages.rank_metrics, **metrics}) for watch in self.stragglers]
        for (per_node, slow), watch in zip(observed, self.stragglers, strict=True):
            metrics.update(per_node)
            for node in slow:
                summary = node.summary(watch.factor)
                print(f"trainer: {summary}", flush=True)
                write_diagnosis(self.run_dir, "slow", summary, step=self.global_step, nodes=[node.host], ranks=list(node.ranks),
                                pace_s_per_token=node.pace, others_s_per_token=node.others, pool=watch.key == POOL_RANKS)

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
            path = self.state.save(self.stages)
            self.deadline.record_save(time.perf_counter() - start)
            print(f"trainer: saved {path} in {time.perf_counter() - start:.1f}s", flush=True)

    def next_step(self) -> dict[str, float]:
        """Step `global_step` (just begun) on the next batch of prompts; its metrics. A loop of
        another order overrides this alone (:class:`trainer.one_step_off.OneStepOffDriver`)."""
        return self.train_step(self.loader.next_batch())

    def _loop(self, logger: MetricsLogger) -> int:
        while self.global_step < self.total_steps:
            began = time.time()
            self.state.global_step += 1
            metrics = self.next_step()
            self._note_slow_nodes(metrics)
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


def run_training(cfg: Config, stop: StopRequest | None = None, driver_class: type[PPODriver] | None = None) -> int:
    """Build the driver and its worker groups from `cfg` (on Ray when `trainer.distributed`
    says so), run it, and shut a Ray connection down; the return value is the exit code.
    `stop`: a request whose handlers are already installed (`python -m trainer` does that).
    `driver_class`: the loop (default :class:`PPODriver`, the synchronous one)."""
    driver: PPODriver | None = None
    try:
        driver = (driver_class or PPODriver)(cfg, stop)
        return driver.fit()
    except WorkerFailure as err:  # kept beside the metrics for `hpcrl status`, after the job is gone
        write_diagnosis(run_dir_of(cfg), err.kind, str(err), **err.details)
        raise
    finally:
        if driver is not None:
            driver.reward.close()
        if use_ray(cfg):
            import ray

            if ray.is_initialized():
                ray.shutdown()
