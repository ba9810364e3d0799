"""Streamed weight sync and streamed HF export on the tiny model: buckets stay bounded and every
parameter travels exactly once; two FSDP2 ranks over gloo sync a separate rollout model while
holding at most one bucket of gathered tensors, after which it generates what the actor does;
the sharded export (several safetensors shards + index) loads with transformers."""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.trainer.ranks import leave_rank
from trainer import parallel as P
from trainer import tiny
from trainer.checkpoint.hf_export import INDEX_FILE, plan_shards, shard_names, write_hf_export
from trainer.rollout.base import SamplingParams, WeightBucket
from trainer.rollout.hf import HFRolloutEngine

BUCKET = 40_000  # bytes: smaller than one attention projection of the tiny model (64 KiB)
PROMPTS = [[5, 26, 14, 3, 6], [5, 27, 3, 6], [5, 26, 30, 31, 17, 9, 21, 3, 6]]


def _model(seed: int) -> torch.nn.Module:
    return tiny.build_model(len(tiny.vocabulary()), seed=seed)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RecordingEngine(HFRolloutEngine):
    """An HF engine that records, as each bucket arrives, its size and how many bytes of the
    earlier buckets' tensors are still alive (they must all be freed by then)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.bucket_sizes: list[tuple[int, int]] = []  # (bytes, tensors)
        self.alive_before: list[int] = []

    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        earlier: list[weakref.ref[torch.Tensor]] = []

        def watched() -> Iterator[WeightBucket]:
            for bucket in buckets:
                self.alive_before.append(_nbytes(t for r in earlier if (t := r()) is not None))
                self.bucket_sizes.append((_nbytes(t for _, t in bucket), len(bucket)))
                earlier.extend(weakref.ref(t) for _, t in bucket)
                yield bucket

        super().sync_weights(watched())


def _greedy(engine: HFRolloutEngine) -> torch.Tensor:
    from trainer.models import left_pad

    ids, mask = left_pad(PROMPTS, 0)
    return engine.generate(ids, mask, SamplingParams(do_sample=False, max_response_length=6)).response_ids


def test_buckets_are_bounded_and_carry_every_entry_once() -> None:
    model = _model(0)
    names = list(model.state_dict())
    assert "lm_head.weight" in names and "lm_head.weight" not in P.unique_state_names(model)  # tied
    for size in (1, BUCKET, 10**9):
        seen = []
        for bucket in P.weight_buckets(model, size):
            assert len(bucket) == 1 or _nbytes(t for _, t in bucket) <= size
            seen += [name for name, _ in bucket]
        assert seen == names
    assert len(list(P.weight_buckets(model, 10**9))) == 1
    with pytest.raises(ValueError, match="at least 1"):
        next(P.weight_buckets(model, 0))


def test_sync_refuses_partial_and_repeated_weights() -> None:
    engine = HFRolloutEngine(_model(0), 0, 3)
    buckets = [[(n, t.clone())] for n, t in _model(1).state_dict().items()]
    with pytest.raises(ValueError, match="partial: 1 parameter"):
        engine.sync_weights(buckets[:-1])
    with pytest.raises(ValueError, match="arrived twice"):
        engine.sync_weights([*buckets, buckets[0]])
    with pytest.raises(ValueError, match="received no weights"):
        engine.sync_weights([])
    engine.sync_weights(buckets)
    assert torch.equal(_greedy(engine), _greedy(HFRolloutEngine(_model(1), 0, 3)))


def test_one_rank_export_loads_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = _model(3)
    files = write_hf_export(tmp_path, model, 0, tokenizer=tiny.build_tokenizer(), max_shard_bytes=300_000)
    assert len(files) > 2 and (tmp_path / INDEX_FILE).is_file()
    _assert_loads_as(tmp_path, model.state_dict())
    assert (tmp_path / "tokenizer.json").is_file()
    assert len(write_hf_export(tmp_path / "one", model, 0)) == 1 and not (tmp_path / "one" / INDEX_FILE).exists()
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict(),
                               model.state_dict(), rtol=0, atol=0)


def test_plan_shards() -> None:
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _assert_loads_as(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    index = json.loads((directory / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shard_names(len(set(index["weight_map"].values()))))
    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One FSDP2 rank: the actor (seed 1) sharded, the rollout engine a whole seed-0 model;
    stream-sync it, record what was alive, and export the actor."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        actor = P.apply_fsdp2(_model(1))
        engine = RecordingEngine(_model(0), 0, 3)
        engine.sync_weights(P.weight_buckets(actor, BUCKET))
        full = {k: v.clone() for k, v in P.full_model_state(actor, every_rank=True).items()}
        shard_bytes = _nbytes(p.to_local() for p in actor.parameters())
        write_hf_export(Path(out) / "hf", actor, rank, max_shard_bytes=300_000)
        torch.save({"sizes": engine.bucket_sizes, "alive": engine.alive_before, "greedy": _greedy(engine),
                    "engine": engine.model.state_dict(), "full": full, "shard_bytes": shard_bytes},
                   Path(out) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_two_fsdp_ranks_stream_one_bucket_at_a_time(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(2, P.free_port("127.0.0.1"), str(tmp_path)), nprocs=2)
    actor = _model(1)
    want = _greedy(HFRolloutEngine(actor, 0, 3))
    total = _nbytes(actor.parameters())
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["shard_bytes"] <= 0.55 * total  # FSDP2: each rank keeps about half
        assert len(got["sizes"]) > 10
        for nbytes, count in got["sizes"]:
            assert count == 1 or nbytes <= BUCKET
        assert got["alive"] == [0] * len(got["sizes"])  # earlier buckets freed before the next
        for name, tensor in actor.state_dict().items():
            torch.testing.assert_close(got["engine"][name], tensor, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(got["full"][name], tensor, rtol=0, atol=0, msg=name)
        assert torch.equal(got["greedy"], want)
    _assert_loads_as(tmp_path / "hf", actor.state_dict())
