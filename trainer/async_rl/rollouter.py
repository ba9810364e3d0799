"""The fully-async loop's rollouter (verl's `FullyAsyncRollouter`, verl 0.9.1): each rank of the
rollout pool driven from a thread of its own, streaming finished samples into the queue.

A rank takes the next prompts of the run's order (:class:`trainer.async_rl.cursor.PromptCursor`)
while the queue admits them (:meth:`trainer.async_rl.queue.SampleQueue.should_pause`, verl's
`_should_pause_generation`), generates their `rollout.n` responses with the weights it holds, and
queues each prompt's samples, tagged with that weight version, as soon as its call returns.

At a weight sync (:meth:`Rollouter.paused`) no prompt is handed out; the calls in flight either
finish under the weights they started with (verl's `pause` without `partial_rollout`) or, with
`async_training.partial_rollout`, are aborted: each returns its rows, the unfinished ones partial,
the prompts whose rows all ended are queued as usual, and the others stay in flight
(:class:`trainer.async_rl.partial.Partial`) until the ranks continue them under the new weights,
before any new prompt (:mod:`trainer.async_rl.partial`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from trainer.async_rl.cursor import PromptCursor
from trainer.async_rl.partial import Partial, Piece, continuation, extend, pieces
from trainer.async_rl.queue import Sample, SampleQueue
from trainer.batch import StepBatch, step_seed
from trainer.config import Config
from trainer.config.base import ConfigError
from trainer.config.rollout import SINGLE_TURN_AGENT
from trainer.data import Example
from trainer.models import left_pad
from trainer.stages.rollout import SALT, Rollout, agent_loop_sampling, sampling_params
from trainer.watchdog import at
from trainer.workers.group import RankView, WorkerGroup

__all__ = ["Rollouter"]


class Rollouter:
    """Streams the run's prompts through the rollout pool, one thread per pool rank, into the
    queue; the trainer takes from it (:meth:`take`), marks what it trained (:meth:`trained`) and
    pauses it for a weight sync or a validation (:meth:`paused`). Every change of the queue, the
    cursor and the partial samples happens under one lock."""

    def __init__(self, cfg: Config, pool: WorkerGroup, pad_token_id: int, queue: SampleQueue[StepBatch],
                 cursor: PromptCursor, example_at: Any, first_call: int = 0) -> None:
        self.cfg, self.pool = cfg, pool
        self.rollouts = [Rollout(cfg, RankView(pool, rank), pad_token_id, in_process=True)
                         for rank in range(pool.world_size)]
        self.queue, self.cursor, self.example_at = queue, cursor, example_at
        b = queue.bounds
        self.chunk = max(1, min(cfg.async_training.concurrent_samples_per_replica,
                                math.ceil(b.max_required_samples / pool.world_size)))
        """Prompts one call to a rank generates at most (verl: requests one replica runs at once,
        `concurrent_samples_per_replica`, and the rollouter's `max_required_samples` shared out)."""
        self.partial_rollout = cfg.async_training.partial_rollout
        self.partials: dict[int, Partial] = {}
        """Prompts paused mid-response at a sync, by prompt (in flight in the queue meanwhile)."""
        self.to_continue: list[int] = []
        """Of those, the prompts no rank is continuing yet, oldest first."""
        self.cond = threading.Condition()
        self.paused_for: str | None = None
        self.stopping = False
        self.error: BaseException | None = None
        self.calls = first_call
        """The calls made, which seed them (a resumed run starts past the earlier run's)."""
        self.busy = [False] * pool.world_size
        self.idle_s = [0.0] * pool.world_size
        """Each rank's seconds waiting for work since the last sync, finished waits only."""
        self.waiting: list[float | None] = [None] * pool.world_size
        """When each rank began the wait it is in now (None: it is generating)."""
        self.since = time.monotonic()
        self.generated = 0
        self.per_rank: dict[str, float] = {}
        """Each rank's rows, tokens and seconds since the last sync (`rollout_pool/rank_<r>/...`)."""
        self.threads = [threading.Thread(target=self._serve, args=(rank,), daemon=True, name=f"rollouter-{rank}")
                        for rank in range(pool.world_size)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """End the threads after their calls in flight (abandoned: the run is ending; a partial
        sample is dropped with them and its prompt handed out again after a resume)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    # ------------------------------------------------------------------------------ the ranks' threads

    def _may_hand_out(self) -> bool:
        if self.paused_for is not None or self.stopping:
            return False
        return bool(self.to_continue) or (not self.queue.should_pause() and self.cursor.next_free())

    def _serve(self, rank: int) -> None:
        while True:
            with self.cond:
                self.waiting[rank] = time.monotonic()
                while not self._may_hand_out():
                    if self.stopping:
                        return
                    self.cond.wait()
                self.idle_s[rank] += time.monotonic() - self.waiting[rank]  # type: ignore[operator]
                self.waiting[rank] = None
                # the paused samples first: they are in flight already, counted by the queue
                resumed, self.to_continue = self.to_continue[:self.chunk], self.to_continue[self.chunk:]
                prompts = [] if resumed else self._hand_out()
                call, self.calls = self.calls, self.calls + 1
                version, self.busy[rank] = self.queue.version, True
            try:
                with at("generate_async", version):
                    if resumed:
                        outputs = self._continue(rank, [self.partials[p] for p in resumed], call)
                    else:
                        batch = self.rollouts[rank].generate(self._examples(prompts), call, self._noter(rank))
                with self.cond:
                    if resumed:
                        self._continued(resumed, outputs, version)
                    else:
                        self._generated(prompts, batch, version)
            except BaseException as err:  # the trainer raises it at its next wait
                with self.cond:
                    self.error = self.error or err
                    self.busy[rank] = False
                    self.cond.notify_all()
                return
            with self.cond:
                self.busy[rank] = False
                self.cond.notify_all()

    def _hand_out(self) -> list[int]:
        """The next prompts of the run's order for one call, as the queue admits them."""
        prompts: list[int] = []
        while len(prompts) < self.chunk and not self.queue.should_pause():
            prompt = self.cursor.next()
            if prompt is None:
                break
            self.queue.submit(prompt)
            prompts.append(prompt)
        return prompts

    def _examples(self, prompts: list[int]) -> list[Example]:
        examples = [self.example_at(p) for p in prompts]
        for prompt, e in zip(prompts, examples, strict=True):
            if self.partial_rollout and e.agent_name != SINGLE_TURN_AGENT:
                raise ConfigError(
                    f"prompt {prompt} runs the agent loop `{e.agent_name}`: `async_training.partial_rollout=true` "
                    "continues single-turn rows only (a multi-turn trajectory paused between turns cannot be "
                    "continued here). Fix: `async_training.partial_rollout=false`, or single-turn data")
        return examples

    def _generated(self, prompts: list[int], batch: StepBatch, version: int) -> None:
        """A call's rows: each prompt's queued, or kept in flight when a sync paused some of them."""
        for i, prompt in enumerate(prompts):
            rows = [r for r, uid in enumerate(batch.uids) if uid == i]
            sample = batch.select(rows)
            sample.uids = [prompt] * len(rows)  # a prompt's group, across calls
            if sample.aborted is None:
                self.queue.finish(prompt, sample)
                continue
            partial = Partial.start(sample, version)
            if partial.finished:  # aborted exactly at its budget's end: ended
                self.queue.finish(prompt, partial.sample(), tuple(map(tuple, partial.parts)))
            else:
                self.partials[prompt] = partial
                self.to_continue.append(prompt)
        self.generated += len(prompts)

    def _continue(self, rank: int, partials: list[Partial], call: int) -> list[Piece]:
        """Every open row of `partials` continued on `rank` in one call, under its weights: the
        rank's generation of one response per row (up to the longest budget), each cut at its own."""
        prompts, left = [], []
        for p in partials:
            tokens, budget = continuation(p)
            prompts += tokens
            left += budget
        rollout = self.rollouts[rank]
        params = sampling_params(self.cfg, validate=False)
        if rollout.server_mode or rollout.trace_store is not None:  # the first parts were agent-loop turns
            params = agent_loop_sampling(params, greedy_baseline=False)
        params = replace(params, n=1, max_response_length=max(left))
        seed = step_seed(self.cfg.trainer.seed, call, SALT["train"])
        ids, mask = left_pad(prompts, rollout.pad_token_id)
        out, info = rollout.actor.run_rank(0, "generate", ids, mask, params, seed)
        note = self._noter(rank)
        note("gen_tokens", [info["gen_tokens"]])
        note("gen_s", [info["gen"]])
        return pieces(out, left)

    def _continued(self, resumed: list[int], added: list[Piece], version: int) -> None:
        """Join the continuations; a prompt whose rows all ended is queued, under `version`."""
        for prompt in resumed:
            partial = self.partials[prompt]
            mine, added = added[:len(partial.open)], added[len(partial.open):]
            extend(partial, mine, version)
            if partial.finished:
                del self.partials[prompt]
                self.queue.finish(prompt, partial.sample(), tuple(tuple(row) for row in partial.parts))
            else:  # paused again by the next sync
                self.to_continue.append(prompt)

    def _noter(self, rank: int) -> Any:
        def note(phase: str, per_rank: list[float]) -> float:
            key = f"rollout_pool/rank_{rank}/{phase}"
            with self.cond:
                self.per_rank[key] = self.per_rank.get(key, 0.0) + float(per_rank[0])
            return float(per_rank[0])
        return note

    # ------------------------------------------------------------------------------ the trainer's side

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def take(self, count: int) -> list[Sample[StepBatch]]:
        """The `count` oldest samples, waiting for them; a rank's failure is raised here."""
        with self.cond:
            while True:
                self._raise()
                samples = self.queue.take(count)
                if samples is not None:
                    self.cond.notify_all()  # room in the queue
                    return samples
                if not self.cursor.next_free() and not self.queue.in_flight:
                    raise RuntimeError(f"the run's prompts ran out with {len(self.queue.queue)} queued, fewer than "
                                       f"the {count} an update takes (a bug: the run's steps are counted so that "
                                       "they suffice)")
                self.cond.wait(timeout=5.0)

    def check(self, samples: list[Sample[StepBatch]]) -> None:
        """Each sample within the staleness bound of the weights about to train on it (an error otherwise)."""
        with self.cond:
            self.queue.train(samples)

    def trained(self, samples: list[Sample[StepBatch]]) -> None:
        """The samples' prompts are trained on: the cursor saves them."""
        with self.cond:
            for s in samples:
                self.cursor.trained(s.prompt_id)

    @contextmanager
    def paused(self, why: str, abort: bool = False) -> Iterator[None]:
        """No prompt is handed out inside, and every call in flight has returned: finished under
        the weights it started with (verl's `pause` without `partial_rollout`), or, `abort`,
        aborted, its unfinished rows kept to continue (verl's `abort_replicas`); the aborted
        ranks generate in full again before the rollouter resumes (`resume_generation_replicas`)."""
        with self.cond:
            self.paused_for = why
            aborted = [rank for rank, busy in enumerate(self.busy) if busy] if abort else []
        for rank in aborted:  # beside the rank's call in flight
            self.pool.signal_rank(rank, "abort_generation")
        try:
            with self.cond:
                while any(self.busy):
                    self._raise()
                    self.cond.wait(timeout=5.0)
                self._raise()
            yield
        finally:
            for rank in aborted:
                self.pool.signal_rank(rank, "resume_generation")
            with self.cond:
                self.paused_for = None
                self.cond.notify_all()

    def synced(self) -> dict[str, float]:
        """The pool holds the next weight version (call inside :meth:`paused`): recount the
        queue (verl's `reset_staleness`); the rollouter's figures since the last sync."""
        with self.cond:
            self.queue.sync(partial_rollout=self.partial_rollout)
            now = time.monotonic()
            span = max(now - self.since, 1e-9)
            for rank, began in enumerate(self.waiting):  # a wait under way counts up to now
                if began is not None:
                    self.idle_s[rank] += now - max(began, self.since)
                    self.waiting[rank] = now
            idle = sum(self.idle_s) / (span * len(self.idle_s))
            out = {"fully_async/rollouter/idle_ratio": min(1.0, idle),
                   "fully_async/rollouter/version_time": span,
                   "fully_async/rollouter/step_generated_samples": float(self.generated),
                   "fully_async/rollouter/paused_samples": float(len(self.partials)),
                   **self.per_rank}
            self.idle_s = [0.0] * len(self.idle_s)
            self.since, self.generated, self.per_rank = now, 0, {}
            return out

    def stats(self) -> dict[str, float]:
        with self.cond:
            return self.queue.stats()
