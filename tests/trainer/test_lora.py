"""LoRA through peft (`actor_rollout_ref.model.lora_rank`, `lora_alpha`, `target_modules`) on the
tiny model: only the adapters train, the reference policy is the base model, the rollout engine
and the HF export get the merged weights under the base names (on one rank and on two FSDP2
ranks over gloo alike), a checkpoint resumes the adapters and their optimizer state exactly, and
the CLI trains with it."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trainer import parallel as P
from trainer.batch import MiniBatchShare
from trainer.checkpoint import full_state as ckpt
from trainer.config import ConfigError, describe_keys, load_config
from trainer.driver import PPODriver
from trainer.exit_codes import REQUEUE_EXIT_CODE
from trainer.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.rewards.toy import write_toy_digits

    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=64, val_size=4, seed=0)
    return out


def _peft_copy(model_dir: Path, lora_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A peft model of the tiny model holding `lora_state` (peft names)."""
    from trainer.lora import apply_lora
    from trainer.models import load_actor

    model = apply_lora(load_actor(model_dir), 8, 16, ["all-linear"])
    model.load_state_dict(lora_state)
    return model.eval()


# ------------------------------------------------------------------------------------ config


def test_lora_keys_act_and_wrong_values_are_refused(tiny_model_dir: Path) -> None:
    from trainer.lora import apply_lora
    from trainer.models import load_actor

    cfg = load_config([*LORA, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    model_cfg = cfg.actor_rollout_ref.model
    assert (model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert load_config().actor_rollout_ref.model.target_modules == ["all-linear"]
    listed = {key: help_text for key, _, help_text in describe_keys()}
    for key in ("lora_rank", "lora_alpha", "target_modules"):
        assert "compatibility only" not in listed[f"actor_rollout_ref.model.{key}"]
    assert "adapters disabled" in listed["actor_rollout_ref.model.lora_rank"]
    for items, message in (
            (["actor_rollout_ref.model.lora_rank=-1"], "must be 0 .*or a positive LoRA rank"),
            ([*LORA, "actor_rollout_ref.model.lora_alpha=0"], "`actor_rollout_ref.model.lora_alpha=0` must be positive"),
            ([*LORA, "actor_rollout_ref.model.target_modules=[all-linear,q_proj]"], "give it alone"),
            ([*LORA, "actor_rollout_ref.model.target_modules=[]"], "target_modules` is empty"),
            (["critic.model.lora_rank=8"], "LoRA for the critic.*`actor_rollout_ref.model.lora_rank`"),
            # verl's default (`all-linear`) changes nothing without a rank: accepted with a note
            (["critic.model.target_modules=[q_proj]"], "LoRA for the critic")):
        with pytest.raises(ConfigError, match=message):
            load_config(items)
    load_config(["critic.model.target_modules=all-linear"])
    with pytest.raises(ConfigError, match=r"`qkv_proj` match\(es\) no linear layer.*`q_proj`.*`up_proj`"):
        apply_lora(load_actor(tiny_model_dir), 8, 16, ["q_proj", "qkv_proj"])
    partial = apply_lora(load_actor(tiny_model_dir), 4, 8, ["q_proj", "v_proj"])
    adapted = {n.rsplit(".", 3)[0].rsplit(".", 1)[-1] for n, p in partial.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}


# ------------------------------------------------------------- one and two ranks (gloo, FSDP2)


def _overrides(model: str, world: int) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"trainer.n_gpus_per_node={world}", *LORA,
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.use_kl_loss=true", "data.max_response_length=8",
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1",
            # mini-batch normalisers (verl's model engine): one rank and two take the same step
            "trainer.use_legacy_worker_impl=disable"]


def _rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    from tests.trainer.test_parallel import _batch
    from trainer.algos.core_algos import loss_normalizers
    from trainer.workers.actor import ActorRolloutRefWorker

    torch.set_num_threads(1)
    minis = [_batch(4, 1), _batch(4, 2)]
    mine = [MiniBatchShare(m.select(P.split_rows(len(m), world)[rank]), *loss_normalizers(m.response_mask))
            for m in minis]
    actor = ActorRolloutRefWorker(load_config(_overrides(model, world)), rank, world, total_steps=3)
    actor.init_dist("127.0.0.1", port)
    results: dict[str, object] = {
        "trainable": sorted(n for n, p in actor.model.named_parameters() if p.requires_grad),
        "optimized": sum(p.numel() for g in actor.optim.param_groups for p in g["params"]),
        "ref_is_actor": actor.ref is None}
    results["ref_before"] = actor.compute_ref_log_probs(minis[0])["log_probs"]
    actor.update_actor([mine])
    results["state"] = actor.state_for_test()  # peft names: base layers and adapters
    results["ref_after"] = actor.compute_ref_log_probs(minis[0])["log_probs"]
    results["actor_after"] = actor.compute_log_probs(minis[0])["log_probs"]
    # what the weight sync streams (buckets of 40 kB: several per layer), copied as it arrives
    results["streamed"] = {n: t.clone() for b in P.weight_buckets(actor.model, 40_000) for n, t in b}
    actor.sync_rollout_weights()
    if not actor.shares_weights:  # two ranks: the HF engine's own copy, fed by the sync
        results["engine"] = {k: v.clone() for k, v in actor.rollout.model.state_dict().items()}
    actor.save(f"{out}.ckpt", "actor", model)  # a collective; rank 0 writes the HF export
    torch.save(results, f"{out}.{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(world: int, model: Path, out: Path) -> dict[str, object]:
    ctx = mp.start_processes(_rank_main, args=(world, _free_port(), str(model), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    assert ctx is not None
    while not ctx.join():
        pass
    return torch.load(f"{out}.0", weights_only=False)


def test_lora_on_one_and_two_ranks_trains_adapters_and_syncs_merged_weights(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Only the adapters train (base weights unchanged, adapters moved); the reference policy
    is the base model before and after the update; the weight sync and the HF export carry
    exactly `merge_and_unload()`'s weights under the base names, on one rank and on two."""
    from transformers import AutoModelForCausalLM

    from trainer.models import compute_log_probs, load_actor

    base = load_actor(tiny_model_dir).eval()
    base_state = base.state_dict()
    batch = __import__("tests.trainer.test_parallel", fromlist=["_batch"])._batch(4, 1)
    with torch.no_grad():
        base_lp, _ = compute_log_probs(base, batch.input_ids, batch.attention_mask, batch.response_length)
    base_lp = base_lp * batch.response_mask
    runs = {w: _run_ranks(w, tiny_model_dir, tmp_path / f"w{w}") for w in (1, 2)}
    for world, res in runs.items():
        trainable = res["trainable"]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), world
        state = res["state"]
        assert res["optimized"] == sum(state[n].numel() for n in trainable) < base.num_parameters() / 5
        assert res["ref_is_actor"]
        for name, tensor in state.items():
            if ".lora_" not in name:  # base weights: frozen
                plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                assert torch.equal(tensor, base_state[plain]), (world, name)
        assert max(state[n].abs().max().item() for n in trainable if ".lora_B." in n) > 1e-3, "B did not move"
        for key in ("ref_before", "ref_after"):
            torch.testing.assert_close(res[key] * batch.response_mask, base_lp, rtol=0, atol=2e-5)
        assert (res["actor_after"] - res["ref_after"]).abs().max() > 1e-2, "the update did not act"
        merged = _peft_copy(tiny_model_dir, state).merge_and_unload().state_dict()
        streamed = res["streamed"]
        assert set(streamed) == set(merged) == set(base_state), world
        for name, tensor in merged.items():
            torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=f"{world} {name}")
        if world == 2:
            for name, tensor in res["engine"].items():
                torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
        exported, info = AutoModelForCausalLM.from_pretrained(
            tmp_path / f"w{world}.ckpt" / ckpt.HF_DIR, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        for name, tensor in exported.state_dict().items():
            torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
    for name, tensor in runs[1]["streamed"].items():
        torch.testing.assert_close(runs[2]["streamed"][name], tensor, rtol=0, atol=1e-5, msg=name)


# --------------------------------------------------------------------------- driver and CLI


def _driver_overrides(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
            f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo", *LORA,
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=true",
            # the untrained model's rewards are all equal (no advantage): the entropy bonus
            # gives the adapters a gradient anyway
            "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.val_before_train=false", "trainer.device=cpu", "trainer.seed=7",
            f"trainer.default_local_dir={run}", "trainer.logger=jsonl", "trainer.total_training_steps=2",
            *extra]


def test_generation_after_sync_equals_the_merged_model(tiny_model_dir: Path, toy_data: Path,
                                                       tmp_path: Path) -> None:
    """After a LoRA step the trainer's rollout (one rank: the peft model itself) and an HF engine
    fed by the streamed sync both answer greedily as `merge_and_unload()` does."""
    from tests.trainer.rollout.test_vllm import _prompts
    from trainer.models import load_actor
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine

    driver = PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, tmp_path,
                                                     "trainer.total_training_steps=1")))
    assert driver.fit() == 0
    worker = driver.actor_group.workers[0]
    merged = copy.deepcopy(worker.model).merge_and_unload().eval()
    engine = HFRolloutEngine(load_actor(tiny_model_dir).eval(), pad_token_id=0, eos_token_id=3)
    engine.sync_weights(P.weight_buckets(worker.model, 40_000))
    ids, mask = _prompts(tiny_model_dir)
    greedy = SamplingParams(n=1, max_response_length=16, do_sample=False)
    want = HFRolloutEngine(merged, pad_token_id=0, eos_token_id=3).generate(ids, mask, greedy)
    before = HFRolloutEngine(load_actor(tiny_model_dir).eval(), pad_token_id=0, eos_token_id=3)
    assert (before.generate(ids, mask, greedy).log_probs - want.log_probs).abs().max() > 1e-3, \
        "the step should change the policy"
    worker.model.eval()
    for out in (engine.generate(ids, mask, greedy), worker.rollout.generate(ids, mask, greedy)):
        assert torch.equal(out.response_ids, want.response_ids)
        live = out.response_mask.bool()
        torch.testing.assert_close(out.log_probs[live], want.log_probs[live], rtol=0, atol=1e-4)
    sampled = SamplingParams(n=2, max_response_length=16)  # same seed, same weights: same samples
    torch.manual_seed(3)
    want = HFRolloutEngine(merged, pad_token_id=0, eos_token_id=3).generate(ids, mask, sampled)
    torch.manual_seed(3)
    assert torch.equal(engine.generate(ids, mask, sampled).response_ids, want.response_ids)


def test_checkpoint_resumes_adapters_and_optimizer_state_exactly(tiny_model_dir: Path, toy_data: Path,
                                                                 tmp_path: Path) -> None:
    """Stopped after step 1 and resumed, step 2 gives the same loss and adapters as an
    uninterrupted run; the checkpoint's optimizer state covers the adapters alone."""
    from trainer.checkpoint import sharded

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    whole = PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, straight)))
    assert whole.fit() == 0
    first = PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, broken)))
    first.stop.install = lambda *a: None  # type: ignore[method-assign]
    original = first.train_step

    def step_then_stop(examples):  # type: ignore[no-untyped-def]
        metrics = original(examples)
        (broken / "STOP").touch()
        return metrics

    first.train_step = step_then_stop  # type: ignore[method-assign]
    assert first.fit() == REQUEUE_EXIT_CODE
    saved = ckpt.find_latest_checkpoint(broken)
    assert saved == broken / "global_step_1"
    state = sharded.read_group_state(saved, "actor")
    params = state["optim"]["param_groups"][0]["params"]
    assert params and all(".lora_A." in n or ".lora_B." in n for n in params), params
    resumed = PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, broken)))
    assert resumed.fit() == 0
    want = whole.actor_group.run_rank(0, "state_for_test")
    got = resumed.actor_group.run_rank(0, "state_for_test")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    losses = {run: [r["actor/pg_loss"] for r in read_jsonl(run / "metrics.jsonl")] for run in (straight, broken)}
    assert losses[broken] == losses[straight] and len(losses[straight]) == 2


def test_cli_trains_two_lora_steps(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    args = _driver_overrides(tiny_model_dir, toy_data, run, "trainer.logger=['console','jsonl']",
                             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all("actor/kl_loss" in r for r in records)
    hf = ckpt.find_latest_checkpoint(run) / ckpt.HF_DIR
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_resuming_across_a_lora_change_names_the_key(tiny_model_dir: Path, toy_data: Path,
                                                     tmp_path: Path) -> None:
    from trainer.checkpoint import sharded

    full = [o for o in _driver_overrides(tiny_model_dir, toy_data, tmp_path, "trainer.total_training_steps=1")
            if o not in LORA]
    assert PPODriver(load_config(full)).fit() == 0
    with pytest.raises(sharded.CheckpointFormatError, match=r"holds a different `actor` model.*"
                       r"`actor_rollout_ref.model.lora_rank`.*trainer.resume_mode=disable"):
        PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, tmp_path))).fit()


def test_gradient_checkpointing_gives_the_same_lora_update(tiny_model_dir: Path) -> None:
    """peft's frozen embeddings with activation checkpointing still pass gradients to the
    adapters: the same update as without."""
    from tests.trainer.test_parallel import _batch
    from trainer.algos.core_algos import loss_normalizers
    from trainer.workers.actor import ActorRolloutRefWorker

    adapters = []
    for checkpointing in ("false", "true"):
        cfg = load_config([*_overrides(str(tiny_model_dir), 1), "trainer.device=cpu",
                           f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"])
        actor = ActorRolloutRefWorker(cfg, 0, 1, total_steps=3)
        actor.init_dist(None, None)
        batch = _batch(4, 1)
        actor.update_actor([[MiniBatchShare(batch, *loss_normalizers(batch.response_mask))]])
        adapters.append({k: v for k, v in actor.state_for_test().items() if ".lora_B." in k})
    assert max(v.abs().max().item() for v in adapters[0].values()) > 1e-3
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(adapters[1][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_ray_ranks_train_lora_and_resume_on_one(tiny_model_dir: Path, toy_data: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The distributed trainer (private Ray cluster, 2 CPU ranks, FSDP2 over gloo, HF rollout
    fed by the merged sync) trains a LoRA step; its checkpoint resumes on one rank."""
    from transformers import AutoModelForCausalLM

    from tests.trainer.test_distributed import no_ray_address
    from trainer.driver import run_training

    no_ray_address(monkeypatch)
    run = tmp_path / "run"
    two = _driver_overrides(tiny_model_dir, toy_data, run, "trainer.n_gpus_per_node=2",
                            "trainer.total_training_steps=1",
                            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    assert run_training(load_config(two)) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[0]["timing_s/update_weights"] > 0
    saved = ckpt.find_latest_checkpoint(run)
    assert ckpt.load_state(saved, "trainer_state")["world_size"] == 2
    model, info = AutoModelForCausalLM.from_pretrained(saved / ckpt.HF_DIR, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert run_training(load_config(_driver_overrides(tiny_model_dir, toy_data, run))) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


# ------------------------------------------------------------------------------------ a saved adapter


def _save_adapter(model_dir: Path, out: Path, rank: int, alpha: int, targets: list[str]) -> dict[str, torch.Tensor]:
    """A peft adapter of the tiny model with random (nonzero) A and B, saved to `out`; its
    adapter weights by peft name."""
    from trainer.lora import apply_lora
    from trainer.models import load_actor

    model = apply_lora(load_actor(model_dir), rank, alpha, targets)
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.05)
    model.save_pretrained(out)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_starts_from_a_saved_adapter_and_trains_it(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`model.lora_adapter_path` alone (verl's `*_lora_from_adapter.sh`): the adapter's rank,
    alpha and target modules are the run's, the actor's adapters hold its weights exactly before
    the first step, the reference is the base model, and a step trains them."""
    saved = _save_adapter(tiny_model_dir, tmp_path / "adapter", 4, 8, ["q_proj", "v_proj"])
    cfg = load_config(_driver_overrides(tiny_model_dir, toy_data, tmp_path / "run", "actor_rollout_ref.model.lora_rank=0",
                                        f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
                                        "trainer.total_training_steps=1"))
    driver = PPODriver(cfg)
    worker = driver.actor_group.workers[0]
    model = worker.model
    peft_cfg = model.peft_config["default"]
    assert (peft_cfg.r, peft_cfg.lora_alpha, sorted(peft_cfg.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(start) == sorted(saved) and len(saved) == 4 * 2  # 2 layers x (q, v) x (A, B)
    for name, value in saved.items():
        assert torch.equal(start[name], value), name
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    assert worker.ref is None  # the reference: the same model, adapters disabled
    assert driver.fit() == 0
    after = {n: p.detach() for n, p in worker.model.named_parameters() if "lora_" in n}
    assert any(not torch.equal(after[n], saved[n]) for n in saved), "the step should train the adapters"


def test_a_run_whose_lora_settings_disagree_with_the_adapter_is_refused(tiny_model_dir: Path, toy_data: Path,
                                                                         tmp_path: Path) -> None:
    from trainer.lora import adapter_settings

    _save_adapter(tiny_model_dir, tmp_path / "adapter", 4, 8, ["q_proj", "v_proj"])
    adapter = f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}"
    cfg = load_config([*LORA, adapter, "actor_rollout_ref.model.target_modules=[q_proj,k_proj]"])
    with pytest.raises(ConfigError) as err:
        adapter_settings(cfg.actor_rollout_ref.model)
    message = str(err.value)
    assert "`actor_rollout_ref.model.lora_rank=8` (the adapter's `r` is 4)" in message
    assert "`actor_rollout_ref.model.lora_alpha=16` (the adapter's is 8)" in message
    assert "['q_proj', 'k_proj']` (the adapter's are ['q_proj', 'v_proj'])" in message and "Fix:" in message
    agreeing = load_config(["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", adapter])
    assert adapter_settings(agreeing.actor_rollout_ref.model) == (4, 8, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="cannot read"):
        adapter_settings(load_config([f"actor_rollout_ref.model.lora_adapter_path={tmp_path}"]).actor_rollout_ref.model)
    with pytest.raises(ConfigError, match="lora_rank=8"):  # the driver refuses before training
        PPODriver(load_config(_driver_overrides(tiny_model_dir, toy_data, tmp_path / "run", adapter)))
