"""The metrics stage: one step's data, timing, throughput, progress and memory metrics (verl's
names), and the timer of the step's phases."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from trainer.batch import StepBatch, need
from trainer.config import DataConfig
from trainer.metrics import data_metrics, throughput_metrics, timing_metrics
from trainer.watchdog import at
from trainer.workers.group import WorkerGroup

__all__ = ["Timer", "memory_metrics", "step_metrics"]


class Timer:
    """Collects `timing_s/<phase>` durations for one step; the calls to the ranks inside a phase
    are that phase's for the progress watchdog (:func:`trainer.watchdog.at`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with at(name):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def step_metrics(batch: StepBatch, seconds: Mapping[str, float], data: DataConfig, world: int
                 ) -> dict[str, float]:
    """Data, timing and throughput metrics of a step's batch (verl's `compute_data_metrics`,
    `compute_timing_metrics`, `compute_throughout_metrics`); `seconds`: the step's phases, the
    whole as `step`."""
    metrics = data_metrics(
        sequence_score=need(batch.sequence_scores, "scores"),
        sequence_reward=need(batch.token_rewards, "token_rewards").sum(-1),
        advantages=need(batch.advantages, "advantages"), returns=need(batch.returns, "returns"),
        values=batch.values, response_mask=batch.response_mask, response_attention=batch.response_attention,
        prompt_mask=batch.attention_mask[:, :-batch.response_length],
        max_response_length=data.max_response_length, max_prompt_length=data.max_prompt_length)
    if batch.num_turns is not None:  # verl's `num_turns/*` of agent-loop rows
        turns = batch.num_turns.float()
        metrics.update({"num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()),
                        "num_turns/mean": float(turns.mean())})
    response_tokens = float(batch.response_mask.sum())
    metrics.update(timing_metrics(dict(seconds), response_tokens=response_tokens,
                                  all_tokens=float(batch.attention_mask.sum())))
    metrics.update(throughput_metrics(int(batch.attention_mask.sum()), seconds["step"], world))
    return metrics


def memory_metrics(groups: Sequence[WorkerGroup]) -> dict[str, float]:
    """The peak device memory of the step and of each phase (:mod:`trainer.phases`), the
    largest over the ranks of every worker group (verl's `perf/max_memory_*_gb`)."""
    merged: dict[str, float] = {}
    for group in groups:
        for per_rank in group.run("memory_metrics"):
            for key, value in per_rank.items():
                merged[key] = max(merged.get(key, 0.0), value)
    return merged
