"""HF rollout engine on the tiny model: layout, EOS masking, sampling log-probs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from trainer import models, tiny
from trainer.parallel import weight_buckets
from trainer.rollout.base import RolloutEngine, SamplingParams, response_mask_from_eos
from trainer.rollout.hf import HFRolloutEngine

PROMPTS = [[5, 26, 14, 3, 6], [5, 27, 3, 6], [5, 26, 30, 31, 17, 9, 21, 3, 6]]
PAD, EOS = 0, 3
# Digits count as EOS too here, so that a random model ends many responses early.
EOS_IDS = [EOS, *range(7, 17)]


@pytest.fixture(scope="module")
def actor(tiny_model_dir: Path) -> torch.nn.Module:
    return models.load_actor(tiny_model_dir)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    return models.left_pad(PROMPTS, PAD)


def test_response_mask_hand_case() -> None:
    ids = torch.tensor([[5, 3, 7, 3], [5, 6, 7, 8], [3, 0, 0, 0], [5, 9, 3, 3]])
    mask = response_mask_from_eos(ids, [3, 9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="`n` must be >= 1.*`top_p` must be in"):
        SamplingParams(n=0, top_p=0.0)
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(do_sample=False, temperature=0.7).logprob_temperature == 1.0


def test_sampling_log_probs_match_recomputed(actor: torch.nn.Module) -> None:
    engine = HFRolloutEngine(actor, PAD, EOS_IDS)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.95, max_response_length=8)
    torch.manual_seed(0)
    batch = engine.generate(*prompts(), params)
    rows = len(PROMPTS) * 3
    assert batch.response_ids.shape == batch.log_probs.shape == (rows, 8)
    assert not any(t.is_inference() for t in (batch.response_ids, batch.log_probs, batch.input_ids))
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    lengths = batch.response_mask.sum(1)
    assert (lengths < 8).any() and (lengths == 8).any()  # some ended at an EOS, some did not
    for r in range(rows):
        n = int(lengths[r])
        if n < 8:
            assert int(batch.response_ids[r, n - 1]) in EOS_IDS
            assert (batch.response_ids[r, n:] == PAD).all()
        assert not any(int(t) in EOS_IDS for t in batch.response_ids[r, : n - 1])
    assert batch.truncated.tolist() == (lengths == 8).tolist()
    with torch.no_grad():
        recomputed, entropy = models.compute_log_probs(
            actor, batch.input_ids, batch.attention_mask, batch.response_length, temperature=0.7,
            calculate_entropy=True,
        )
    m = batch.response_mask.bool()
    assert (batch.log_probs[~m] == 0).all()
    torch.testing.assert_close(batch.log_probs[m], recomputed[m], atol=1e-5, rtol=0)
    assert batch.entropy is not None and entropy is not None and (batch.entropy[~m] == 0).all()
    torch.testing.assert_close(batch.entropy[m], entropy[m], atol=1e-5, rtol=0)


def test_greedy_matches_a_manual_argmax_loop(actor: torch.nn.Module) -> None:
    engine = HFRolloutEngine(actor, PAD)  # EOS from the model's generation config
    params = SamplingParams(n=2, temperature=0.0, max_response_length=6)
    batch = engine.generate(*prompts(), params)
    assert torch.equal(batch.response_ids[0], batch.response_ids[1])
    for i, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(actor(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
                if seq[-1] == EOS:
                    break
        got = batch.response_ids[2 * i][batch.response_mask[2 * i].bool()].tolist()
        assert got == seq[len(prompt) :]


def test_top_k_one_is_greedy_and_seed_reproduces(actor: torch.nn.Module) -> None:
    engine = HFRolloutEngine(actor, PAD, EOS_IDS)
    greedy = engine.generate(*prompts(), SamplingParams(do_sample=False, max_response_length=5))
    top1 = engine.generate(*prompts(), SamplingParams(top_k=1, max_response_length=5))
    assert torch.equal(greedy.response_ids, top1.response_ids)
    sampled = []
    for _ in range(2):
        torch.manual_seed(123)
        sampled.append(engine.generate(*prompts(), SamplingParams(n=2, max_response_length=5)))
    assert torch.equal(sampled[0].response_ids, sampled[1].response_ids)


def test_sync_weights_and_micro_batches(actor: torch.nn.Module) -> None:
    other = tiny.build_model(actor.config.vocab_size, seed=7)
    engine = HFRolloutEngine(copy.deepcopy(actor), PAD, micro_batch_size=2)
    params = SamplingParams(do_sample=False, max_response_length=6)
    before = engine.generate(*prompts(), params)
    engine.sync_weights(weight_buckets(other, 40_000))  # one tensor or a few per bucket
    after = engine.generate(*prompts(), params)
    expected = HFRolloutEngine(other, PAD).generate(*prompts(), params)
    assert torch.equal(after.response_ids, expected.response_ids)
    assert not torch.equal(before.response_ids, after.response_ids)
    engine.sleep()
    engine.wake_up()


def _tensor_parallel_rank(rank: int, port: int, model_a: str, model_b: str, out: str) -> None:
    """One of two gloo ranks sharing one tensor-parallel HF engine: greedy output on model A,
    then after a streamed sync of model B, then sampled (the same seed on both ranks)."""
    import torch.distributed as dist

    from tests.trainer.ranks import leave_rank
    from trainer.rollout.hf import rollout_copy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:  # as the actor builds it: empty, split, given memory, then synced before any rollout
        engine = HFRolloutEngine(rollout_copy(model_a, 2, 2, torch.device("cpu")), PAD, EOS_IDS)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                   for p in engine.model.parameters())
        engine.sync_weights(weight_buckets(models.load_actor(model_a), bucket_bytes=64 * 1024))
        greedy = SamplingParams(temperature=0.0, max_response_length=8)
        before = engine.generate(*prompts(), greedy)
        engine.sync_weights(weight_buckets(models.load_actor(model_b), bucket_bytes=64 * 1024))
        after = engine.generate(*prompts(), greedy)
        torch.manual_seed(7)
        sampled = engine.generate(*prompts(), SamplingParams(n=2, temperature=1.0, max_response_length=8))
        torch.save({"before": (before.response_ids, before.log_probs), "held": held,
                    "after": (after.response_ids, after.log_probs), "sampled": sampled.response_ids},
                   Path(out) / f"{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_a_tensor_parallel_engine_equals_one_rank_and_follows_a_weight_sync(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """`rollout.name=hf` with `tensor_model_parallel_size=2`: two ranks hold half of each
    decoder projection each and answer as one engine; their greedy tokens (and log-probs) equal
    a whole model's on one rank, before and after a streamed sync to other weights, and sampling
    with the same seed gives both ranks the same responses."""
    import torch.multiprocessing as mp

    from trainer.parallel import free_port

    model_b = tiny.save_tiny(tmp_path / "b", seed=1)
    mp.spawn(_tensor_parallel_rank, args=(free_port("127.0.0.1"), str(tiny_model_dir), str(model_b),
                                          str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    greedy = SamplingParams(temperature=0.0, max_response_length=8)
    for key, model in (("before", tiny_model_dir), ("after", model_b)):
        want = HFRolloutEngine(models.load_actor(model), PAD, EOS_IDS).generate(*prompts(), greedy)
        for rank in (0, 1):
            ids, log_probs = got[rank][key]
            assert ids.tolist() == want.response_ids.tolist(), (key, rank)
            torch.testing.assert_close(log_probs, want.log_probs, rtol=0, atol=1e-5)
    assert got[0]["before"][0].tolist() != got[0]["after"][0].tolist()  # the sync changed the answer
    assert got[0]["sampled"].tolist() == got[1]["sampled"].tolist()
    whole = sum(p.numel() for p in models.load_actor(tiny_model_dir).parameters())
    assert got[0]["held"] == got[1]["held"] < whole  # each rank holds part of the projections


def test_rollout_stops_on_every_eos_of_the_generation_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model whose generation config names two EOS ids: the trainer's HF rollout stops on
    either and its response mask ends there (verl's `get_response_mask` with the list)."""
    from tests.trainer.rollout.two_eos import check_two_eos
    from trainer.rewards.toy import write_toy_digits

    write_toy_digits(tmp_path / "data", train_size=16, val_size=16, seed=0)
    check_two_eos(tiny_model_dir, tmp_path / "data", tmp_path, "hf")


def test_eos_ids_are_the_tokenizer_s_and_the_generation_config_s(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.trainer.rollout.two_eos import with_two_eos

    tok = models.load_tokenizer(tiny_model_dir)
    assert models.eos_token_ids(tiny_model_dir, tok) == [EOS]
    two = with_two_eos(tiny_model_dir, tmp_path / "two", 9)
    assert models.eos_token_ids(two, tok) == [EOS, 9]
    (two / "generation_config.json").unlink()  # then the model config's id, as transformers derives it
    assert models.eos_token_ids(two, tok) == [EOS]
