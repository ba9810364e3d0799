"""What travels between the driver and the workers: one step's samples (:class:`StepBatch`),
how they split into micro-batches, and the seeds that make a resumed run draw what an
unbroken one did."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

__all__ = ["MiniBatchShare", "StepBatch", "concat_batches", "micro_batch_rows", "need", "seed_everything", "step_seed"]


@dataclass
class StepBatch:
    """One step's samples: prompt (left-padded) + response (right-padded), and what PPO adds."""

    examples: list[Any]
    uids: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    """The engine's log-probs of the sampled tokens (`rollout.calculate_log_probs`)."""
    rollout_is_weights: torch.Tensor | None = None
    """The rollout correction's importance weights (`algorithm.rollout_correction.rollout_is`)."""
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    sequence_scores: torch.Tensor | None = None
    reward_extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per-row numbers a reward function returned beside `score` (e.g. `acc`)."""
    token_scores: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    """Per-row score of the prompt's greedy response (ReMax)."""
    token_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    num_turns: torch.Tensor | None = None
    """verl's `__num_turns__` per row (agent-loop rollouts)."""
    agent_extras: list[dict[str, Any]] = field(default_factory=list)
    """Per row, its agent loop's `extra_fields` (`turn_scores`, `tool_rewards`, ...); empty
    when the rows did not go through agent loops. The reward stage passes them in `extra_info`."""
    loop_scores: list[float | None] = field(default_factory=list)
    """Per row, the score its agent loop set itself (verl's `reward_score`), else None; empty
    when the rows did not go through agent loops."""
    weight_version: int | None = None
    """The weight version that generated the batch (a rollout pool's; None where the rollout
    shares the trainer's weights)."""
    aborted: torch.Tensor | None = None
    """``(rows,)`` bool, True where the engine was aborted before the row ended (a partial
    rollout's pause at a weight sync): the row is continued before it is trained
    (:mod:`trainer.async_rl.partial`); None: every row ended."""

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def response_attention(self) -> torch.Tensor:
        """1 on every response token attended to: the model's and, in multi-turn rows, the tool
        and user turns' (`response_mask` is 1 on the model's only). verl's reward managers and
        length metrics read the response from this (`attention_mask[:, -response_length:]`)."""
        return self.attention_mask[:, -self.response_length:]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_length:]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: list[int]) -> StepBatch:
        """The rows `rows` of every per-sample field."""
        index = torch.as_tensor(rows, dtype=torch.long)
        picked: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[index.to(value.device)]
            elif isinstance(value, list) and value:  # workers get tensors only (empty lists)
                picked[f.name] = [value[i] for i in rows]
            elif isinstance(value, dict) and value:
                picked[f.name] = {k: [v[i] for i in rows] for k, v in value.items()}
        return replace(self, **picked)

    def take_rows(self, rows: list[int]) -> None:
        """Become :meth:`select` of `rows`, in place (a row may be taken twice: PF-PPO's draw)."""
        picked = self.select(rows)
        for f in fields(self):
            setattr(self, f.name, getattr(picked, f.name))

    def tensors_only(self) -> StepBatch:
        """The batch without its examples and uids: what a worker receives."""
        return replace(self, examples=[], uids=[], reward_extras={}, agent_extras=[], loop_scores=[])

    def to(self, device: torch.device) -> StepBatch:
        """Every tensor on `device`."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


_SEQUENCE = ("input_ids", "attention_mask")
"""Fields laid out prompt then response: left-padded prompts, right-padded responses."""


def concat_batches(batches: list[StepBatch], pad_token_id: int) -> StepBatch:
    """The rows of `batches` in one batch, in order: prompts left-padded to the widest prompt,
    responses right-padded to the longest (pad token in `input_ids`, 0 elsewhere), as the
    rollout lays a batch out. Per-token fields are the response's width; per-row fields and lists
    are joined; the weight version is the oldest. For samples generated apart (the fully-async
    rollouter's) that are trained together."""
    if not batches:
        raise ValueError("no batches to join")
    width = max(b.response_length for b in batches)
    prompt = max(int(b.input_ids.shape[1]) - b.response_length for b in batches)
    out: dict[str, Any] = {}
    for f in fields(StepBatch):
        values = [getattr(b, f.name) for b in batches]
        if f.name == "weight_version":
            known = [v for v in values if v is not None]
            out[f.name] = min(known) if known else None
        elif all(v is None for v in values):
            out[f.name] = None
        elif any(v is None for v in values) and any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"`{f.name}` is set in some batches and not in others: they were not "
                             "generated alike")
        elif isinstance(values[0], torch.Tensor):
            out[f.name] = torch.cat([_widen(f.name, v, b.response_length, prompt, width, pad_token_id)
                                     for v, b in zip(values, batches, strict=True)])
        elif isinstance(values[0], list):
            if any(values) and not all(len(v) == len(b) for v, b in zip(values, batches, strict=True)):
                raise ValueError(f"`{f.name}` is per row in some batches and empty in others")
            out[f.name] = [x for v in values for x in v]
        elif isinstance(values[0], dict):
            keys = set(values[0])
            if any(set(v) != keys for v in values):
                raise ValueError(f"`{f.name}` has different keys across the batches: "
                                 f"{sorted({k for v in values for k in v})}")
            out[f.name] = {k: [x for v in values for x in v[k]] for k in values[0]}
        else:
            raise TypeError(f"`{f.name}`: cannot join {type(values[0]).__name__} values")
    return StepBatch(**out)


def _widen(name: str, value: torch.Tensor, response: int, prompt: int, width: int, pad_token_id: int) -> torch.Tensor:
    """`value` of one batch padded to the joined widths (see :func:`concat_batches`)."""
    if value.dim() < 2:  # per row
        return value
    fill = pad_token_id if name == "input_ids" else 0
    if name in _SEQUENCE:
        head, tail = value[:, :value.shape[1] - response], value[:, value.shape[1] - response:]
        left = value.new_full((value.shape[0], prompt - head.shape[1]), fill)
        right = value.new_full((value.shape[0], width - response), fill)
        return torch.cat([left, head, tail, right], 1)
    if value.shape[1] != response:
        raise ValueError(f"`{name}` is {value.shape[1]} wide, not the response's {response}")
    return torch.cat([value, value.new_full((value.shape[0], width - response), 0)], 1)


def micro_batch_rows(rows: int, micro_batch_size: int | None) -> list[list[int]]:
    """Rows 0..rows-1 in consecutive micro-batches of `micro_batch_size` (all in one without a
    size), as verl's `split`. Token-budget micro-batches: `trainer.parallel.rank_micro_batches`."""
    size = micro_batch_size or rows or 1
    return [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]


def need(value: torch.Tensor | None, what: str) -> torch.Tensor:
    """`value`, which an earlier phase must have filled in."""
    if value is None:
        raise RuntimeError(f"`{what}` is missing: the phase that computes it did not run")
    return value


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for one step's randomness, so a resumed run draws exactly what an unbroken one did."""
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class MiniBatchShare:
    """One rank's rows of one mini-batch, with the loss normalisers of the whole mini-batch
    (every rank's rows, skipped rows included) that verl's model engine divides by
    (`trainer.use_legacy_worker_impl=disable`)."""

    batch: StepBatch
    num_tokens: float
    """Response tokens of the whole mini-batch."""
    num_seqs: float
    """Rows of the whole mini-batch (verl's `global_batch_size`, rows without tokens counted)."""
