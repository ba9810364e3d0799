"""The queue between the rollouter and the trainer, with verl's staleness accounting.

verl 0.9.1 (`verl/experimental/fully_async_policy/`) keeps it in three places; the rules are
gathered here, one method each:

- the sizes (`FullyAsyncRollouter.set_max_required_samples`): :func:`trainer.config.async_training.queue_bounds`;
- admission (`FullyAsyncRollouter._should_pause_generation`, and `staleness_samples += 1` as each
  prompt is handed to an engine in `_processor_worker`): :meth:`SampleQueue.should_pause`,
  :meth:`SampleQueue.submit`;
- the queue itself (`MessageQueue.put_sample`: a full queue drops its oldest sample, which the
  admission rule keeps from happening): :meth:`SampleQueue.finish`, :meth:`SampleQueue.take`;
- the weight sync (`FullyAsyncTrainer` bumps `current_param_version`; the rollouter's
  `reset_staleness` recounts `staleness_samples` as the prompts in flight plus those queued):
  :meth:`SampleQueue.sync`.

Counts are prompts (verl's "samples": one prompt with its `rollout.n` responses,
`data.gen_batch_size=1`). A sample's `version` is the weights that finished it (verl's
`max_global_steps`; with `partial_rollout` it may have started under older weights,
`first_version`, verl's `min_global_steps`). Staleness counts from `version`, as verl's does
(`trajectory_param_versions` is `max_global_steps`; `stale_trajectory_processed` counts the
samples trained at least one version after it): a prompt in flight at a sync is one of those the
sync leaves (`reset_staleness` counts it), so the bound below holds for it by the version that
finished it. Its earlier part, sampled before the sync, may then be trained one version further
behind than the bound: that is what a partial rollout trades for not waiting.

The staleness bound. Let P be the prompts the trainer takes between two syncs
(`required_samples` x `trigger_parameter_sync_step`) and A the prompts verl lets the rollouter
generate beyond them (`max_required_samples` - P). Every sync recounts what is left (queued and
in flight) and admits new prompts only up to `max_required_samples` in all, so at most A are
left at each sync; a sample finished under version v is queued behind at most A - 1 others left
at the next sync, taken P at a time, oldest first: it is trained at most ceil(A / P) versions
later (0 when A = 0). :meth:`SampleQueue.train` checks that on every sample it hands out and
keeps the histogram.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from trainer.config.async_training import QueueBounds

T = TypeVar("T")

__all__ = ["Sample", "SampleQueue", "StalenessError", "max_staleness", "rollouter_idle_ratio",
           "trainer_idle_ratio"]


class StalenessError(RuntimeError):
    """A sample older than the staleness bound reached the trainer (a bug in the loop, never bad input)."""


@dataclass(frozen=True)
class Sample(Generic[T]):
    prompt_id: int
    """The prompt's index in the data order (the cursor counts prompts by it)."""
    version: int
    """The weight version that finished it (verl's `max_global_steps`)."""
    first_version: int
    """The weight version it started under (verl's `min_global_steps`; older than `version` only
    after a partial rollout)."""
    payload: T
    parts: tuple[tuple[tuple[int, int], ...], ...] = ()
    """After a partial rollout, per response row the (weight version, tokens) of each part of
    it, in order (:class:`trainer.async_rl.partial.Partial`); empty: every row whole under `version`."""


def max_staleness(bounds: QueueBounds) -> int:
    """The versions a trained sample may lag the trainer's weights: ceil(A / P) (module docstring)."""
    return math.ceil(bounds.ahead / bounds.per_sync) if bounds.ahead > 0 else 0


class SampleQueue(Generic[T]):
    """The rollouter's admission, the message queue and the sync's recount, for one run."""

    def __init__(self, bounds: QueueBounds, version: int = 0) -> None:
        self.bounds = bounds
        self.version = version
        """The weights the rollouter samples with and the trainer trains (verl's `current_param_version`)."""
        self.queue: deque[Sample[T]] = deque()
        self.in_flight: dict[int, int] = {}
        """Prompts handed to an engine and not finished, with the version they started under."""
        self.staleness_samples = 0
        """verl's `staleness_samples`: prompts admitted since the last sync, plus those it left."""
        self.dropped = 0
        self.trained: Counter[int] = Counter()
        """Trained samples by staleness (versions behind the trainer's weights)."""

    def should_pause(self) -> bool:
        """verl's `_should_pause_generation`: the queue is full, or the prompts counted since the
        last sync reached `max_required_samples`."""
        return (len(self.queue) >= self.bounds.max_queue_size
                or self.staleness_samples >= self.bounds.max_required_samples)

    def submit(self, prompt_id: int) -> None:
        """Hand prompt `prompt_id` to an engine (counted at once, as verl counts it)."""
        if self.should_pause():
            raise RuntimeError(f"prompt {prompt_id} submitted while the rollouter must pause "
                               f"({self.stats()}); check `should_pause()` first")
        if prompt_id in self.in_flight:
            raise RuntimeError(f"prompt {prompt_id} is already in flight")
        self.in_flight[prompt_id] = self.version
        self.staleness_samples += 1

    def finish(self, prompt_id: int, payload: T,
               parts: tuple[tuple[tuple[int, int], ...], ...] = ()) -> Sample[T]:
        """Prompt `prompt_id`'s responses are done under the current weights: queue them
        (verl's `put_sample`, dropping the oldest when full). `parts`: a partial rollout's (:class:`Sample`)."""
        sample = Sample(prompt_id, self.version, self.in_flight.pop(prompt_id), payload, parts)
        if len(self.queue) >= self.bounds.max_queue_size:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(sample)
        return sample

    def take(self, count: int) -> list[Sample[T]] | None:
        """The `count` oldest samples, or None while fewer are queued (the trainer waits)."""
        if len(self.queue) < count:
            return None
        return [self.queue.popleft() for _ in range(count)]

    def sync(self, partial_rollout: bool) -> None:
        """The new weights reach the rollouter. Without `partial_rollout` verl first waits for
        every prompt in flight to finish under the old weights (`pause`); with it, those prompts
        continue under the new ones. Then `reset_staleness` recounts."""
        if self.in_flight and not partial_rollout:
            raise RuntimeError(f"{len(self.in_flight)} prompts still in flight at a sync without "
                               "`partial_rollout`: finish them first (verl's `pause` drains them)")
        self.version += 1
        self.staleness_samples = len(self.in_flight) + len(self.queue)

    def train(self, samples: list[Sample[T]]) -> None:
        """Record `samples` as trained with the current weights; each must be within the bound."""
        bound = max_staleness(self.bounds)
        for s in samples:
            lag = self.version - s.version
            if not 0 <= lag <= bound:
                raise StalenessError(f"prompt {s.prompt_id} sampled by weights {s.version} is trained at "
                                     f"{self.version}: {lag} versions behind, the bound is {bound}")
            self.trained[lag] += 1

    def stats(self) -> dict[str, float]:
        """verl's names where verl logs the number (`FullyAsyncRollouter.get_statistics`, under
        `fully_async/`), and the staleness histogram of the trained samples
        (`fully_async/staleness/k` = samples trained k versions behind)."""
        b = self.bounds
        out: dict[str, float] = {
            "fully_async/count/staleness_samples": self.staleness_samples,
            "fully_async/count/dropped_stale_samples": self.dropped,
            "fully_async/count/current_param_version": self.version,
            "fully_async/count/stale_trajectory_processed": sum(n for k, n in self.trained.items() if k >= 1),
            "fully_async/monitor/active_tasks_size": len(self.in_flight),
            "fully_async/monitor/queue/mq_queue_size": len(self.queue),
            "fully_async/static/max_required_samples": b.max_required_samples,
            "fully_async/static/required_samples": b.required_samples,
            "fully_async/static/max_queue_size": b.max_queue_size,
        }
        out |= {f"fully_async/staleness/{k}": n for k, n in sorted(self.trained.items())}
        return out


def trainer_idle_ratio(gen_s: float, step_s: float) -> float:
    """verl's `fully_async/trainer/idle_ratio` (`MetricsAggregator._special_metrics_aggergate`):
    the step's time waiting for samples (`timing_s/gen`) over the step's (`timing_s/step`)."""
    return gen_s / step_s


def rollouter_idle_ratio(step_start: float, idle_start: float, now: float) -> float:
    """verl's `fully_async/rollouter/idle_ratio` (`reset_staleness`): the share of the time since
    the last sync the rollouter spent paused (from `idle_start`, when it paused after the
    version's start; 0 when it did not)."""
    version_time = max(now - step_start, 1e-6)
    if idle_start > step_start:
        return 1 - (idle_start - step_start) / version_time
    return 0.0
