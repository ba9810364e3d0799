"""The validation stage: `val_kwargs.n` responses per validation prompt with `val_kwargs` (greedy
by default), scored like training's, reported as verl's validation metrics; the first
`trainer.log_val_generations` rows kept as text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.batch import StepBatch, need
from trainer.data import Example, PromptDataset, batches
from trainer.metrics import validation_metrics

__all__ = ["VAL_GENERATIONS_FILE", "generations", "log_generations", "validate"]

#: `trainer.log_val_generations` samples, one JSON object per line, in `trainer.run_dir`.
VAL_GENERATIONS_FILE = "val_generations.jsonl"


@torch.no_grad()
def validate(val_set: PromptDataset, batch_size: int | None, generate: Callable[[list[Example]], StepBatch],
             score: Callable[[StepBatch], Any], tokenizer: Any, step: int, log_count: int
             ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """verl's validation metrics (:func:`trainer.metrics.validation_metrics`: the core number,
    `acc` or else the reward, under `val-core`, the rest under `val-aux`) over `val_set` in
    batches of `batch_size` (None: one), with `generate` (validation sampling) and `score` (the
    reward stage); and the first `log_count` rows as text."""
    sources: list[str] = []
    uids: list[int] = []
    columns: dict[str, list[Any]] = {"reward": []}
    samples: list[dict[str, Any]] = []
    turns: list[torch.Tensor] = []
    agentic = False
    offset = 0
    for examples in batches(val_set, batch_size):
        batch = generate(examples)
        score(batch)
        # verl's `__num_turns__` (`ray_trainer._validate`): a row outside the agent loops is one
        # prompt and one answer, 2 turns, as verl's `single_turn_agent` counts it
        turns.append(batch.num_turns.float() if batch.num_turns is not None
                     else torch.full((len(batch.examples),), 2.0))
        agentic = agentic or batch.num_turns is not None
        scores = need(batch.sequence_scores, "scores").tolist()
        before = len(sources)
        sources += [e.data_source for e in batch.examples]
        uids += [offset + u for u in batch.uids]  # a prompt's n responses share its uid
        offset += len(examples)
        for name, values in {"reward": scores, **batch.reward_extras}.items():
            columns.setdefault(name, [None] * before).extend(values)
        for values in columns.values():  # a column this batch's rewards lacked: blanks
            values.extend([None] * (len(sources) - len(values)))
        samples += generations(batch, scores, log_count - len(samples), tokenizer, step)
    complete = {k: v for k, v in columns.items() if all(x is not None for x in v)}
    metrics = validation_metrics(sources, uids, complete)
    if agentic:  # verl logs them from its agent loops, which every verl rollout goes through
        every = torch.cat(turns)
        metrics.update({"val-aux/num_turns/min": float(every.min()), "val-aux/num_turns/max": float(every.max()),
                        "val-aux/num_turns/mean": float(every.mean())})
    return metrics, samples


def generations(batch: StepBatch, scores: list[float], count: int, tokenizer: Any, step: int
                ) -> list[dict[str, Any]]:
    """The first `count` rows of a validation batch as text (`trainer.log_val_generations`):
    the validation set's order is fixed, so every validation shows the same prompts."""
    rows = []
    prompt_len = batch.input_ids.shape[1] - batch.response_length
    for i in range(min(max(count, 0), len(batch))):
        prompt = batch.input_ids[i, :prompt_len][batch.attention_mask[i, :prompt_len].bool()]
        response = batch.responses[i][batch.response_attention[i].bool()]
        rows.append({"step": step, "data_source": batch.examples[i].data_source,
                     "input": tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
                     "output": tokenizer.decode(response.tolist(), skip_special_tokens=True),
                     "score": scores[i]})
    return rows


def log_generations(run_dir: Path, samples: list[dict[str, Any]], console: bool) -> None:
    """Append `samples` to `<run_dir>/val_generations.jsonl`; print them too on the console."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / VAL_GENERATIONS_FILE, "a") as fh:
        for row in samples:
            fh.write(json.dumps(row) + "\n")
    if console:
        for row in samples:
            print(f"val generation (step {row['step']}, score {row['score']:.3f}): "
                  f"{row['input']!r} -> {row['output']!r}", flush=True)
