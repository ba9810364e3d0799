"""`trainer.rollout_data_dir` and `trainer.validation_data_dir`: each step's (each validation's)
generations as JSONL, one file per step, in verl's layout (verl 0.9.1 ray_trainer
`_write_generations`: `<dir>/<global_steps>.jsonl`, one object per row with `input`, `output`,
`gts`, `score`, `step` and every reward extra that has a value per row)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from trainer.batch import StepBatch, need

__all__ = ["ValidationDump", "batch_columns", "dump_rollout", "write_generations"]


def write_generations(dump_dir: str, step: int, inputs: list[str], outputs: list[str], gts: list[Any],
                      scores: list[float], extras: dict[str, list[Any]]) -> str:
    """Write `<dump_dir>/<step>.jsonl` as verl's `_write_generations` does (an extra whose length
    is not the row count is left out, as there; values JSON cannot hold are written as `str`);
    return the file's path. verl writes from a background thread; here the write is done when
    this returns, so a step that ends has its file."""
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"{step}.jsonl")
    n = len(inputs)
    columns: dict[str, list[Any]] = {"input": inputs, "output": outputs, "gts": gts, "score": scores,
                                     "step": [step] * n}
    columns.update({k: v for k, v in extras.items() if len(v) == n})
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False, default=str) + "\n")
    return path


def batch_columns(batch: StepBatch, tokenizer: Any) -> tuple[list[str], list[str], list[Any], list[float]]:
    """A scored batch's `input`, `output`, `gts` and `score` columns as verl takes them
    (`_log_rollout_data`): the prompt and the response decoded with `skip_special_tokens=True`
    (verl decodes the padded tensors, whose pad tokens that drops; here the attended tokens),
    the ground truth of `reward_model`, and the sum of the token-level scores (before any KL
    penalty)."""
    prompt_len = batch.input_ids.shape[1] - batch.response_length
    prompts = [row[mask.bool()].tolist() for row, mask in
               zip(batch.input_ids[:, :prompt_len], batch.attention_mask[:, :prompt_len], strict=True)]
    responses = [row[mask.bool()].tolist() for row, mask in
                 zip(batch.responses, batch.response_attention, strict=True)]
    inputs = [str(tokenizer.decode(p, skip_special_tokens=True)) for p in prompts]
    outputs = [str(tokenizer.decode(r, skip_special_tokens=True)) for r in responses]
    scores = need(batch.token_scores, "token_scores").sum(-1).tolist()
    return inputs, outputs, [e.ground_truth for e in batch.examples], scores


def dump_rollout(dump_dir: str, step: int, batch: StepBatch, tokenizer: Any) -> str:
    """`trainer.rollout_data_dir`: a training step's scored batch (verl `_log_rollout_data`)."""
    return write_generations(dump_dir, step, *batch_columns(batch, tokenizer), dict(batch.reward_extras))


class ValidationDump:
    """`trainer.validation_data_dir`: every row of one validation pass, gathered as each batch
    is scored (:meth:`scoring` wraps the reward stage) and written by :meth:`write` (verl
    `_validate`: the extras are `reward`, the score again, and the reward extras)."""

    def __init__(self, dump_dir: str | None, tokenizer: Any) -> None:
        self.dump_dir, self.tokenizer = dump_dir, tokenizer
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.gts: list[Any] = []
        self.scores: list[float] = []
        self.extras: dict[str, list[Any]] = {}

    def scoring(self, score: Callable[[StepBatch], Any]) -> Callable[[StepBatch], Any]:
        """`score`, gathering each batch it scored when a directory is set."""
        if not self.dump_dir:
            return score

        def scored(batch: StepBatch) -> Any:
            result = score(batch)
            inputs, outputs, gts, scores = batch_columns(batch, self.tokenizer)
            self.inputs += inputs
            self.outputs += outputs
            self.gts += gts
            self.scores += scores
            for name, values in {"reward": scores, **batch.reward_extras}.items():
                self.extras.setdefault(name, []).extend(values)  # one a batch lacked: short, left out
            return result
        return scored

    def write(self, step: int) -> str | None:
        """Write the gathered rows as `<step>.jsonl`; None without a directory."""
        if not self.dump_dir:
            return None
        n = len(self.inputs)
        return write_generations(self.dump_dir, step, self.inputs, self.outputs, self.gts, self.scores,
                                 {k: v for k, v in self.extras.items() if len(v) == n})
