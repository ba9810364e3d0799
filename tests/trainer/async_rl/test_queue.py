"""The queue between the rollouter and the trainer (:mod:`trainer.async_rl.queue`): verl's
admission and recount rules on a hand-computed case, the staleness bound on every trained sample
of random runs (and reached, so it is not loose), and verl's idle ratios."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.trainer.async_rl.simulate import simulate
from trainer.async_rl.queue import (
    Sample,
    SampleQueue,
    StalenessError,
    max_staleness,
    rollouter_idle_ratio,
    trainer_idle_ratio,
)
from trainer.config import load_config
from trainer.config.async_training import QueueBounds, queue_bounds


def bounds(mini: int, require: int, threshold: float, trigger: int, total: int = 10_000) -> QueueBounds:
    a = replace(load_config([], env={}).async_training, require_batches=require, staleness_threshold=threshold,
                trigger_parameter_sync_step=trigger)
    return queue_bounds(mini, a, total)


def test_a_hand_computed_window() -> None:
    """2 prompts per update, a sync every 2 updates, threshold 0.5: int(2 x 1.5 x 2) = 6 prompts
    admitted per version, 4 trained, 2 ahead; they are trained one version late."""
    b = bounds(2, 1, 0.5, 2)
    assert (b.max_required_samples, b.per_sync, b.ahead, max_staleness(b)) == (6, 4, 2, 1)
    q: SampleQueue[str] = SampleQueue(b)
    for pid in range(6):
        assert not q.should_pause()
        q.submit(pid)
    assert q.should_pause() and q.staleness_samples == 6  # counted at submission
    with pytest.raises(RuntimeError, match="must pause"):
        q.submit(6)
    for pid in (3, 0, 1, 2, 4):
        q.finish(pid, f"r{pid}")
    assert [s.prompt_id for s in q.queue] == [3, 0, 1, 2, 4]  # in finishing order
    first, second = q.take(2), q.take(2)
    assert first is not None and second is not None and q.take(2) is None
    q.train(first + second)
    with pytest.raises(RuntimeError, match="1 prompts still in flight"):
        q.sync(partial_rollout=False)
    q.sync(partial_rollout=True)  # prompt 5 continues under version 1
    assert (q.version, q.staleness_samples, q.should_pause()) == (1, 2, False)  # 1 queued + 1 in flight
    late = q.finish(5, "r5")
    assert (late.first_version, late.version) == (0, 1)  # a partial rollout: started under 0, finished under 1
    got = q.take(2)
    assert got is not None and [s.prompt_id for s in got] == [4, 5]
    q.train(got)  # prompt 4: one version behind, within the bound
    assert q.trained == {0: 5, 1: 1}  # 0-3 and 5 under the weights that trained them, 4 one behind
    stats = q.stats()
    assert stats["fully_async/staleness/0"] == 5 and stats["fully_async/staleness/1"] == 1
    assert stats["fully_async/count/stale_trajectory_processed"] == 1


def test_a_sample_beyond_the_bound_is_refused() -> None:
    q: SampleQueue[None] = SampleQueue(bounds(2, 1, 0.5, 2), version=3)
    with pytest.raises(StalenessError, match="prompt 7 sampled by weights 1 is trained at 3: 2 versions behind, "
                                             "the bound is 1"):
        q.train([Sample(7, 1, 1, None)])
    with pytest.raises(StalenessError):
        q.train([Sample(8, 4, 4, None)])  # from the future: a version mix-up


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize(("mini", "require", "threshold", "trigger"),
                         [(4, 1, 0.0, 1), (4, 1, 0.5, 2), (2, 2, 1.0, 2), (3, 1, 2.5, 1), (8, 1, 0.1, 4)])
def test_every_trained_sample_is_within_the_bound_and_the_bound_is_reached(
        mini: int, require: int, threshold: float, trigger: int, partial: bool) -> None:
    b = bounds(mini, require, threshold, trigger)
    reached = 0
    for seed in range(6):
        run = simulate(b, prompts=200, seed=seed, partial_rollout=partial)  # train() checks each sample
        assert len(run.trained) >= 200 - b.per_sync - b.ahead
        assert len({s.prompt_id for s in run.trained}) == len(run.trained)  # none twice
        reached = max(reached, max(run.queue.trained))
        assert run.queue.dropped == 0  # admission keeps the queue from overflowing
    assert reached == max_staleness(b)


def test_idle_ratios_are_verls() -> None:
    assert trainer_idle_ratio(3.0, 12.0) == 0.25
    assert rollouter_idle_ratio(step_start=100.0, idle_start=106.0, now=110.0) == pytest.approx(0.4)
    assert rollouter_idle_ratio(step_start=100.0, idle_start=90.0, now=110.0) == 0.0  # never paused
