"""Trajectories dealt out to several server-mode replicas (:func:`trainer.stages.rollout.deal`):
the rollout stage gives every replica the whole batch and its share of the trajectories, each
replica runs real agent loops (the tool loop, the calculator tool) against its own scripted server
(the one seam faked: generation, and the worker group's process boundary), and the rows come
back in the batch's order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.trainer.agent.test_trace import TOK, CallThenAnswer, config, rows
from trainer.agent.manager import AgentRollout
from trainer.stages.rollout import Rollout, deal


def test_trajectories_are_dealt_in_turn_each_once() -> None:
    assert deal(10, 3) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert deal(2, 4) == [[0], [1], [], []]
    for total, replicas in ((0, 1), (7, 1), (64, 8), (13, 5)):
        hands = deal(total, replicas)
        assert sorted(t for hand in hands for t in hand) == list(range(total))
        assert max(map(len, hands)) - min(map(len, hands)) <= 1


class Seen(CallThenAnswer):
    """The scripted tool-calling server, recording which trajectories (request ids) it served."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any, max_tokens: int) -> Any:
        self.ids.append(request_id)
        return await super().generate(request_id, prompt_ids, params, max_tokens)


class ReplicaGroup:
    """An actor group of server-mode replicas, one per rank, each running the real agent loops
    of `generate_agent` in this process against its own server."""

    def __init__(self, cfg: Any, world_size: int) -> None:
        self.world_size = world_size
        self.servers = [Seen() for _ in range(world_size)]
        self.agents = [AgentRollout(cfg, TOK) for _ in range(world_size)]
        self.calls: list[tuple[int, list[int] | None]] = []

    def run_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[Any]:
        assert method == "generate_agent"
        out = []
        for rank, (examples, params, _seed, trace, *dealt) in enumerate(per_rank):
            hand = dealt[0] if dealt else None
            self.calls.append((len(examples), hand))
            batch, per_row = self.agents[rank].run(examples, params, self.servers[rank], trace=trace, trajectories=hand)
            out.append((batch, {"gen_tokens": float(batch.response_mask.sum()), "gen": 0.0, "rows": per_row}))
        return out


def test_each_replica_runs_its_dealt_trajectories_and_rows_come_back_in_batch_order(tmp_path: Path) -> None:
    cfg = config(tmp_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
                 "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=3",
                 "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    examples, group, noted = rows(5), ReplicaGroup(cfg, 3), {}
    rollout = Rollout(cfg, group, pad_token_id=TOK.pad_token_id)
    assert rollout.dealt
    batch = rollout.generate(examples, 1, lambda k, v: noted.setdefault(k, v)[0])
    assert group.calls == [(5, [0, 3, 6, 9]), (5, [1, 4, 7]), (5, [2, 5, 8])]  # the whole batch, a hand each
    assert batch.uids == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and [e.extra_info["index"] for e in batch.examples] == [100 + u for u in batch.uids]
    prompt_len = batch.input_ids.shape[1] - batch.response_length
    for row, i in enumerate(batch.uids):  # each row's call carries its own prompt's number, its answer the sum
        prompt = TOK.decode(batch.input_ids[row, :prompt_len][batch.attention_mask[row, :prompt_len].bool()].tolist())
        answer = TOK.decode(batch.responses[row][batch.response_mask[row].bool()].tolist())
        assert f"what is {i} plus 2" in prompt and f'"x": {i}, "y": 2' in answer, (row, prompt, answer)
        assert answer.endswith(f"</tool_call></s>{i + 2}</s>"), (row, answer)
    assert batch.num_turns is not None and len(batch.agent_extras) == len(batch.loop_scores) == 10
    for server, hand in zip(group.servers, ([0, 3, 6, 9], [1, 4, 7], [2, 5, 8]), strict=True):
        assert len(server.ids) == 2 * len(hand) and len(set(server.ids)) == len(hand)  # sticky: both turns here
    assert noted["gen_rows"] == [2.0, 1.5, 1.5]  # prompts' worth of rows per replica
    assert torch.equal(batch.response_mask.sum(-1) > 0, torch.ones(10, dtype=torch.bool))


def test_one_replica_or_the_in_process_engine_still_splits_prompts(tmp_path: Path) -> None:
    one = config(tmp_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async")
    assert not Rollout(one, ReplicaGroup(one, 1), 0).dealt
    sync = config(tmp_path, "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=2")
    assert not Rollout(sync, ReplicaGroup(sync, 2), 0).dealt


def test_verl_s_data_parallel_engines_are_replicas_here(tmp_path: Path) -> None:
    """`rollout.data_parallel_size` (verl: data-parallel engines inside one rollout server): the
    same engines, each a replica here; tp x dp must divide the world, as verl requires."""
    import pytest

    from trainer.config import ConfigError

    cfg = config(tmp_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
                 "actor_rollout_ref.rollout.data_parallel_size=2", "trainer.n_gpus_per_node=4",
                 "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    group = ReplicaGroup(cfg, 4)
    rollout = Rollout(cfg, group, pad_token_id=TOK.pad_token_id)
    rollout.generate(rows(2), 1, lambda k, v: 0.0)
    assert rollout.dealt and [hand for _, hand in group.calls] == [[0], [1], [], []]
    with pytest.raises(ConfigError, match=r"tp x dp = 6 GPUs, which must be at least 1 and divide the 4 ranks"):
        config(tmp_path, "actor_rollout_ref.rollout.data_parallel_size=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
               "trainer.n_gpus_per_node=4")
