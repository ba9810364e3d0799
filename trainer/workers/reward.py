"""A discriminative reward model colocated with the actor: each rank of the actor group holds a
whole copy (a data-parallel replica, as verl's colocated reward model runs one replica per GPU at
`tensor_model_parallel_size=1`), loaded on the rank's device at its first scoring and moved to the
host after each, so that the actor trains and the rollout engine generates with none of its
weights on the device (verl's `RewardLoopManager.compute_rm_score` wakes its replicas before
scoring and sleeps them after)."""

from __future__ import annotations

from typing import Any

from trainer.rewards.model import SequenceClassifierRM

__all__ = ["score_on_rank"]


def score_on_rank(worker: Any, path: str, dtype: str | None, texts: list[str | list[int]],
                  rows_per_forward: int | None = None) -> list[float]:
    """`texts` (rendered by :func:`trainer.rewards.model.render_rm_prompt`) scored by this rank's
    copy of the reward model at `path` (in `dtype`: :func:`trainer.rewards.model.rm_dtype`), in
    forwards of at most `rows_per_forward` rows, which sleeps again before this returns."""
    rm: SequenceClassifierRM | None = getattr(worker, "_reward_model", None)
    if rm is None:
        rm = worker._reward_model = SequenceClassifierRM(path, worker.device, dtype)
    try:
        return rm.score_texts(texts, rows_per_forward)
    finally:
        rm.sleep()
