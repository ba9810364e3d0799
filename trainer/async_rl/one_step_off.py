"""verl's one-step-off loop (`verl/experimental/one_step_off_policy/ray_trainer.py`, verl
0.9.1): the rollout pool generates step k+1's batch while the trainer trains on step k's.

Each step, in verl's order (`_fit_generate`):

1. wait for this step's batch (`timing_s/gen`: the wait alone; the generation's own time is
   `timing_s/generate_async`);
2. sync the trainer's weights to the pool (`timing_s/sync_rollout_weights`): those of the step
   before, weight version k-1;
3. start the next step's generation with them, in a thread of its own;
4. train on this step's batch (reward, log-probs, advantages, updates: the same stages as the
   synchronous loop, :class:`trainer.step.Stages`).

So batch k is generated with weights k-2 and trained on at weights k-1: one step behind, once
the first step (generated with the weights it trains) is past. Every batch's lag is checked
against that bound (a bug otherwise, never bad input) and logged as `fully_async/staleness/*`
style figures under `one_step_off/`.

What a stop keeps. The batch in flight at a checkpoint is not saved (verl saves none either):
the checkpoint records the data position before it (:attr:`trainer.run_state.RunState.data_position`),
so a resumed run generates that batch again from the same prompts and seed, now with the
checkpoint's weights (its first batch has lag 0, where the unbroken run's had lag 1). No prompt
is dropped or trained twice.

Validation runs on the pool's engines, with the weights of the last sync (one step behind the
trainer's), once the generation in flight has finished.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any

from trainer.async_rl.queue import StalenessError
from trainer.batch import StepBatch
from trainer.data import Example
from trainer.driver import PPODriver
from trainer.watchdog import at
from trainer.workers.group import in_background

__all__ = ["MAX_LAG", "OneStepOffDriver"]

MAX_LAG = 1
"""Versions a batch's weights may lag the trainer's under one-step-off."""


class OneStepOffDriver(PPODriver):
    """The run on a rollout pool of its own, generation one step ahead of training."""

    loop = "one_step_off"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: Future[tuple[StepBatch, dict[str, float]]] | None = None
        """The next step's generation, in flight."""
        self.pool_version = -1
        """The weight version the pool holds (the steps trained into it)."""
        self.lags: dict[int, int] = {}
        """Trained batches by lag (versions behind the trainer's weights)."""
        self.ahead: list[Example] | None = None
        """The prompts of the generation in flight (handed out, not trained)."""

    def fit(self) -> int:
        try:
            return super().fit()
        finally:
            self.pending = None  # a generation still running is abandoned with the run

    def _start(self, step: int) -> Future[tuple[StepBatch, dict[str, float]]]:
        examples: list[Example] = self.loader.next_batch()
        self.ahead = examples
        with at(step=step):  # the generation's calls are step `step`'s (the thread keeps this context)
            return in_background("rollout-pool", self.stages.sample_ahead, examples, step)

    def next_step(self) -> dict[str, float]:
        step, st = self.global_step, self.stages
        if self.pool_version < 0:  # the weights `fit` synced before the first step
            self.pool_version = step - 1
        if self.pending is None:  # the run's first step: nothing was generated ahead
            self.state.data_position = None
            self.pending = self._start(step)
        timer = st.begin(step)
        with at(step=step), timer.phase("step"):
            with timer.phase("gen"):  # the wait for this step's batch
                batch, gen_metrics = self.pending.result()
            self.pending = None
            lag = self._check_lag(batch, step)
            if self.pool_version < step - 1:
                with timer.phase("sync_rollout_weights"):
                    st.sync_weights(step - 1)
                self.pool_version = step - 1
            # a checkpoint of this step resumes before the batch about to be generated
            self.state.data_position = self.loader.state_dict()
            self.ahead = None
            if step < self.total_steps:
                self.pending = self._start(step + 1)
            st.clock.mark("first_rollout")
            metrics = st.prepare(batch, step, timer)
            metrics.update(st.update(batch, step, timer))
            self.update_sampler(batch)
            if self.loader.curriculum:  # the sampler's state with this update, the batch drawn before it first
                self.state.data_position = self.loader.state_dict(ahead=self.ahead)
        metrics.update(gen_metrics)
        metrics.update(st.step_metrics(batch, timer, agent={k: v for k, v in gen_metrics.items()
                                                            if k.startswith("agent_loop/")}))
        metrics.update({"one_step_off/lag": lag, "one_step_off/weight_version": batch.weight_version or 0,
                        **{f"one_step_off/staleness/{k}": n for k, n in sorted(self.lags.items())},
                        **self.progress_metrics()})
        return metrics

    def validate(self) -> dict[str, float]:
        """Validation on the pool, once the generation in flight has finished: the pool's ranks
        run one call at a time, so a validation sent now would wait for it, and the watchdog
        would time that wait as the validation's own."""
        if self.pending is not None:
            wait([self.pending])  # its result, or its failure, is the next step's
        return super().validate()

    def _check_lag(self, batch: StepBatch, step: int) -> int:
        """The versions `batch`'s weights lag those it is trained at (step - 1 trained so far);
        more than :data:`MAX_LAG`, or a batch from the future, is a bug of the loop."""
        if batch.weight_version is None:
            raise StalenessError(f"step {step}'s batch carries no weight version: not generated on the pool")
        lag = (step - 1) - batch.weight_version
        if not 0 <= lag <= MAX_LAG:
            raise StalenessError(f"step {step}'s batch was generated with weights {batch.weight_version} and is "
                                 f"trained at {step - 1}: {lag} versions behind, the bound is {MAX_LAG}")
        self.lags[lag] = self.lags.get(lag, 0) + 1
        return lag
