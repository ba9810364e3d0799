"""Each stage of the step (`trainer.stages`) alone, on a hand-made batch: no driver, no model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer.algos import core_algos
from trainer.batch import StepBatch
from trainer.config import load_config
from trainer.data import Example
from trainer.stages.advantage import compute_advantages
from trainer.stages.reward import score_rollouts


class WordTokenizer:
    """Token id i decodes to the word `w<i>`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def _example(i: int, truth: str = "7", source: str = "toy") -> Example:
    return Example(index=i, data_source=source, prompt=[{"role": "user", "content": "q"}], ability="",
                   reward_model={"ground_truth": truth}, extra_info={"index": i}, prompt_ids=[1])


def _batch(lengths: list[int], uids: list[int] | None = None, prompt: int = 2, resp: int = 4) -> StepBatch:
    """Rows with `lengths` response tokens (ids 10, 11, ...), prompts of `prompt` tokens."""
    rows = len(lengths)
    response_mask = (torch.arange(resp)[None, :] < torch.tensor(lengths)[:, None]).float()
    ids = torch.cat([torch.ones(rows, prompt, dtype=torch.long),
                     10 + torch.arange(resp).repeat(rows, 1)], dim=1)
    mask = torch.cat([torch.ones(rows, prompt, dtype=torch.long), response_mask.long()], dim=1)
    return StepBatch(examples=[_example(i) for i in range(rows)], uids=uids or list(range(rows)),
                     input_ids=ids, attention_mask=mask, response_mask=response_mask)


# ------------------------------------------------------------------------ reward


def test_reward_scores_each_decoded_response_on_its_last_token() -> None:
    seen: list[tuple[str, str, Any]] = []

    def words(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> dict[str, Any]:
        seen.append((data_source, solution_str, ground_truth))
        return {"score": float(len(solution_str.split())), "acc": 1.0, "pred": "x"}

    batch = _batch([1, 3])
    cfg = load_config([])
    metrics = score_rollouts(batch, WordTokenizer(), words, cfg.reward_model, cfg.data.max_response_length)
    assert seen == [("toy", "w10", "7"), ("toy", "w10 w11 w12", "7")]  # only the real tokens
    assert batch.sequence_scores.tolist() == [1.0, 3.0]  # type: ignore[union-attr]
    assert batch.token_scores.tolist() == [[1.0, 0, 0, 0], [0, 0, 3.0, 0]]  # type: ignore[union-attr]
    assert metrics == {"reward_extra/acc/mean": 1.0}  # a text extra has no mean
    assert batch.reward_extras["pred"] == ["x", "x"]


def test_reward_dapo_overlong_buffer_penalises_long_responses() -> None:
    cfg = load_config(["reward_model.reward_manager=dapo", "data.max_response_length=4",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.len=2",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.log=true"])
    batch = _batch([2, 3, 4])
    metrics = score_rollouts(batch, WordTokenizer(), lambda **_: 1.0, cfg.reward_model, 4)
    # verl's DAPO: lengths past max - len are penalised by (len - excess) / len * factor
    assert batch.sequence_scores.tolist() == pytest.approx([1.0, 0.5, 0.0])  # type: ignore[union-attr]
    assert metrics["reward_extra/acc/mean"] == 1.0  # a plain score is the accuracy
    assert batch.reward_extras["overlong"] == [0.0, 1.0, 1.0]


# ------------------------------------------------------------------------ advantage


def test_advantage_grpo_normalises_within_each_prompt_group() -> None:
    batch = _batch([1, 2, 1, 1], uids=[0, 0, 1, 1])
    batch.token_scores = core_algos.scores_to_token_level(torch.tensor([1.0, 0.0, 2.0, 2.0]), batch.response_mask)
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])
    kl = core_algos.make_kl_controller("fixed", 0.1, 0.1, 1)
    assert compute_advantages(batch, cfg.algorithm, kl) == {}
    adv = batch.advantages
    assert adv is not None and batch.returns is not None
    # group 0: scores 1 and 0, mean 0.5, std (unbiased) 0.7071: +-0.7071 on every response token
    assert adv[0, 0].item() == pytest.approx(0.7071, abs=1e-3) and adv[1, :2].tolist() == pytest.approx([-0.7071] * 2, abs=1e-3)
    assert adv[2:].abs().sum().item() == 0.0  # equal scores: no advantage
    assert (adv * (1 - batch.response_mask)).abs().sum().item() == 0.0
    assert torch.equal(batch.token_rewards, batch.token_scores)  # type: ignore[arg-type]


def test_advantage_kl_in_reward_subtracts_the_penalty_and_updates_the_controller() -> None:
    batch = _batch([2, 2], uids=[0, 0])
    batch.token_scores = core_algos.scores_to_token_level(torch.tensor([1.0, 0.0]), batch.response_mask)
    batch.old_log_probs = torch.full((2, 4), -1.0)
    batch.ref_log_probs = torch.full((2, 4), -1.5)  # kl estimator `kl`: old - ref = 0.5 per token
    cfg = load_config(["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                       "algorithm.kl_ctrl.kl_coef=0.2", "algorithm.kl_ctrl.target_kl=0.1",
                       "algorithm.kl_ctrl.horizon=10", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.rollout.n=2"])
    k = cfg.algorithm.kl_ctrl
    kl = core_algos.make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
    metrics = compute_advantages(batch, cfg.algorithm, kl)
    rewards = batch.token_rewards
    assert rewards is not None and rewards[0].tolist() == pytest.approx([-0.1, 0.9, 0.0, 0.0])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)  # token mean per row, then row mean
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)
    assert kl.value != pytest.approx(0.2)  # adaptive: moved toward the target
