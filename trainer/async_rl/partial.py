"""verl's partial rollout (`async_training.partial_rollout`): a response in flight at a weight
sync is paused and continued under the new weights, the tokens before and after the sync each
carrying the log-probs of the weights that sampled them.

verl 0.9.1 does it in its server client (`FullyAsyncLLMServerClient.generate`,
`verl/workers/rollout/llm_server.py`): the sync aborts every request in flight
(`CheckpointEngineManager.update_weights`: `abort_replicas`, the load, `resume_generation_replicas`);
each aborted request comes back with its tokens so far and their log-probs; the client sends the
prompt plus those tokens again, `max_tokens` shrunk by what was generated, and joins the tokens
and the log-probs of the parts in order. Every part carries its weight version (`global_steps`);
the response keeps the first as `min_global_steps` and the last as `max_global_steps`.

Here the rank's call returns at the abort (the engine hands back each unfinished row partial:
`StepBatch.aborted`); the rollouter queues the prompts whose rows all ended, as any others, and
keeps the rest in flight as a :class:`Partial`; once the new weights are loaded it continues
each unfinished row, prompt plus tokens so far, with the rest of the budget
(:func:`continuation`), and joins the parts (:func:`extend`). A continuation may be aborted in
turn at the next sync. The rows are single-turn rows (verl's fully-async rollouter sets
`single_turn_agent` unless `multi_turn.enable`): the continuation is what the single-turn loop's
turn is, one engine call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.batch import StepBatch
from trainer.rollout.base import RolloutBatch

__all__ = ["Partial", "Piece", "continuation", "extend", "pieces", "row_spans"]


@dataclass(frozen=True)
class Piece:
    """What one continuation added to a row."""

    tokens: list[int]
    log_probs: torch.Tensor
    """The sampling log-probs of `tokens`, under the weights that sampled them."""
    entropy: torch.Tensor | None
    ended: bool
    """The row ended (a stop token, or its budget); False: aborted again, to be continued."""


def pieces(out: RolloutBatch, left: list[int]) -> list[Piece]:
    """A continuation call's rows (one per continued row, sampled up to the longest budget) cut
    each at its own budget `left[i]`."""
    found = []
    for i, budget in enumerate(left):
        n = min(int(out.response_mask[i].sum()), budget)
        aborted = out.aborted is not None and bool(out.aborted[i]) and n < budget
        found.append(Piece(out.response_ids[i, :n].tolist(), out.log_probs[i, :n],
                           None if out.entropy is None else out.entropy[i, :n], not aborted))
    return found


@dataclass
class Partial:
    """One prompt's `rollout.n` rows, some of them paused mid-response at a weight sync."""

    batch: StepBatch
    """The prompt's rows as generated so far (prompt left-padded, response right-padded to the budget)."""
    parts: list[list[tuple[int, int]]]
    """Per row, the (weight version, tokens) of each part of its response, in order."""
    open: list[int] = field(default_factory=list)
    """The rows not ended yet (aborted, to be continued)."""

    @classmethod
    def start(cls, batch: StepBatch, version: int) -> Partial:
        """The prompt's rows as a rank's call returned them under weights `version`."""
        lengths = batch.response_attention.sum(-1).tolist()
        aborted = batch.aborted.tolist() if batch.aborted is not None else [False] * len(batch)
        parts = [[(version, int(n))] for n in lengths]
        return cls(batch, parts, [r for r, a in enumerate(aborted) if a and lengths[r] < batch.response_length])

    @property
    def finished(self) -> bool:
        return not self.open

    def sample(self) -> StepBatch:
        """The finished prompt's rows, ready for the queue."""
        if self.open:
            raise RuntimeError(f"rows {self.open} of the prompt are not finished")
        self.batch.aborted = None
        return self.batch


def _prompt_width(batch: StepBatch) -> int:
    return int(batch.input_ids.shape[1]) - batch.response_length


def continuation(p: Partial) -> tuple[list[list[int]], list[int]]:
    """For each open row, in order: its prompt and tokens so far (what the engine continues from),
    and the tokens left of its budget (`data.max_response_length` less those generated)."""
    width, budget = _prompt_width(p.batch), p.batch.response_length
    prompts, left = [], []
    for r in p.open:
        ids, mask = p.batch.input_ids[r], p.batch.attention_mask[r]
        done = sum(n for _, n in p.parts[r])
        prompts.append(ids[:width][mask[:width].bool()].tolist() + ids[width:width + done].tolist())
        left.append(budget - done)
    return prompts, left


def extend(p: Partial, added: list[Piece], version: int) -> None:
    """Join each open row's continuation (`added`, in :func:`continuation`'s order), generated
    under weights `version`: its tokens after the row's, their log-probs (and entropies) after
    the row's; a row aborted again stays open."""
    if len(added) != len(p.open):
        raise ValueError(f"{len(added)} continuations for {len(p.open)} open rows")
    b, width = p.batch, _prompt_width(p.batch)
    still = []
    for r, piece in zip(p.open, added, strict=True):
        done, m = sum(n for _, n in p.parts[r]), len(piece.tokens)
        if done + m > b.response_length:
            raise ValueError(f"row {r}: {done} + {m} tokens exceed the budget of {b.response_length}")
        span, tail = slice(width + done, width + done + m), slice(done, done + m)
        b.input_ids[r, span] = torch.as_tensor(piece.tokens, dtype=b.input_ids.dtype)
        b.attention_mask[r, span] = 1
        b.response_mask[r, tail] = 1
        if b.rollout_log_probs is not None:
            b.rollout_log_probs[r, tail] = piece.log_probs.to(b.rollout_log_probs.dtype)
        if b.entropy is not None:
            if piece.entropy is None:
                raise ValueError(f"row {r}: its first part came with entropies, its continuation without")
            b.entropy[r, tail] = piece.entropy.to(b.entropy.dtype)
        p.parts[r].append((version, m))
        if not piece.ended and done + m < b.response_length:
            still.append(r)
    p.open = still


def row_spans(parts: tuple[tuple[tuple[int, int], ...], ...], rows: int, version: int) -> list[int]:
    """Per row, the versions between the weights that began it and those that ended it (verl's
    `max_global_steps - min_global_steps`); 0 for every row of a sample without parts."""
    if not parts:
        return [0] * rows
    return [row[-1][0] - row[0][0] for row in parts]
