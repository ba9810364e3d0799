"""A seeded random run of the rollouter and the trainer over :class:`SampleQueue`: prompts are
submitted when admission allows, finish in random order, and the trainer takes
`required_samples` at a time and syncs every `trigger_parameter_sync_step` takes (draining the
prompts in flight first unless `partial_rollout`). It returns the event stream (for replaying on
verl's code), the queue's answers and the samples trained, each checked against the bound."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trainer.async_rl.queue import Sample, SampleQueue
from trainer.config.async_training import QueueBounds


@dataclass
class Run:
    queue: SampleQueue[None]
    events: list[list[Any]] = field(default_factory=list)
    pauses: list[bool] = field(default_factory=list)
    queue_sizes: list[int] = field(default_factory=list)
    after_sync: list[int] = field(default_factory=list)
    trained: list[Sample[None]] = field(default_factory=list)

    def event(self, *item: Any) -> None:
        self.events.append(list(item))
        self.queue_sizes.append(len(self.queue.queue))


def simulate(bounds: QueueBounds, prompts: int, seed: int, partial_rollout: bool) -> Run:
    rng = random.Random(seed)
    run = Run(SampleQueue(bounds))
    q, nxt, takes = run.queue, 0, 0
    while True:
        roll = rng.random()
        if roll < 0.45 and nxt < prompts:
            paused = q.should_pause()
            run.pauses.append(paused)
            run.event("check")
            if not paused:
                q.submit(nxt)
                run.event("submit", nxt)
                nxt += 1
        elif roll < 0.85 and q.in_flight:
            pid = rng.choice(sorted(q.in_flight))
            q.finish(pid, None)
            run.event("finish", pid)
        else:
            got = q.take(bounds.required_samples)
            if got is None:
                if nxt >= prompts and not q.in_flight:
                    return run  # the last prompts do not fill an update
                continue
            q.train(got)
            run.trained += got
            run.event("take", len(got))
            takes += 1
            if takes % bounds.trigger_parameter_sync_step == 0:
                while q.in_flight and not partial_rollout:
                    pid = min(q.in_flight)
                    q.finish(pid, None)
                    run.event("finish", pid)
                q.sync(partial_rollout)
                run.event("sync")
                run.after_sync.append(q.staleness_samples)
