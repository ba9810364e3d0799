"""A seeded random run of the rollouter and the trainer over :class:`SampleQueue`: prompts are
submitted when admission allows, finish in random order, and the trainer takes
`required_samples` at a time and syncs every `trigger_parameter_sync_step` takes (draining the
prompts in flight first unless `partial_rollout`). It returns the event stream (for replaying on
verl's code), the queue's answers and the samples trained, each checked against the bound."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trainer.async_rl.cursor import PromptCursor
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
    cursor: PromptCursor = field(default_factory=lambda: PromptCursor(0))

    def event(self, *item: Any) -> None:
        self.events.append(list(item))
        self.queue_sizes.append(len(self.queue.queue))


def simulate(bounds: QueueBounds, prompts: int, seed: int, partial_rollout: bool,
             cursor: PromptCursor | None = None, version: int = 0, stop_after_syncs: int | None = None) -> Run:
    """`cursor`: where a resumed run starts (default: a new epoch of `prompts`), `version` its
    weights; `stop_after_syncs`: stop right after that many syncs (a checkpoint is taken at a
    sync), leaving what is queued and in flight to be dropped."""
    rng = random.Random(seed)
    run = Run(SampleQueue(bounds, version), cursor=cursor or PromptCursor(prompts))
    q, cur, takes = run.queue, run.cursor, 0
    while True:
        roll = rng.random()
        if roll < 0.45 and cur.next_free():
            paused = q.should_pause()
            run.pauses.append(paused)
            run.event("check")
            if not paused:
                pid = cur.next()
                assert pid is not None
                q.submit(pid)
                run.event("submit", pid)
        elif roll < 0.85 and q.in_flight:
            pid = rng.choice(sorted(q.in_flight))
            q.finish(pid, None)
            run.event("finish", pid)
        else:
            got = q.take(bounds.required_samples)
            if got is None:
                if not cur.next_free() and not q.in_flight:
                    return run  # the last prompts do not fill an update
                continue
            q.train(got)
            for s in got:
                cur.trained(s.prompt_id)
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
                if stop_after_syncs is not None and len(run.after_sync) == stop_after_syncs:
                    return run
