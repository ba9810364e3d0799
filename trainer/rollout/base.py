"""Rollout: sampling responses from the current policy, behind one engine interface.

An engine takes left-padded prompt token ids and :class:`SamplingParams` and returns a
:class:`RolloutBatch` in verl's layout: responses right-padded to ``max_response_length``,
``response_mask`` 1 up to and including the first EOS, and the sampling log-probs
``log_softmax(logits / temperature)`` of the sampled tokens (before top-k/top-p filtering, the
quantity the actor recomputes as ``old_log_prob``). Rows are ordered prompt-major: the ``n``
samples of prompt ``i`` are rows ``i*n .. i*n+n-1`` (``prompt_index`` says so).

:class:`~trainer.rollout.hf.HFRolloutEngine` uses transformers' ``generate`` and
:class:`~trainer.rollout.vllm.VLLMRolloutEngine` vLLM; both implement the :class:`RolloutEngine`
protocol.

Weight sync is streamed: :meth:`RolloutEngine.sync_weights` takes an iterable of *buckets*, each
a short sequence of ``(HF parameter name, whole tensor)`` pairs of bounded total size
(``actor_rollout_ref.rollout.update_weights_bucket_megabytes``), gathered lazily by the trainer
(:func:`trainer.parallel.weight_buckets`). An engine loads (copies) each bucket before asking for
the next, since the sender frees a bucket's tensors then; no rank ever holds the whole model on
top of the engine's own weights. The shape fits an engine in another process too: a server-mode
backend would send each bucket over IPC and load it on the far side, bucket by bucket.
:class:`WeightTally` checks that a sync delivered every parameter exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "AbortableEngine",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "WeightBucket",
    "WeightTally",
    "response_mask_from_eos",
]

#: One bucket of a streamed weight sync: `(HF parameter name, whole tensor)` pairs.
WeightBucket = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (verl's ``actor_rollout_ref.rollout`` names)."""

    n: int = 1
    """Responses sampled per prompt (``rollout.n``; GRPO groups)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass kept (1.0 disables)."""
    top_k: int = -1
    """Keep only the k most likely tokens (-1 or 0 disables, as in verl/vLLM)."""
    max_response_length: int = 256
    """Maximum number of generated tokens (``data.max_response_length``)."""
    do_sample: bool = True
    """False selects greedy decoding whatever the temperature (``val_kwargs.do_sample``)."""

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"`n` must be >= 1, received {self.n}")
        if self.temperature < 0:
            problems.append(f"`temperature` must be >= 0, received {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"`top_p` must be in (0, 1], received {self.top_p}")
        if self.top_k < -1:
            problems.append(f"`top_k` must be -1 (off) or >= 0, received {self.top_k}")
        if self.max_response_length < 1:
            problems.append(
                f"`max_response_length` must be >= 1, received {self.max_response_length}"
            )
        if problems:
            raise ValueError("Invalid sampling parameters: " + "; ".join(problems) + ".")

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (``do_sample=False`` or temperature 0)."""
        return not self.do_sample or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature the sampling log-probs are computed with (1.0 when greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutBatch:
    """Prompts and sampled responses, one row per response."""

    prompt_ids: torch.Tensor
    """``(rows, prompt_len)`` left-padded prompt token ids."""
    prompt_mask: torch.Tensor
    """``(rows, prompt_len)`` 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """``(rows, max_response_length)`` response ids, pad after the first EOS."""
    response_mask: torch.Tensor
    """``(rows, max_response_length)`` 1 up to and including the first EOS."""
    log_probs: torch.Tensor
    """``(rows, max_response_length)`` float32 sampling log-probs, 0 where masked."""
    prompt_index: torch.Tensor
    """``(rows,)`` index of the input prompt each row answers."""
    entropy: torch.Tensor | None = None
    """``(rows, max_response_length)`` float32 entropy of ``softmax(logits / temperature)`` at
    each response position, 0 where masked; None when the engine does not see full logits."""
    response_attention: torch.Tensor | None = None
    """``(rows, max_response_length)`` 1 on every response token the model attends to: the
    model's tokens and, in a multi-turn row, the tool and user turns between them (where
    ``response_mask`` is 0). None: the same as ``response_mask`` (a single-turn row)."""
    num_turns: torch.Tensor | None = None
    """``(rows,)`` verl's ``__num_turns__`` (user + assistant turns + 1) of agent-loop rows."""
    extra_fields: list[dict[str, Any]] | None = None
    """Per agent-loop row, its loop's ``extra_fields`` (``turn_scores``, ``tool_rewards``, ...)."""
    reward_scores: list[float | None] | None = None
    """Per agent-loop row, the score its loop set itself (verl's ``reward_score``), else None."""
    trajectory: torch.Tensor | None = None
    """``(rows,)`` each row's place in the whole batch (prompt x n + sample), when the rows were
    dealt out across replicas (:mod:`trainer.agent.dispatch`); None: ``prompt_index`` order."""
    aborted: torch.Tensor | None = None
    """``(rows,)`` bool, True where the engine was aborted before the row ended (a partial
    rollout's pause, :meth:`RolloutEngine.abort`): its tokens so far, with their log-probs;
    None: every row ended (a stop token or the length limit)."""

    @property
    def input_ids(self) -> torch.Tensor:
        """Prompt then response, the layout :mod:`trainer.models` expects."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        response = self.response_mask if self.response_attention is None else self.response_attention
        return torch.cat([self.prompt_mask, response.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_length(self) -> int:
        return int(self.response_ids.shape[1])

    @property
    def truncated(self) -> torch.Tensor:
        """``(rows,)`` True where the response hit the length limit without an EOS."""
        return self.response_mask.all(dim=1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend (HF ``generate``, vLLM in-process; a
    server-mode backend fed over IPC/HTTP fits the same calls: `generate` sends the prompts and
    waits, `sync_weights` streams the buckets to the servers)."""

    collective: bool
    """Several ranks form one engine (tensor-parallel vLLM): every rank of the group calls
    :meth:`generate` each time, with its prompts or none."""

    @property
    def needs_sync(self) -> bool:
        """The engine holds no valid weights (discarded while asleep): :meth:`sync_weights`
        must run before the next :meth:`generate`."""
        ...

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> RolloutBatch:
        """Sample ``params.n`` responses for each left-padded prompt row."""
        ...

    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Load the actor's current weights (HF parameter names), one bucket at a time: copy
        each bucket's tensors in before asking for the next bucket, and fail unless the buckets
        held every parameter exactly once."""
        ...

    def sleep(self) -> None:
        """Release memory between rollouts (may be a no-op)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` before the next :meth:`generate`: all of it, or only the parts
        named in `tags` (`weights`, `kv_cache`: vLLM's sleep-mode tags; the weight sync wakes
        the weights first and the KV cache once the sync's memory is freed)."""
        ...


@runtime_checkable
class AbortableEngine(RolloutEngine, Protocol):
    """An engine whose generation a partial rollout can pause (the HF engine between decode steps,
    vLLM's in-process engine between engine steps): `generate`, abortable, returns partial."""

    def abort(self) -> None:
        """End the generation in flight early (callable from another thread), its unfinished
        rows returned partial (`RolloutBatch.aborted`, a token output's `finish_reason="abort"`),
        and every generation after it until :meth:`resume` (verl's `abort_all_requests`)."""
        ...

    def resume(self) -> None:
        """Generate in full again after :meth:`abort` (verl's `resume_generation`)."""
        ...


def response_mask_from_eos(
    response_ids: torch.Tensor, eos_token_ids: Iterable[int]
) -> torch.Tensor:
    """1 on every token up to and including the first EOS of each row, 0 after it."""
    eos = torch.as_tensor(sorted(set(eos_token_ids)), dtype=response_ids.dtype)
    is_eos = torch.isin(response_ids, eos).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_before == 0).long()


class WeightTally:
    """What a streamed weight sync delivered: :meth:`add` refuses a name sent twice,
    :meth:`check` refuses an empty sync or (given the names the engine expects) a partial one."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.bytes = 0
        self.buckets = 0

    def add(self, bucket: WeightBucket) -> None:
        self.buckets += 1
        for name, tensor in bucket:
            if name in self.names:
                raise ValueError(f"weight sync: `{name}` arrived twice; each parameter must be sent once")
            self.names.add(name)
            self.bytes += tensor.numel() * tensor.element_size()

    def check(self, expected: Iterable[str] | None = None) -> None:
        if not self.names:
            raise ValueError(
                "weight sync received no weights, which would leave the engine on its old ones. "
                "Fix: pass the buckets of `trainer.parallel.weight_buckets(model, ...)`")
        missing = sorted(set(expected or ()) - self.names)
        if missing:
            shown = ", ".join(f"`{n}`" for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"weight sync was partial: {len(missing)} parameter(s) never arrived ({shown}); the "
                "engine would mix old and new weights. Fix: iterate every rank's "
                "`weight_buckets` to the end, on every rank")
