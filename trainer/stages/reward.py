"""The reward stage: decode each response, score it with its data source's function (verl's
reward managers `naive`, `prime`, `dapo`, `batch`) or with a discriminative reward model (verl's
`reward_model.enable`), and place the score on its last token."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from trainer.algos import core_algos
from trainer.batch import StepBatch, need
from trainer.config import Config, RewardModelConfig
from trainer.rewards import (
    BATCH_ARGS,
    PER_RESPONSE_ARGS,
    ROW_THREADS,
    default_compute_score,
    load_reward_fn,
    overlong_penalty,
    score_batch,
    score_responses,
)
from trainer.rewards.model import SequenceClassifierRM, legacy_rm_ids, render_rm_prompt
from trainer.rewards.prime import score_prime
from trainer.rewards.sandbox_fusion import SandboxScorer
from trainer.rewards.server import RewardServer, RewardServerError, router_kwargs
from trainer.workers.base import resolve_device
from trainer.workers.group import WorkerGroup

__all__ = ["SINGLE_TURN_FIELDS", "GenerativeRewardEngine", "ModelRewardEngine", "RewardEngine", "RuleRewardEngine", "build_reward_engine", "load_reward",
           "loop_reward_inputs", "score_rollouts", "set_reward_baselines"]


class RewardEngine(Protocol):
    """What scores responses, for every loop that has rows to score: the synchronous step, the
    validation pass, and an asynchronous rollouter scoring each group as it finishes.

    `score(batch)` fills `batch.sequence_scores`, `reward_extras` and `token_scores` for every row
    of `batch` (any rows: a whole step, one prompt's group, a validation batch) and returns the
    step metrics it has (`reward_extra/<name>/mean`, a reward model's own timings). It may be
    called from a thread other than the driver's (`launch_reward_fn_async`, a rollouter), one call
    at a time per engine. `close()` releases what the engine started (a reward-model server, its
    workers); scoring after it is an error.

    An engine whose model runs on the actor's ranks also has `attach(group)`, which the driver
    calls with the actor group once it is started; before that it scores in this process. Its
    model wakes for each `score` and sleeps again before it returns (the actor trains with none
    of its weights on the device), so a loop need not manage it (:class:`ModelRewardEngine`)."""

    def score(self, batch: StepBatch) -> dict[str, float]: ...

    def close(self) -> None: ...


class RuleRewardEngine:
    """The rule rewards alone: `custom_reward_function.*` (or the default scorers) under verl's
    reward manager (:func:`score_rollouts`)."""

    def __init__(self, cfg: Config, tokenizer: Any, **router: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.reward_fn = load_reward(cfg, **router)

    def score(self, batch: StepBatch) -> dict[str, float]:
        return score_rollouts(batch, self.tokenizer, self.reward_fn, self.cfg.reward_model,
                              self.cfg.data.max_response_length)

    def close(self) -> None:
        pass


class ModelRewardEngine:
    """`reward_model.enable=true` without `custom_reward_function.path`: the discriminative reward
    model of `reward_model.model.path` scores every response, and its score is the reward (verl
    0.9.1 `RewardLoopWorker.compute_score` calls `compute_score_disrm` in place of the reward
    manager; `assemble_rm_scores` puts it on the last attended response token as `rm_scores`,
    which the trainer takes as `token_level_scores`, and the KL penalty applies to them as to a
    rule score). There are no reward extras, as in verl's `{"reward_score": rm_score}`.

    The prompts are rendered here (the reward model's tokenizer only); the model runs colocated
    on the ranks of the actor group once :meth:`attach` gave it (each rank scores a contiguous
    share of the rows with its own copy, asleep on the host while the actor trains:
    :mod:`trainer.workers.reward`), else in this process. A row whose agent loop set its own
    score keeps it (as in :func:`score_rollouts`).

    `reward_model.use_reward_loop=false` scores as verl's legacy reward model worker: the chat
    rendered with its BOS, tokenized with no special tokens added and cut to
    `reward_model.max_length` tokens (null: `data.max_prompt_length + data.max_response_length`,
    the width of verl's padded batch), the model in bf16 (:func:`trainer.rewards.model.legacy_rm_ids`)."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        from transformers import AutoTokenizer

        path = cfg.reward_model.model.path
        assert path is not None, "checked by the config: `reward_model.model.path`"
        self.path, self.tokenizer, self.device_name = path, tokenizer, cfg.trainer.device
        self.legacy = not cfg.reward_model.use_reward_loop
        self.dtype: str | None = "bfloat16" if self.legacy else cfg.reward_model.rollout.get("dtype")
        self.rows_per_forward = cfg.reward_model.micro_batch_size_per_gpu
        self.max_length = cfg.reward_model.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
        self.rm_tokenizer = AutoTokenizer.from_pretrained(path)
        self.group: WorkerGroup | None = None
        self.local: SequenceClassifierRM | None = None
        self.closed = False

    def attach(self, group: WorkerGroup) -> None:
        """Score on the ranks of `group` (the actor's) from now on."""
        self.group = group

    def score(self, batch: StepBatch) -> dict[str, float]:
        if self.closed:
            raise RuntimeError("the reward model engine was closed; build a new one to score")
        attended = batch.response_attention
        lengths = attended.sum(-1).long().tolist()
        own = batch.loop_scores or [None] * len(batch)
        todo = [i for i, score in enumerate(own) if score is None]
        texts: list[str | list[int]] = []
        for i in todo:
            text = render_rm_prompt([dict(m) for m in batch.examples[i].prompt],
                                    batch.responses[i, :lengths[i]].tolist(), self.tokenizer, self.rm_tokenizer,
                                    keep_bos=self.legacy)
            texts.append(legacy_rm_ids(text, self.rm_tokenizer, self.max_length) if self.legacy else text)
        scores = [float(s) if s is not None else 0.0 for s in own]
        for i, value in zip(todo, self._scores(texts) if texts else [], strict=True):
            scores[i] = value
        batch.sequence_scores = torch.tensor(scores, dtype=torch.float32)
        batch.reward_extras = {}
        batch.token_scores = core_algos.scores_to_token_level(batch.sequence_scores, attended)
        return {}

    def _scores(self, texts: list[str | list[int]]) -> list[float]:
        if self.group is None:
            if self.local is None:
                self.local = SequenceClassifierRM(self.path, resolve_device(self.device_name), self.dtype)
            try:
                return self.local.score_texts(texts, self.rows_per_forward)
            finally:
                self.local.sleep()
        shares = np.array_split(np.arange(len(texts)), self.group.world_size)
        parts = self.group.run_each("score_reward_model",
                                    [(self.path, self.dtype, [texts[i] for i in share], self.rows_per_forward)
                                     for share in shares])
        return [float(x) for part in parts for x in part]

    def close(self) -> None:
        if self.local is not None:
            self.local.sleep()
        self.closed = True


class GenerativeRewardEngine:
    """`reward_model.enable=true` with `custom_reward_function.path`: a generative reward model.
    `reward_model.model.path` is served by an OpenAI-compatible server
    (:class:`trainer.rewards.server.RewardServer`) and the reward function, under its reward
    manager as for rule rewards, receives `reward_router_address` (the server's `host:port`) and
    `reward_model_tokenizer` on every call, as verl 0.9.1's reward loop passes them
    (`NaiveRewardManager.run_single`).

    The server is checked before each scoring; a dead server, or a call through it that fails or
    times out, fails the step with a :class:`RewardServerError` naming the address. The batch
    is left unscored and the step's metrics and checkpoint are not written: a resumed run scores
    that step again."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        from transformers import AutoTokenizer

        path = cfg.reward_model.model.path
        assert path is not None, "checked by the config: `reward_model.model.path`"
        rm_tokenizer = AutoTokenizer.from_pretrained(path)
        self.server = RewardServer.start(path, cfg.reward_model.rollout)
        try:
            self.rules = RuleRewardEngine(cfg, tokenizer, **router_kwargs(self.server, rm_tokenizer))
        except BaseException:
            self.server.close()
            raise

    def score(self, batch: StepBatch) -> dict[str, float]:
        self.server.check()
        try:
            return self.rules.score(batch)
        except Exception as e:
            self.server.check(timeout_s=5.0)  # a dead server says so first
            raise RewardServerError(
                f"scoring through the reward model server at `{self.server.address}` failed: {e!r}; "
                "the step is not logged or saved (a resumed run scores it again)") from e

    def close(self) -> None:
        self.server.close()


def build_reward_engine(cfg: Config, tokenizer: Any) -> RewardEngine:
    """The reward engine the config asks for (verl 0.9.1 `RewardLoopWorker.compute_score`): with
    `reward_model.enable=true`, the generative reward model when `custom_reward_function.path` is
    set, else the discriminative one; without it, the rule rewards."""
    if cfg.reward_model.enable:
        if cfg.custom_reward_function.path is not None:
            return GenerativeRewardEngine(cfg, tokenizer)
        return ModelRewardEngine(cfg, tokenizer)
    return RuleRewardEngine(cfg, tokenizer)


def load_reward(cfg: Config, **router: Any) -> Callable[..., Any]:
    """The reward function of `custom_reward_function.*` (the default scorers without one),
    checked for the keywords the reward manager passes; `router`: a reward model server's
    `reward_router_address` and `reward_model_tokenizer`, passed on every call."""
    rm = cfg.reward_model
    keywords = [*BATCH_ARGS, *rm.reward_kwargs] if rm.reward_manager == "batch" else PER_RESPONSE_ARGS
    custom = cfg.custom_reward_function
    sf = rm.sandbox_fusion
    if custom.path is None and sf.url is not None:  # verl's `load_reward_manager`: the default scorer only
        sandbox = SandboxScorer(sf.url, sf.max_concurrent or 64, sf.memory_limit_mb or 1024)
        fn = partial(default_compute_score, sandbox=sandbox)
        setattr(fn, ROW_THREADS, sf.max_concurrent or 64)  # rows wait on the service: score them together
        return fn
    return load_reward_fn(custom.path, custom.name, {**custom.reward_kwargs, **router}, keywords=keywords)


#: The `extra_fields` of verl 0.9.1's single-turn loop (`single_turn_agent_loop.py`, "keeping the
#: schema consistent with tool_agent_loop"): what a row of the batched single-turn rollout, which
#: went through no agent loop here, would have carried, since every verl row runs one.
SINGLE_TURN_FIELDS: dict[str, Any] = {"turn_scores": [], "tool_rewards": []}


def loop_reward_inputs(batch: StepBatch) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per row, what verl's reward loop adds to `extra_info` from the agent loop: its
    `extra_fields` with `raw_prompt` (the row's chat messages, set by
    `AgentLoopWorker._agent_loop_postprocess`), and `__num_turns__` as the numpy integer verl's
    `_compute_score` hands over (`np.array([o.num_turns ...])`, one item of it). Rows outside
    the agent loops get the single-turn loop's values (2 turns, no scores)."""
    rows = len(batch)
    fields = batch.agent_extras or [SINGLE_TURN_FIELDS] * rows
    turns = batch.num_turns.tolist() if batch.num_turns is not None else [2] * rows
    return ([{**f, "raw_prompt": [dict(m) for m in e.prompt]} for f, e in zip(fields, batch.examples, strict=True)],
            list(np.array(turns, dtype=np.int64)))


def score_rollouts(batch: StepBatch, tokenizer: Any, reward_fn: Callable[..., Any], rm: RewardModelConfig,
                   max_response_length: int) -> dict[str, float]:
    """Fill `batch.sequence_scores`, `reward_extras` and `token_scores`; return the means of the
    numeric extras (`reward_extra/<name>/mean`). A response is what the model attends to after
    the prompt (`batch.response_attention`: in a multi-turn row the tool turns too), decoded and
    scored whole, its score on its last attended token (verl's reward managers and its agent
    loop's `rm_scores`: `valid_response_length = attention_mask[prompt_length:].sum()`).

    A row whose agent loop set its own score (`batch.loop_scores`) keeps it and the reward
    function is not called for it (verl 0.9.1 `AgentLoopWorker._compute_score` scores only
    outputs whose `reward_score` is None; `_postprocess` puts every `reward_score` on the last
    attended token as `rm_scores`). Such a row has no reward extras: its entries are None (verl
    takes the extra keys from the first row and fails with a KeyError on a mixed batch whose first
    row the reward function scored)."""
    attended = batch.response_attention
    lengths = attended.sum(-1).long().tolist()
    own = batch.loop_scores or [None] * len(batch)
    todo = [i for i, score in enumerate(own) if score is None]
    scores: list[float] = [float(s) if s is not None else 0.0 for s in own]
    extras: dict[str, list[Any]] = {}
    if todo:
        part, more = _reward_fn_scores(batch, todo, lengths, tokenizer, reward_fn, rm, max_response_length)
        for i, score in zip(todo, part, strict=True):
            scores[i] = score
        for key, values in more.items():
            extras[key] = [None] * len(batch)
            for i, value in zip(todo, values, strict=True):
                extras[key][i] = value
    batch.sequence_scores = torch.tensor(scores, dtype=torch.float32)
    batch.reward_extras = extras
    batch.token_scores = core_algos.scores_to_token_level(batch.sequence_scores, attended)
    numeric = {k: [x for x in v if x is not None] for k, v in extras.items()}
    return {f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in numeric.items()
            if v and not any(isinstance(x, str) for x in v)}


def _reward_fn_scores(batch: StepBatch, rows: list[int], lengths: list[int], tokenizer: Any,
                      reward_fn: Callable[..., Any], rm: RewardModelConfig, max_response_length: int
                      ) -> tuple[list[float], dict[str, list[Any]]]:
    """The reward manager's scores and extras of `rows` (those without a loop's own score)."""
    responses = batch.responses
    texts = [str(tokenizer.decode(responses[i, :lengths[i]].tolist(), skip_special_tokens=True)) for i in rows]
    examples = [batch.examples[i] for i in rows]
    args = (reward_fn, [e.data_source for e in examples], texts,
            [e.ground_truth for e in examples], [e.extra_info for e in examples])
    if rm.reward_manager == "batch":
        scores, extras = score_batch(*args, rm.reward_kwargs)
    elif rm.reward_manager == "prime":  # verl's legacy PrimeRewardManager: positional, pooled
        scores, extras = score_prime(*args), {}
    elif rm.reward_manager == "naive":  # verl 0.9.1's reward loop `naive` manager (`run_single`)
        fields, turns = loop_reward_inputs(batch)
        scores, extras = score_responses(*args, [fields[i] for i in rows], [turns[i] for i in rows])
    else:
        scores, extras = score_responses(*args)
    if rm.reward_manager == "dapo":
        if not extras:  # verl's dapo reports a plain score as the accuracy
            extras["acc"] = list(scores)
        buffer = rm.overlong_buffer
        if buffer.enable:
            max_len = rm.reward_kwargs.get("max_resp_len", max_response_length)
            penalties = overlong_penalty([lengths[i] for i in rows], max_len, buffer.len, buffer.penalty_factor)
            scores = [s + p for s, p in zip(scores, penalties, strict=True)]
            if buffer.log:
                extras["overlong_reward"] = penalties
                extras["overlong"] = [float(p < 0) for p in penalties]
    return scores, extras


def set_reward_baselines(batch: StepBatch, greedy: StepBatch) -> None:
    """ReMax's baseline (verl ray_trainer `gen_max`): the score of each prompt's greedy response
    (`greedy`, scored) is the baseline of every row of `batch` answering that prompt."""
    score_of = dict(zip(greedy.uids, need(greedy.sequence_scores, "scores").tolist(), strict=True))
    batch.reward_baselines = torch.tensor([score_of[uid] for uid in batch.uids], dtype=torch.float32)
