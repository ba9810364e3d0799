"""The token servers of the agent loops: turn-synchronous batching over an in-process engine
(:class:`BatchedServer`) and verl's least-requests, sticky server pool (:class:`ServerPool`).
The engine and the servers behind the pool are fakes (the one seam); a last test puts the HF
engine itself behind :class:`BatchedServer`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from trainer.agent.base import TokenOutput
from trainer.agent.servers import BatchedServer, ServerPool
from trainer.rollout.base import SamplingParams

GREEDY = SamplingParams(do_sample=False)
HOT = SamplingParams(temperature=0.5)


class FakeEngine:
    """Answers prompt p with `max_tokens` copies of sum(p); fails on the params in `fail_on`."""

    def __init__(self, fail_on: SamplingParams | None = None) -> None:
        self.calls: list[tuple[list[list[int]], SamplingParams, list[int]]] = []
        self.fail_on = fail_on

    def generate_tokens(self, prompts, params, max_tokens):
        self.calls.append((prompts, params, max_tokens))
        if params == self.fail_on:
            raise RuntimeError("engine broke")
        return [TokenOutput([sum(p)] * m, None, "length") for p, m in zip(prompts, max_tokens, strict=True)]


async def settle() -> None:
    """Let every ready task run until it blocks again (no wall-clock wait)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_batch_goes_out_only_once_every_open_trajectory_waits() -> None:
    async def main() -> None:
        engine = FakeEngine()
        server = BatchedServer(engine)
        for _ in range(3):
            server.open()
        first = [asyncio.create_task(server.generate(f"r{i}", [i, 1], GREEDY, i + 1)) for i in range(2)]
        await settle()
        assert engine.calls == [] and not any(t.done() for t in first)
        third = await server.generate("r2", [2, 1], GREEDY, 3)
        assert len(engine.calls) == 1
        prompts, params, limits = engine.calls[0]
        assert prompts == [[0, 1], [1, 1], [2, 1]] and params == GREEDY and limits == [1, 2, 3]
        assert [t.result().token_ids for t in first] == [[1], [2, 2]] and third.token_ids == [3, 3, 3]
        assert server.stats.batch_sizes == [3]

    asyncio.run(main())


def test_a_finished_trajectory_lets_the_waiting_ones_go() -> None:
    async def main() -> None:
        engine = FakeEngine()
        server = BatchedServer(engine)

        async def trajectory(turns: int) -> list[int]:
            with server.trajectory():
                lengths = []
                for turn in range(turns):
                    out = await server.generate("t", [turn], GREEDY, turn + 1)
                    lengths.append(len(out.token_ids))
                    await asyncio.sleep(0)  # a "tool call" between turns
                return lengths

        results = await asyncio.gather(trajectory(1), trajectory(3), trajectory(2))
        assert results == [[1], [1, 2, 3], [1, 2]]
        # every turn batched all trajectories still running: 3, then 2, then 1
        assert server.stats.batch_sizes == [3, 2, 1] and server.live == 0

    asyncio.run(main())


def test_a_close_with_requests_waiting_flushes_them() -> None:
    async def main() -> None:
        engine = FakeEngine()
        server = BatchedServer(engine)
        server.open()
        server.open()
        waiting = asyncio.create_task(server.generate("a", [4], GREEDY, 2))
        await settle()
        assert not waiting.done()
        server.close()  # the other trajectory ended without asking for a turn
        assert (await waiting).token_ids == [4, 4]

    asyncio.run(main())


def test_an_engine_error_reaches_the_requests_of_that_call_only() -> None:
    async def main() -> None:
        engine = FakeEngine(fail_on=HOT)
        server = BatchedServer(engine)
        for _ in range(3):
            server.open()
        tasks = [asyncio.create_task(server.generate("g", [1], GREEDY, 1)),
                 asyncio.create_task(server.generate("h", [2], HOT, 1)),
                 asyncio.create_task(server.generate("g2", [3], GREEDY, 1))]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert [o.token_ids for o in (done[0], done[2])] == [[1], [3]]
        assert isinstance(done[1], RuntimeError) and "engine broke" in str(done[1])
        assert [len(c[0]) for c in engine.calls] == [2, 1]  # one call per sampling parameters

    asyncio.run(main())


def test_a_bad_request_fails_alone_and_its_closing_lets_the_others_go() -> None:
    async def main() -> None:
        engine = FakeEngine()
        server = BatchedServer(engine)

        async def bad() -> None:
            with server.trajectory():
                await server.generate("bad", [1], GREEDY, 0)

        async def good() -> TokenOutput:
            with server.trajectory():
                return await server.generate("good", [5], GREEDY, 1)

        out = await asyncio.gather(bad(), good(), return_exceptions=True)
        assert isinstance(out[0], ValueError) and "max_tokens" in str(out[0])
        assert out[1].token_ids == [5]

    asyncio.run(main())


def test_generate_outside_a_trajectory_and_unmatched_close_name_the_fix() -> None:
    server = BatchedServer(FakeEngine())
    with pytest.raises(RuntimeError, match=r"no trajectory is open.*server.trajectory\(\)"):
        asyncio.run(server.generate("x", [1], GREEDY, 1))
    with pytest.raises(RuntimeError, match="without a matching open"):
        server.close()


def test_a_cancelled_request_leaves_the_batch() -> None:
    async def main() -> None:
        engine = FakeEngine()
        server = BatchedServer(engine)
        server.open()
        server.open()
        doomed = asyncio.create_task(server.generate("d", [1], GREEDY, 1))
        await settle()
        doomed.cancel()
        await settle()
        server.close()  # its trajectory ends
        assert (await server.generate("e", [2], GREEDY, 1)).token_ids == [2]
        assert engine.calls[0][0] == [[2]]

    asyncio.run(main())


class FakeServer:
    """A server whose requests finish when the test releases them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.fail = False

    async def generate(self, request_id, prompt_ids, params, max_tokens):
        self.seen.append(request_id)
        gate = self.gates.setdefault(request_id, asyncio.Event())
        await gate.wait()
        gate.clear()
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        return TokenOutput([len(self.seen)])


def test_new_trajectories_go_to_the_least_loaded_server_and_turns_stick() -> None:
    async def main() -> None:
        servers = [FakeServer("a"), FakeServer("b")]
        pool = ServerPool(servers)
        t1 = asyncio.create_task(pool.generate("one", [1], GREEDY, 1))
        t2 = asyncio.create_task(pool.generate("two", [1], GREEDY, 1))
        t3 = asyncio.create_task(pool.generate("three", [1], GREEDY, 1))
        await settle()
        assert servers[0].seen == ["one", "three"] and servers[1].seen == ["two"]
        assert pool.metrics()["server_pool/in_flight/0"] == 2.0
        # a second turn of "two" stays on b; "one"'s next turn stays on a though a is busier
        t4 = asyncio.create_task(pool.generate("two", [1, 2], GREEDY, 1))
        t5 = asyncio.create_task(pool.generate("one", [1, 2], GREEDY, 1))
        await settle()
        assert servers[1].seen == ["two", "two"] and servers[0].seen == ["one", "three", "one"]
        assert pool.in_flight == [3, 2]
        for s in servers:
            for gate in s.gates.values():
                gate.set()
        await asyncio.gather(t1, t2, t3, t4, t5)
        assert pool.in_flight == [0, 0]  # counts fall as requests complete (verl's never do)
        m = pool.metrics()
        assert (m["server_pool/requests/0"], m["server_pool/requests/1"]) == (3.0, 2.0)
        assert (m["server_pool/trajectories/0"], m["server_pool/trajectories/1"]) == (2.0, 1.0)
        # both idle now: a new trajectory takes the lowest index; with b busy, a again
        servers[1].gates.clear()
        busy = asyncio.create_task(pool.generate("two", [3], GREEDY, 1))
        await settle()
        fresh = asyncio.create_task(pool.generate("four", [1], GREEDY, 1))
        await settle()
        assert servers[0].seen[-1] == "four"
        servers[0].gates["four"].set()
        servers[1].gates["two"].set()
        await asyncio.gather(busy, fresh)

    asyncio.run(main())


def test_a_completed_load_is_what_counts_not_the_trajectories_ever_assigned() -> None:
    async def main() -> None:
        servers = [FakeServer("a"), FakeServer("b")]
        pool = ServerPool(servers)
        for rid in ("x", "y"):  # x on a, y on b; both finish
            task = asyncio.create_task(pool.generate(rid, [1], GREEDY, 1))
            await settle()
            for s in servers:
                s.gates.get(rid, asyncio.Event()).set()
            await task
        long = asyncio.create_task(pool.generate("x", [1], GREEDY, 1))  # a busy again
        await settle()
        new = asyncio.create_task(pool.generate("z", [1], GREEDY, 1))
        await settle()
        assert servers[1].seen[-1] == "z"  # b: 0 in flight, though it served as many as a
        servers[0].gates["x"].set()
        servers[1].gates["z"].set()
        await asyncio.gather(long, new)

    asyncio.run(main())


def test_the_sticky_map_is_bounded_and_forgets_the_least_recently_used() -> None:
    async def main() -> None:
        servers = [FakeServer("a"), FakeServer("b")]
        pool = ServerPool(servers, max_cache_size=2)
        for s in servers:
            s.gates = _OpenGates()
        for rid in ("p", "q", "p", "r"):
            await pool.generate(rid, [1], GREEDY, 1)
        assert list(pool.sessions) == ["p", "r"]  # q was the least recently used
        assert sum(pool.trajectories) == 3
        await pool.generate("q", [1], GREEDY, 1)  # q comes back as a new trajectory
        assert sum(pool.trajectories) == 4 and list(pool.sessions) == ["r", "q"]

    asyncio.run(main())


class _OpenGates(dict):
    def setdefault(self, key, default=None):
        event = asyncio.Event()
        event.set()
        return event


def test_a_failed_request_still_leaves_the_count() -> None:
    async def main() -> None:
        server = FakeServer("a")
        server.fail = True
        server.gates = _OpenGates()
        pool = ServerPool([server])
        with pytest.raises(RuntimeError, match="a failed"):
            await pool.generate("f", [1], GREEDY, 1)
        assert pool.in_flight == [0]

    asyncio.run(main())


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        ServerPool([])
    with pytest.raises(ValueError, match="max_cache_size"):
        ServerPool([FakeServer("a")], max_cache_size=0)


def test_the_hf_engine_behind_the_batched_server_answers_each_turn_as_alone(tiny_model_dir: Path) -> None:
    """Greedy turns batched with others (different lengths and limits) equal each prompt
    generated alone with its own limit."""
    from trainer import models
    from trainer.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(models.load_actor(tiny_model_dir), 0, [3, *range(7, 17)])
    prompts = [[5, 26, 14, 3, 6], [5, 27, 3, 6], [5, 26, 30, 31, 17, 9, 21, 3, 6]]
    limits = [6, 3, 8]
    server = BatchedServer(engine)

    async def one(i: int) -> TokenOutput:
        with server.trajectory():
            return await server.generate(str(i), prompts[i], GREEDY, limits[i])

    async def main() -> list[TokenOutput]:
        return await asyncio.gather(*(one(i) for i in range(3)))

    batched = asyncio.run(main())
    assert server.stats.batch_sizes == [3]
    for i, out in enumerate(batched):
        (alone,) = engine.generate_tokens([prompts[i]], GREEDY, [limits[i]])
        assert out.token_ids == alone.token_ids and 0 < len(out.token_ids) <= limits[i]
        assert out.finish_reason == ("stop" if out.token_ids[-1] in engine.eos_token_ids else "length")
        assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(alone.log_probs), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ tensor-parallel engines


def _engine_rank(rank: int, port: int, out: str) -> None:
    """One of four gloo ranks: two tensor-parallel engines of two ranks each. Each engine's
    first rank runs trajectories of different lengths through a BatchedServer over an
    EngineLeader; the other follows. Then a leader fails in the middle of its rollout, and a
    follower's engine fails once: every rank still reaches the end."""
    import json

    import torch.distributed as dist

    from tests.trainer.ranks import leave_rank
    from trainer.agent.servers import EngineLeader, follow_leader
    from trainer.parallel import consecutive_cpu_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        group = consecutive_cpu_group(2)
        report: dict = {"group_rank": group.rank()}
        engine = FakeEngine(fail_on=HOT if rank == 3 else None)

        async def trajectory(server: BatchedServer, i: int, turns: int) -> list[int]:
            with server.trajectory():
                prompt = [rank, i]
                for _ in range(turns):
                    out = await server.generate(f"r{i}", prompt, GREEDY, 2)
                    prompt = prompt + out.token_ids
                return prompt

        async def rollout(server: BatchedServer, fail: bool) -> list[list[int]]:
            rows = [trajectory(server, i, turns) for i, turns in enumerate((1, 3, 2))]
            if fail:
                raise RuntimeError("a tool broke the rollout")
            return list(await asyncio.gather(*rows))

        for attempt, fail in (("ok", False), ("failed", rank == 2)):
            if group.rank() == 0:
                leader = EngineLeader(engine, group)
                try:
                    with leader.leading():
                        report[attempt] = asyncio.run(rollout(BatchedServer(leader), fail))
                except RuntimeError as err:
                    report[attempt] = str(err)
            else:
                try:
                    report[attempt] = follow_leader(engine, group)
                except RuntimeError as err:
                    report[attempt] = str(err)
        # a follower's failing call: its engine raises, it follows to the release, then raises
        if group.rank() == 0:
            with EngineLeader(engine, group).leading() as leader:
                leader.generate_tokens([[rank]], HOT, [1])
        else:
            try:
                report["hot"] = follow_leader(engine, group)
            except RuntimeError as err:
                report["hot"] = str(err)
        report["calls"] = [[prompts, params == GREEDY, limits] for prompts, params, limits in engine.calls]
        Path(out, f"{rank}.json").write_text(json.dumps(report))
    finally:
        leave_rank()


def test_a_tensor_parallel_engine_s_later_ranks_make_its_first_rank_s_calls(tmp_path: Path) -> None:
    """`consecutive_cpu_group(2)` over four ranks: engines {0, 1} and {2, 3}. Only the first rank of
    each runs the trajectories; its followers make exactly the same engine calls (the same
    prompts, sampling and limits, in the same order, three turn-batches for turns of 1, 3 and 2),
    never the other engine's, and report the tokens they generated. A leader that fails mid-rollout
    still releases its follower; a follower whose engine fails raises after the release."""
    import json

    import torch.multiprocessing as mp

    from trainer.parallel import free_port

    mp.spawn(_engine_rank, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=4)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [g["group_rank"] for g in got] == [0, 1, 0, 1]
    for leader, follower in ((got[0], got[1]), (got[2], got[3])):
        assert follower["calls"] == leader["calls"]
    assert [len(p) for p in got[0]["ok"]] == [4, 8, 6]  # 2 prompt tokens + 2 per turn
    assert [c[0] for c in got[0]["calls"][:3]] == [[[0, 0], [0, 1], [0, 2]], [[0, 1, 1, 1], [0, 2, 2, 2]],
                                                   [[0, 1, 1, 1, 3, 3]]]
    assert got[0]["calls"] != got[2]["calls"]  # each engine's own requests
    assert got[1]["ok"] == 2 * (3 + 2 + 1)  # the tokens of its six calls' requests
    assert got[2]["failed"] == "a tool broke the rollout" and got[3]["failed"] == 0
    assert got[3]["hot"] == "engine broke" and got[1]["hot"] == 1
