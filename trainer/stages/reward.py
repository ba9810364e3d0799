"""The reward stage: decode each response, score it with its data source's function (verl's
reward managers `naive`, `prime`, `dapo`, `batch`), and place the score on its last token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer.algos import core_algos
from trainer.batch import StepBatch, need
from trainer.config import Config, RewardModelConfig
from trainer.rewards import (
    BATCH_ARGS,
    PER_RESPONSE_ARGS,
    load_reward_fn,
    overlong_penalty,
    score_batch,
    score_responses,
)

__all__ = ["load_reward", "score_rollouts", "set_reward_baselines"]


def load_reward(cfg: Config) -> Callable[..., Any]:
    """The reward function of `custom_reward_function.*` (the default scorers without one),
    checked for the keywords the reward manager passes."""
    rm = cfg.reward_model
    keywords = [*BATCH_ARGS, *rm.reward_kwargs] if rm.reward_manager == "batch" else PER_RESPONSE_ARGS
    custom = cfg.custom_reward_function
    return load_reward_fn(custom.path, custom.name, custom.reward_kwargs, keywords=keywords)


def score_rollouts(batch: StepBatch, tokenizer: Any, reward_fn: Callable[..., Any], rm: RewardModelConfig,
                   max_response_length: int) -> dict[str, float]:
    """Fill `batch.sequence_scores`, `reward_extras` and `token_scores`; return the means of the
    numeric extras (`reward_extra/<name>/mean`). A response is what the model attends to after
    the prompt (`batch.response_attention`: in a multi-turn row the tool turns too), decoded and
    scored whole, its score on its last attended token (verl's reward managers and its agent
    loop's `rm_scores`: `valid_response_length = attention_mask[prompt_length:].sum()`)."""
    attended = batch.response_attention
    lengths = attended.sum(-1).long().tolist()
    texts = [str(tokenizer.decode(row[:n].tolist(), skip_special_tokens=True))
             for row, n in zip(batch.responses, lengths, strict=True)]
    args = (reward_fn, [e.data_source for e in batch.examples], texts,
            [e.ground_truth for e in batch.examples], [e.extra_info for e in batch.examples])
    if rm.reward_manager == "batch":
        scores, extras = score_batch(*args, rm.reward_kwargs)
    else:
        scores, extras = score_responses(*args)
    if rm.reward_manager == "dapo":
        if not extras:  # verl's dapo reports a plain score as the accuracy
            extras["acc"] = list(scores)
        buffer = rm.overlong_buffer
        if buffer.enable:
            max_len = rm.reward_kwargs.get("max_resp_len", max_response_length)
            penalties = overlong_penalty(lengths, max_len, buffer.len, buffer.penalty_factor)
            scores = [s + p for s, p in zip(scores, penalties, strict=True)]
            if buffer.log:
                extras["overlong_reward"] = penalties
                extras["overlong"] = [float(p < 0) for p in penalties]
    batch.sequence_scores = torch.tensor(scores, dtype=torch.float32)
    batch.reward_extras = extras
    batch.token_scores = core_algos.scores_to_token_level(batch.sequence_scores, attended)
    return {f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extras.items()
            if not any(isinstance(x, str) for x in v)}


def set_reward_baselines(batch: StepBatch, greedy: StepBatch) -> None:
    """ReMax's baseline (verl ray_trainer `gen_max`): the score of each prompt's greedy response
    (`greedy`, scored) is the baseline of every row of `batch` answering that prompt."""
    score_of = dict(zip(greedy.uids, need(greedy.sequence_scores, "scores").tolist(), strict=True))
    batch.reward_baselines = torch.tensor([score_of[uid] for uid in batch.uids], dtype=torch.float32)
