"""The data cursor of an asynchronous run (:mod:`trainer.async_rl.cursor`): it counts only
prompts trained on; at a stop what is queued or in flight is dropped and handed out again after
the resume, so that over a run stopped and resumed every prompt of the epoch is trained exactly
as often as in an unbroken run (once)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.trainer.async_rl.simulate import simulate
from tests.trainer.async_rl.test_queue import bounds
from trainer.async_rl.cursor import PromptCursor


def test_out_of_order_training_and_the_saved_state() -> None:
    cur = PromptCursor(6)
    assert [cur.next() for _ in range(5)] == [0, 1, 2, 3, 4]
    cur.trained(2)
    cur.trained(0)
    assert cur.state() == {"size": 6, "done_below": 1, "done_above": [2]}  # 1, 3, 4 are out: not saved
    with pytest.raises(ValueError, match="prompt 2 was trained on without being handed out"):
        cur.trained(2)
    resumed = PromptCursor.from_state(cur.state())
    assert [resumed.next() for _ in range(4)] == [1, 3, 4, 5] and resumed.next() is None
    for p in (5, 4, 3, 1):
        resumed.trained(p)
    assert resumed.finished and resumed.state() == {"size": 6, "done_below": 6, "done_above": []}


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize(("mini", "require", "threshold", "trigger"),
                         [(4, 1, 0.5, 2), (2, 2, 1.0, 2), (3, 1, 2.5, 1), (8, 1, 0.1, 4)])
def test_a_stopped_and_resumed_run_trains_each_prompt_as_an_unbroken_one(
        mini: int, require: int, threshold: float, trigger: int, partial: bool) -> None:
    b = bounds(mini, require, threshold, trigger)
    prompts = b.per_sync * 12
    dropped_total = 0
    for seed in range(4):
        unbroken = simulate(b, prompts, seed, partial)
        assert Counter(s.prompt_id for s in unbroken.trained) == Counter(range(prompts))
        first = simulate(b, prompts, seed, partial, stop_after_syncs=5)
        dropped = set(first.cursor.out)  # queued or in flight at the stop: dropped
        dropped_total += len(dropped)
        assert dropped == {s.prompt_id for s in first.queue.queue} | set(first.queue.in_flight)
        second = simulate(b, prompts, seed + 100, partial, cursor=PromptCursor.from_state(first.cursor.state()),
                          version=first.queue.version)
        trained = Counter(s.prompt_id for s in first.trained + second.trained)
        assert trained == Counter(range(prompts)), "a prompt trained twice or never across the stop"
        assert dropped <= {s.prompt_id for s in second.trained}  # given out again and trained
        assert min(s.version for s in second.trained) >= first.queue.version  # nothing older came back
    assert dropped_total > 0  # the stops did drop samples, so the count above tested the policy
