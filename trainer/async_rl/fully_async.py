"""verl's fully-async loop (`verl/experimental/fully_async_policy`, verl 0.9.1): a rollouter
streams finished samples into a bounded queue while the trainer drains it.

The rollouter (:class:`trainer.async_rl.rollouter.Rollouter`) drives each rank of the rollout
pool from a thread of its own: a rank takes the next prompts of the run's order while the queue
admits them, generates their `rollout.n` responses with the weights it holds, and queues each
prompt's samples, tagged with that weight version, as soon as its call returns. A slow rank
holds back only its own prompts: the others go on generating, which is where the loop gains over
one-step-off on long-tailed responses.

The trainer's step is verl's parameter version (verl saves, validates and counts
`trainer.save_freq`/`test_freq` in `current_param_version`): `trigger_parameter_sync_step`
updates, each on the `required_samples` oldest prompts of the queue (`ppo_mini_batch_size` x
`require_batches`: `require_batches` mini-batches), then one weight sync. Every sample is checked
against the staleness bound before it is trained (:meth:`SampleQueue.train`; a violation is an
error). The sync waits for the calls in flight to finish under the old weights (verl's `pause`
without `partial_rollout`), or, with `async_training.partial_rollout`, aborts them and continues
their unfinished responses under the new weights (:mod:`trainer.async_rl.partial`); it loads
the new weights into every pool rank and recounts the queue (verl's `reset_staleness`); the
rollouter then resumes. A step's metrics aggregate its updates
as verl's `MetricsAggregator` does (:func:`aggregate`).

What a stop keeps: the checkpoint holds the prompts trained on (the cursor); what was queued or
in flight (a paused partial sample too) is dropped and handed out again after the resume (:mod:`trainer.async_rl.cursor`).

verl computes, and this loop follows:
- the run's length: int(`total_rollout_steps` / (`required_samples` x
  `trigger_parameter_sync_step`)) steps (`FullyAsyncRollouter.set_max_required_samples`),
  `total_rollout_steps` being every prompt once per epoch, capped by `rollout.total_rollout_steps`;
- the learning-rate schedule's length: those steps, though the optimizer steps
  `trigger_parameter_sync_step` x `require_batches` times per step (verl's `set_total_train_steps`
  gives the optimizer the parameter versions; the schedule ends early when either is above 1);
- `critic_warmup` and every seed of an update counted in updates (verl's `global_steps`, one per
  `fit_step`).
"""

from __future__ import annotations

import time
from typing import Any

from trainer.async_rl.cursor import PromptCursor
from trainer.async_rl.partial import row_spans
from trainer.async_rl.queue import Sample, SampleQueue, max_staleness, trainer_idle_ratio
from trainer.async_rl.rollouter import Rollouter
from trainer.batch import StepBatch, concat_batches
from trainer.config.async_training import QueueBounds, queue_bounds, total_rollout_steps
from trainer.config.base import ConfigError
from trainer.driver import PPODriver
from trainer.watchdog import at

__all__ = ["FullyAsyncDriver", "Rollouter", "aggregate", "partial_metrics"]

#: verl's `MetricsAggregator._init_aggregation_rules` (`fully_async_policy/detach_utils.py`):
#: named metrics first, then by what the name contains.
_LAST = ("fully_async/count/", "training/global_step", "dynamic_resource/mq_size", "fully_async/staleness/",
         "fully_async/static/", "fully_async/monitor/")


def _rule(name: str) -> str:
    if name.startswith(_LAST):  # verl: counts are the end of the cycle's (the histogram too: cumulative)
        return "last"
    if name in ("timing_s/agent_loop/tool_calls/min",):
        return "min"
    if name in ("timing_s/agent_loop/tool_calls/max",):
        return "max"
    if name in ("timing_s/agent_loop/tool_calls/mean",):
        return "avg"
    lower = name.lower()
    if "timing_s/" in lower or name == "perf/time_per_step":
        return "sum"
    for word, rule in (("mean", "avg"), ("avg", "avg"), ("average", "avg"), ("max", "max"), ("maximum", "max"),
                       ("min", "min"), ("minimum", "min"), ("sum", "sum"), ("total", "sum")):
        if word in lower:
            return rule
    return "avg"


def aggregate(per_update: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates' (verl's `MetricsAggregator.get_aggregated_metrics`):
    times summed, counts the last update's, means averaged, maxima and minima kept."""
    names: dict[str, list[float]] = {}
    for metrics in per_update:
        for name, value in metrics.items():
            names.setdefault(name, []).append(float(value))
    out: dict[str, float] = {}
    for name, values in names.items():
        rule = _rule(name)
        out[name] = (values[-1] if rule == "last" else sum(values) if rule == "sum" else max(values)
                     if rule == "max" else min(values) if rule == "min" else sum(values) / len(values))
    return out


def partial_metrics(samples: list[Sample[StepBatch]]) -> dict[str, float]:
    """verl's `fully_async/partial/*` (`assemble_batch_from_rollout_samples`) over an update's
    rows: those begun and ended under different weights (a partial rollout's), their share, and
    the most versions one spans."""
    spans = [span for s in samples for span in row_spans(s.parts, len(s.payload), s.version)]
    partial = sum(1 for span in spans if span)
    return {"fully_async/partial/total_partial_num": float(partial),
            "fully_async/partial/partial_ratio": partial / len(spans),
            "fully_async/partial/max_partial_span": float(max(spans))}


class FullyAsyncDriver(PPODriver):
    """The run on a rollout pool of its own, its rollouter streaming samples into the queue."""

    loop = "fully_async"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rollouter: Rollouter | None = None
        self.updates = 0
        """Updates made (verl's `global_steps`): `trigger_parameter_sync_step` per step."""

    # ------------------------------------------------------------------------------ the run's size

    def loader_batch_size(self) -> int:
        return 1  # `data.gen_batch_size=1`: the rollouter hands out one prompt at a time

    @property
    def bounds(self) -> QueueBounds:
        cfg = self.cfg
        return queue_bounds(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.async_training,
                            self.prompts_in_run)

    @property
    def prompts_in_run(self) -> int:
        """verl's `total_rollout_steps`: prompts handed out in all, epoch after epoch."""
        return total_rollout_steps(self.cfg, len(self.train_set))

    def run_steps(self) -> int:
        b = self.bounds
        if b.total_train_steps < 1:
            raise ConfigError(
                f"the run hands out {self.prompts_in_run} prompts (`rollout.total_rollout_steps`, or the data "
                f"times `trainer.total_epochs`), fewer than one step's {b.per_sync} (`ppo_mini_batch_size` x "
                "`require_batches` x `trigger_parameter_sync_step`): verl's fully-async trainer would make "
                "no step. Fix: more prompts (`rollout.total_rollout_steps`, `trainer.total_epochs`) or a "
                "smaller step")
        return b.total_train_steps

    def progress_metrics(self) -> dict[str, float]:
        metrics = super().progress_metrics()
        if self.rollouter is not None:
            metrics["training/epoch"] = self.rollouter.cursor.done_below // len(self.train_set)
        return metrics

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> int:
        try:
            return super().fit()
        finally:
            if self.rollouter is not None:
                self.rollouter.stop()

    def _cursor(self) -> PromptCursor:
        """The prompts trained on, as the resumed checkpoint saved them (all of them handed out again
        otherwise)."""
        saved = self.state.loaded_position
        if saved is not None and "cursor" in saved:
            cursor = PromptCursor.from_state(saved["cursor"])
            if cursor.size != self.prompts_in_run:
                raise ConfigError(
                    f"the checkpoint's run hands out {cursor.size} prompts and this one {self.prompts_in_run} "
                    "(`rollout.total_rollout_steps`, `trainer.total_epochs`, the data): resume with the same "
                    "settings, or start fresh with `trainer.resume_mode=disable`")
            return cursor
        done = 0 if saved is None else int(saved["epoch"]) * len(self.train_set) + int(saved["index"])
        return PromptCursor(self.prompts_in_run, done_below=done)

    def _start_rollouter(self) -> Rollouter:
        assert self.stages.pool is not None, "the fully-async loop runs on a rollout pool"
        version = self.global_step - 1  # the weights `fit` synced before this first step
        self.updates = version * self.bounds.trigger_parameter_sync_step
        rollouter = Rollouter(self.cfg, self.stages.pool, self.tokenizer.pad_token_id,
                              SampleQueue(self.bounds, version), self._cursor(), self.loader.example_at,
                              first_call=version << 20)
        rollouter.start()
        return rollouter

    def next_step(self) -> dict[str, float]:
        if self.rollouter is None:
            self.rollouter = self._start_rollouter()
        step, b = self.global_step, self.bounds
        per_update = [self._update(self.rollouter, b) for _ in range(b.trigger_parameter_sync_step)]
        start = time.perf_counter()
        self.stages.rank_metrics = {}  # the sync's own figures (seconds, GB, GB/s per rank)
        with at("sync_rollout_weights", step), self.rollouter.paused(
                "weight sync", abort=self.cfg.async_training.partial_rollout):
            self.stages.sync_weights(step)
            rollouter_metrics = self.rollouter.synced()
        metrics = aggregate(per_update)
        metrics.update(self.stages.rank_metrics)
        metrics["timing_s/param_sync"] = time.perf_counter() - start
        metrics.update(rollouter_metrics)
        metrics.update(self.rollouter.stats())
        metrics["fully_async/static/max_staleness"] = max_staleness(b)
        metrics.update(self.progress_metrics())
        metrics["training/updates"] = self.updates
        # a checkpoint of this step resumes with the prompts trained so far
        self.state.data_position = {**self.loader.state_dict(), "cursor": self.rollouter.cursor.state()}
        return metrics

    def _update(self, rollouter: Rollouter, b: QueueBounds) -> dict[str, float]:
        """One update on the queue's `required_samples` oldest prompts."""
        self.updates += 1
        st, update = self.stages, self.updates
        timer = st.begin(update)
        with at(step=self.global_step), timer.phase("step"):
            with timer.phase("gen"):  # the wait for samples
                samples = rollouter.take(b.required_samples)
            rollouter.check(samples)
            batch = concat_batches([s.payload for s in samples], self.tokenizer.pad_token_id)
            st.clock.mark("first_rollout")
            metrics = st.prepare(batch, update, timer)
            metrics.update(st.update(batch, update, timer))
        rollouter.trained(samples)
        metrics.update(st.step_metrics(batch, timer, agent={}))
        metrics["fully_async/trainer/idle_ratio"] = trainer_idle_ratio(timer.seconds["gen"], timer.seconds["step"])
        lags = [rollouter.queue.version - s.version for s in samples]
        metrics["fully_async/lag/mean"] = sum(lags) / len(lags)
        metrics["fully_async/lag/max"] = max(lags)
        metrics.update(partial_metrics(samples))
        return metrics

    def validate(self) -> dict[str, float]:
        """Validation on the pool with the weights of the last sync, the rollouter paused (its
        calls in flight finished first: a pool rank runs one call at a time)."""
        if self.rollouter is None:
            return super().validate()
        with self.rollouter.paused("validation"):
            return super().validate()
