"""Each stage of the step (`trainer.stages`) alone, on a hand-made batch: no driver, no model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.algos import core_algos
from trainer.batch import StepBatch
from trainer.config import ConfigError, load_config
from trainer.data import Example, PromptDataset, PromptLoader
from trainer.stages import checkpoint, logprobs, update
from trainer.stages.advantage import compute_advantages
from trainer.stages.logprobs import split_batch
from trainer.stages.metrics import Timer, memory_metrics, step_metrics
from trainer.stages.reward import score_rollouts, set_reward_baselines
from trainer.stages.rollout import Rollout, sampling_params
from trainer.stages.sync import sync_weights
from trainer.stages.validate import VAL_GENERATIONS_FILE, log_generations, validate


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


def test_rollout_correction_rejects_before_the_advantages_and_weighs_the_loss() -> None:
    """verl's decoupled rollout correction sits between the KL penalty and the estimator: a token
    rejected by `token_k1` leaves the response mask the advantages see, and the truncated token
    weights go to the batch for the policy loss. Row 1's second token: log r = old - rollout = 1,
    -log r = -1 < ln 0.5, so it is rejected; its weight exp(1) is truncated at 2."""
    batch = _batch([2, 2], uids=[0, 0])
    batch.token_scores = core_algos.scores_to_token_level(torch.tensor([1.0, 0.0]), batch.response_mask)
    batch.old_log_probs = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    batch.rollout_log_probs = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-1.0, -2.0, 0.0, 0.0]])
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.rollout.calculate_log_probs=true",
                       "algorithm.rollout_correction.rollout_is=token",
                       "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"])
    metrics = compute_advantages(batch, cfg.algorithm, core_algos.make_kl_controller("fixed", 0.1, 0.1, 1))
    assert batch.response_mask.tolist() == [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert batch.rollout_is_weights is not None
    assert batch.rollout_is_weights[1, :2].tolist() == pytest.approx([1.0, 2.0])
    assert batch.advantages is not None and batch.advantages[1, 1].item() == 0.0  # rejected: no advantage
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.25)  # mean(rollout - old) over the 4 tokens
    plain = _batch([2, 2], uids=[0, 0])  # no rollout log-probs: nothing is corrected or logged
    plain.token_scores = batch.token_scores
    assert compute_advantages(plain, cfg.algorithm, core_algos.make_kl_controller("fixed", 0.1, 0.1, 1)) == {}
    assert plain.rollout_is_weights is None


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


# ------------------------------------------------------------------------ log-probs


class RowGroup:
    """A worker group of `world_size` ranks (the process seam): each rank answers for the rows it
    is given, the log-prob of a token being minus its id and the entropy its id / 10, so a row
    reassembled in the wrong place shows."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.calls = world_size, []  # type: ignore[var-annotated]

    def run_each(self, method: str, per_rank: list[tuple[StepBatch]]) -> list[dict[str, Any]]:
        self.calls.append((method, [len(args[0]) for args in per_rank]))
        out = []
        for (part,) in per_rank:
            assert part.examples == [] and part.uids == []  # workers get tensors only
            tokens = part.responses.float()
            out.append({"log_probs": -tokens, "values": tokens, "entropy": tokens / 10, "seconds": 0.5})
        return out


def test_log_probs_are_computed_on_every_rank_s_rows_and_reassembled_in_row_order() -> None:
    batch = _batch([1, 2, 3, 4, 2])
    batch.input_ids[:, 2:] += torch.arange(5)[:, None] * 100  # row r's tokens: 100 r + 10..
    group, noted = RowGroup(2), {}
    note = lambda name, per_rank: noted.setdefault(name, per_rank)[0]  # noqa: E731
    parts = split_batch(batch, 2, balance=False)
    assert parts == [[0, 1, 2], [3, 4]]
    metrics = logprobs.old_log_probs(batch, group, parts, "token-mean", note)
    assert torch.equal(batch.old_log_probs, -batch.responses.float())  # type: ignore[arg-type]
    expected = core_algos.agg_loss(batch.responses.float() / 10, batch.response_mask, "token-mean").item()
    assert metrics == {"actor/entropy": pytest.approx(expected)}
    logprobs.ref_log_probs(batch, group, split_batch(batch, 2, balance=True), note)
    assert torch.equal(batch.ref_log_probs, -batch.responses.float())  # type: ignore[arg-type]
    logprobs.values(batch, group, parts, note)
    assert torch.equal(batch.values, batch.responses.float())  # type: ignore[arg-type]
    assert group.calls == [("compute_log_probs", [3, 2]), ("compute_ref_log_probs", [3, 2]),
                           ("compute_values", [3, 2])]
    assert noted == {"old_log_prob_s": [0.5, 0.5], "ref_s": [0.5, 0.5], "values_s": [0.5, 0.5]}


def test_the_update_supplies_the_old_log_probs_only_for_one_on_policy_step() -> None:
    one = ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=2",
           "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo"]
    batch = _batch([1, 1, 1, 1])
    assert logprobs.reuses_update_log_probs(load_config(one), batch)
    assert not logprobs.reuses_update_log_probs(load_config([*one, "actor_rollout_ref.actor.ppo_epochs=2"]), batch)
    assert not logprobs.reuses_update_log_probs(load_config([*one, "algorithm.use_kl_in_reward=true"]), batch)
    assert not logprobs.reuses_update_log_probs(load_config([*one, "data.train_batch_size=4"]), _batch([1] * 8))
    batch.rollout_log_probs = torch.zeros(4, 4)  # rollout.calculate_log_probs: compared with a recomputation
    assert not logprobs.reuses_update_log_probs(load_config(one), batch)


# ------------------------------------------------------------------------ update


def _batcher(world: int, model_engine: bool = False, step: int = 1) -> update.MiniBatcher:
    return update.MiniBatcher(world, lambda b: split_batch(b, world, balance=False), seed=5, step=step,
                              model_engine=model_engine)


def test_mini_batches_are_verls_per_rank_cuts_and_shuffle_acts_only_under_the_model_engine() -> None:
    batch = _batch([1] * 8)
    assert _batcher(2).mini_batches(batch, 4, shuffle=True, salt=0) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    shuffled = _batcher(2, model_engine=True).mini_batches(batch, 4, shuffle=True, salt=0)
    assert sorted(sum(sum(shuffled, []), [])) == list(range(8)) and shuffled != [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert all(set(sum(mini[0:1], [])) <= {0, 1, 2, 3} for mini in shuffled)  # each rank keeps its rows
    assert shuffled == _batcher(2, model_engine=True).mini_batches(batch, 4, shuffle=True, salt=0)
    assert shuffled != _batcher(2, model_engine=True, step=2).mini_batches(batch, 4, shuffle=True, salt=0)


def test_shares_carry_the_whole_mini_batch_s_normalisers_and_skipped_rows_are_re_split() -> None:
    batch = _batch([1, 2, 3, 4])
    batch.advantages = torch.zeros(4, 4)
    batch.advantages[2, 0] = 1.0  # only row 2 has a gradient
    batcher = _batcher(2)
    shares, rows, frac = batcher.shares(batch, [[0, 1], [2, 3]], None)
    assert rows == [[0, 1], [2, 3]] and frac == 0.0
    assert [(s.num_tokens, s.num_seqs) for s in shares] == [(10.0, 4.0), (10.0, 4.0)]
    shares, rows, frac = batcher.shares(batch, [[0, 1], [2, 3]], update.rows_to_update)
    assert rows == [[0], [2]] and frac == 0.5  # row 2 and a filler so both ranks run a pass
    assert [(s.num_tokens, s.num_seqs) for s in shares] == [(10.0, 4.0), (10.0, 4.0)]
    assert batcher.fill_to_ranks([1], 4) == [0, 1] and batcher.fill_to_ranks([0, 3], 4) == [0, 3]


class UpdateGroup:
    """A worker group (the process seam) that records what each rank's update receives."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.received = world_size, []  # type: ignore[var-annotated]

    def run_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        self.received.append((method, per_rank))
        return [{"metrics": {f"{method}/loss": [float(rank), float(rank) + 2]}, "seconds": 0.0, "tokens": 7,
                 "flops_fields": None, "device_name": "cpu", "entropy": torch.ones(len(args[0][0][0].batch), 4)}
                for rank, args in enumerate(per_rank)]


def test_actor_update_gives_each_rank_its_share_of_every_mini_batch_per_epoch() -> None:
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_epochs=2"])
    batch = _batch([1, 2, 3, 4, 1, 2, 3, 4], uids=[0, 0, 1, 1, 2, 2, 3, 3])
    batch.advantages, batch.old_log_probs = torch.ones(8, 4), torch.zeros(8, 4)
    group, noted = UpdateGroup(2), {}
    metrics = update.update_actor(batch, group, cfg, _batcher(2), lambda k, v: noted.setdefault(k, v)[0], skip=None)
    [(method, per_rank)] = group.received
    assert method == "update_actor" and len(per_rank) == 2
    for rank, (epochs, keep_entropy) in enumerate(per_rank):
        assert keep_entropy is False and len(epochs) == 2 and all(len(minis) == 2 for minis in epochs)
        first = torch.cat([share.batch.input_ids for share in epochs[0]])
        assert torch.equal(first, batch.input_ids[[0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]])
    assert metrics["update_actor/loss"] == pytest.approx(1.5)  # the mean over ranks and mini-batches
    assert metrics["actor/skipped_row_frac"] == 0.0 and "actor/entropy" not in metrics
    assert noted == {"update_actor_s": [0.0, 0.0], "update_actor_tokens": [7, 7]}


def test_the_update_measures_entropy_when_the_old_log_probs_came_from_it() -> None:
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    batch = _batch([1, 2, 3, 4], uids=[0, 0, 1, 1])
    batch.advantages = torch.ones(4, 4)
    assert update.measures_entropy(batch) and update.keeps_every_row(cfg, True)
    metrics = update.update_actor(batch, UpdateGroup(1), cfg, _batcher(1), lambda k, v: 0.0, skip=None)
    assert metrics["actor/entropy"] == pytest.approx(1.0)
    batch.entropy = torch.zeros(4, 4)  # the rollout's entropies stand in
    assert not update.measures_entropy(batch)


# ------------------------------------------------------------------------ rollout


class EngineGroup:
    """An actor group (the process seam) whose engines answer each prompt with `n` responses of
    one token: the prompt's last id + 100 + the sample number, so the rows show their prompt."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.calls = world_size, []  # type: ignore[var-annotated]

    def run_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[tuple[Any, dict[str, float]]]:
        from trainer.rollout.base import RolloutBatch

        out = []
        for ids, mask, sampling, seed in per_rank:
            self.calls.append((ids[:, -1].tolist(), sampling.n, sampling.do_sample, seed))
            rows = ids.repeat_interleave(sampling.n, dim=0)
            resp = (rows[:, -1:] + 100 + torch.arange(sampling.n).repeat(len(ids))[:, None]).long()
            out.append((RolloutBatch(prompt_ids=rows, prompt_mask=mask.repeat_interleave(sampling.n, dim=0),
                                     response_ids=resp, response_mask=torch.ones_like(resp),
                                     log_probs=torch.full(resp.shape, -0.5),
                                     prompt_index=torch.arange(len(ids)).repeat_interleave(sampling.n)),
                        {"gen_tokens": float(resp.numel()), "gen": 0.25}))
        return out


def test_rollout_splits_prompts_over_engines_and_keeps_rows_prompt_major() -> None:
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "trainer.nnodes=1", "trainer.n_gpus_per_node=4", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                       "actor_rollout_ref.rollout.calculate_log_probs=true"])
    examples = [replace(_example(i), prompt_ids=[1] * (i % 2) + [5 + i]) for i in range(4)]
    group, noted = EngineGroup(4), {}
    batch = Rollout(cfg, group, pad_token_id=0).generate(examples, 3, lambda k, v: noted.setdefault(k, v)[0])
    # two engines of two ranks: ranks 0-1 get prompts 0-1 with one seed, ranks 2-3 prompts 2-3
    assert [c[0] for c in group.calls] == [[5, 6], [5, 6], [7, 8], [7, 8]]
    seeds = [c[3] for c in group.calls]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3]
    assert batch.uids == [0, 0, 1, 1, 2, 2, 3, 3] and [e.index for e in batch.examples] == batch.uids
    assert batch.responses[:, 0].tolist() == [105, 106, 106, 107, 107, 108, 108, 109]
    assert batch.input_ids.shape[1] == 3 and batch.rollout_log_probs is not None  # prompts share one width
    assert noted == {"gen_rows": [2, 2, 2, 2], "gen_tokens": [4.0] * 4, "gen_s": [0.25] * 4}
    greedy = Rollout(cfg, group, 0).generate(examples, 3, lambda k, v: 0.0, greedy=True)
    assert group.calls[-1][1:3] == (1, False) and greedy.uids == [0, 1, 2, 3]
    assert group.calls[-1][3] != seeds[2]  # its own seed
    val = Rollout(cfg, group, 0).generate(examples, 3, lambda k, v: 0.0, validate=True)
    assert group.calls[-1][1:3] == (1, False) and val.rollout_log_probs is None  # val_kwargs: greedy, n=1
    assert sampling_params(cfg, validate=False).n == 2


# ------------------------------------------------------------------------ validation


def test_validation_scores_every_prompt_and_keeps_the_first_generations(tmp_path: Path) -> None:
    data = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "toy", "prompt": [{"role": "user", "content": f"q{i}"}],
         "reward_model": {"ground_truth": str(i)}} for i in range(3)]), data)

    class Chat(WordTokenizer):
        def apply_chat_template(self, messages: Any, **_: Any) -> str:
            return messages[0]["content"]

        def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
            return {"input_ids": [int(text[1:])]}

    val_set = PromptDataset([data], Chat(), max_prompt_length=4)
    cfg = load_config([])

    def generate(examples: list[Example]) -> StepBatch:  # the rollout seam: response = the prompt id
        batch = _batch([1] * len(examples))
        batch.examples = examples
        batch.input_ids[:, 2] = torch.tensor([e.prompt_ids[0] for e in examples])
        return batch

    def score(batch: StepBatch) -> dict[str, float]:
        return score_rollouts(batch, WordTokenizer(), lambda solution_str, ground_truth, **_:
                              float(solution_str == f"w{ground_truth}"), cfg.reward_model, 4)

    metrics, samples = validate(val_set, 2, generate, score, WordTokenizer(), step=7, log_count=2)
    assert metrics["val-core/toy/reward/mean@1"] == 1.0
    assert [(s["step"], s["input"], s["output"], s["score"]) for s in samples] == [
        (7, "w1 w1", "w0", 1.0), (7, "w1 w1", "w1", 1.0)]
    log_generations(tmp_path, samples, console=False)
    assert [json.loads(line)["output"] for line in (tmp_path / VAL_GENERATIONS_FILE).read_text().splitlines()] == [
        "w0", "w1"]
    assert not any("num_turns" in k for k in metrics)  # no agent-loop rows

    def agentic(examples: list[Example]) -> StepBatch:  # the second batch's row through an agent loop
        batch = generate(examples)
        if examples[0].index == 2:
            batch.num_turns = torch.tensor([5])
        return batch

    metrics, _ = validate(val_set, 2, agentic, score, WordTokenizer(), step=7, log_count=0)
    # verl's `val-aux/num_turns/*`; the first batch's single-turn rows count 2 turns each, as verl's
    assert {k: v for k, v in metrics.items() if "num_turns" in k} == {
        "val-aux/num_turns/min": 2.0, "val-aux/num_turns/max": 5.0, "val-aux/num_turns/mean": 3.0}


# ------------------------------------------------------------------------ sync, metrics


class RunGroup:
    """A worker group (the process seam) whose every rank answers `answers[method]`."""

    def __init__(self, name: str, answers: dict[str, list[Any]]) -> None:
        self.name, self.answers, self.calls = name, answers, []  # type: ignore[var-annotated]
        self.world_size = len(next(iter(answers.values()), [None]))

    def run(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        return self.answers[method]


def test_sync_notes_each_rank_s_seconds() -> None:
    group, noted = RunGroup("actor", {"sync_rollout_weights": [0.5, 0.25]}), {}
    sync_weights(group, lambda k, v: noted.setdefault(k, v)[0])  # type: ignore[arg-type]
    assert group.calls == [("sync_rollout_weights", ())] and noted == {"update_weights_s": [0.5, 0.25]}


def test_step_metrics_and_the_largest_memory_over_every_rank() -> None:
    batch = _batch([1, 3])
    batch.sequence_scores = torch.tensor([1.0, 0.0])
    batch.token_rewards = core_algos.scores_to_token_level(batch.sequence_scores, batch.response_mask)
    batch.advantages, batch.returns = torch.ones(2, 4), torch.ones(2, 4)
    timer = Timer()
    with timer.phase("step"), timer.phase("gen"):
        pass
    metrics = step_metrics(batch, {**timer.seconds, "step": 2.0}, load_config([]).data, world=2)
    assert metrics["critic/score/mean"] == 0.5 and metrics["response_length/mean"] == 2.0
    assert metrics["perf/total_num_tokens"] == 8 and metrics["perf/throughput"] == 2.0  # 8 tokens / 2 s / 2 ranks
    assert "timing_s/gen" in metrics
    groups = [RunGroup("actor", {"memory_metrics": [{"perf/max_memory_allocated_gb": 1.0}, {"perf/max_memory_allocated_gb": 3.0}]}),
              RunGroup("critic", {"memory_metrics": [{"perf/max_memory_allocated_gb": 2.0, "x": 1.0}]})]
    assert memory_metrics(groups) == {"perf/max_memory_allocated_gb": 3.0, "x": 1.0}  # type: ignore[arg-type]


# ------------------------------------------------------------------------ checkpoint


class ShardGroup:
    """A worker group (the process seam) of one rank holding a small model, saved and loaded as
    a worker saves its group's shards."""

    def __init__(self, name: str, fail: BaseException | None = None) -> None:
        self.name, self.world_size, self.fail, self.loaded = name, 1, fail, []  # type: ignore[var-annotated]
        self.model = torch.nn.Linear(2, 2)
        self.optim = torch.optim.AdamW(self.model.parameters())

    def run(self, method: str, path: str) -> list[Any]:
        from trainer.checkpoint import sharded

        if method == "save_checkpoint":
            if self.fail is not None:
                raise self.fail
            return [sharded.save_group_state(Path(path) / self.name, self.model, self.optim)]
        self.loaded.append(path)
        return [None]


def test_checkpoint_saves_every_group_and_the_loop_state_and_loads_them_back(tmp_path: Path) -> None:
    from trainer.checkpoint import full_state as ckpt

    run = ckpt.run_identity(tmp_path / "run")
    actor, critic = ShardGroup("actor"), ShardGroup("critic")
    state = {"global_step": 3, "loader": {"epoch": 0}}
    path = checkpoint.save(tmp_path / "ckpt", 3, run, [actor, critic], state, {"config.yaml": "a: 1\n"},
                           {"global_step": 3}, keep_last=None)
    assert path.name == "global_step_3" and (path / "config.yaml").read_text() == "a: 1\n"
    assert checkpoint.previous_checkpoint_bytes(tmp_path / "ckpt", run)
    loaded = checkpoint.load(path, actor, critic, "gae")
    assert loaded["global_step"] == 3 and actor.loaded == [str(path)] == critic.loaded
    without_critic = checkpoint.save(tmp_path / "ckpt", 4, run, [actor], state, {}, {}, keep_last=None)
    with pytest.raises(ConfigError, match="has no critic but `algorithm.adv_estimator=gae` needs one"):
        checkpoint.load(without_critic, actor, critic, "gae")


def test_a_failed_checkpoint_leaves_the_previous_one_the_newest(tmp_path: Path) -> None:
    from trainer.checkpoint import full_state as ckpt

    run = ckpt.run_identity(tmp_path / "run")
    first = checkpoint.save(tmp_path / "ckpt", 1, run, [ShardGroup("actor")], {}, {}, {}, keep_last=None)
    with pytest.raises(RuntimeError, match="disk gone"):
        checkpoint.save(tmp_path / "ckpt", 2, run, [ShardGroup("actor", RuntimeError("disk gone"))], {}, {}, {},
                        keep_last=None)
    assert ckpt.latest_run_checkpoint(tmp_path / "ckpt", run) == first
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("global_step")) == [
        "global_step_1"]


def test_remax_baseline_is_the_greedy_score_of_each_row_s_prompt() -> None:
    batch, greedy = _batch([1] * 4, uids=[0, 0, 1, 1]), _batch([1, 1], uids=[1, 0])
    greedy.sequence_scores = torch.tensor([0.25, 0.75])
    set_reward_baselines(batch, greedy)
    assert batch.reward_baselines.tolist() == [0.75, 0.75, 0.25, 0.25]  # type: ignore[union-attr]


def test_run_state_keeps_a_loop_s_step_data_position_and_kl_controller_across_a_stop(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A loop over the stages (here steps counted by hand, no driver) saves its state beside the
    groups' shards; a new state on fresh stages resumes it: the step, the next batch, the KL
    controller, and the metrics lines past the checkpoint dropped and said to be redone."""
    from trainer.run_state import RunState
    from trainer.startup import Clock
    from trainer.step import Stages

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "toy", "prompt": [{"role": "user", "content": f"q{i}"}],
         "reward_model": {"ground_truth": str(i)}} for i in range(8)]), data)

    class Chat(WordTokenizer):
        pad_token_id = 0

        def apply_chat_template(self, messages: Any, **_: Any) -> str:
            return messages[0]["content"]

        def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
            return {"input_ids": [int(text[1:])]}

    cfg = load_config([f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
                       "trainer.logger=jsonl"])

    def loop_parts() -> tuple[RunState, Stages, ShardGroup]:
        actor = ShardGroup("actor")
        loader = PromptLoader(PromptDataset([data], Chat(), max_prompt_length=4), 2, shuffle=True, seed=1)
        stages = Stages(cfg, actor, ShardGroup("critic"), None, Chat(), Clock())  # type: ignore[arg-type]
        return RunState(cfg, loader), stages, actor

    state, stages, _ = loop_parts()
    assert state.resume(stages) is None and state.global_step == 0
    for _ in range(2):
        state.loader.next_batch()
        state.global_step += 1
    stages.kl_ctrl.value = 0.25
    path = state.save(stages)
    assert path == tmp_path / "ckpt" / "global_step_2"
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))

    again, fresh, actor = loop_parts()
    assert again.resume(fresh) == path and actor.loaded == [str(path)]
    assert again.global_step == 2 and fresh.kl_ctrl.value == 0.25
    assert [e.index for e in again.loader.next_batch()] == [e.index for e in state.loader.next_batch()]
    again.open_metrics(resumed=True).close()
    assert "trainer: 1 step(s) redone (step 3): the last run logged step 3" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
