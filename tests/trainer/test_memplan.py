"""The memory plan (`python -m trainer --plan-memory`): the public models' configs read as their
published sizes, the FSDP2 trace under `FakeTensorMode` at 16 fake ranks, the seeds' flagship
Qwen2.5-7B settings on 8 x 80 GiB refused with the phase, largest term and fix, and a reasonable
configuration accepted. The traces run for real (a subprocess with torch and transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.__main__ import main
from trainer.config import load_config
from trainer.memplan import GIB, ModelShape, plan_config, read_model, run_traces, update_estimate

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
QWEN_7B = CONFIGS / "Qwen2.5-7B-Instruct"

# The seeds' GRPO settings (verl's ROCm guide) for Qwen2.5-7B-Instruct on one node of 8 GPUs.
FLAGSHIP = [f"actor_rollout_ref.model.path={QWEN_7B}", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=1024", "data.max_prompt_length=512", "data.max_response_length=1024",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]


@pytest.mark.parametrize(("name", "billions"), [("Qwen2.5-0.5B", 0.494), ("Qwen2.5-7B-Instruct", 7.616),
                                                ("Llama-3.1-8B", 8.030)])
def test_the_fixtures_have_the_published_sizes(name: str, billions: float) -> None:
    assert read_model(str(CONFIGS / name)).params() / 1e9 == pytest.approx(billions, abs=0.001)


def test_a_directory_without_config_json_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no `config.json` at .*Fix: point `actor_rollout_ref.model.path`"):
        read_model(str(tmp_path))


@pytest.mark.slow
def test_the_fake_process_group_recipe_shards_over_16_ranks() -> None:
    shape = read_model(str(CONFIGS / "Qwen2.5-0.5B"))
    spec = {"config": shape.with_layers(2), "world": 16, "rows": 2, "seq_len": 128, "response_len": 64,
            "critic": False, "grad_ckpt": False, "param_dtype": "fp32", "reduce_dtype": "fp32"}
    (peak,) = run_traces([spec])
    params = ModelShape(shape.with_layers(2)).params()
    assert peak["SHARDED_PARAM"] == pytest.approx(params * 4 / 16, rel=0.02)
    assert peak["OPT"] == pytest.approx(2 * peak["SHARDED_PARAM"], rel=0.02)  # AdamW's two moments
    assert peak["UNSHARDED_PARAM"] > 0  # a gathered layer during forward/backward
    assert peak["Total"] >= sum(v for k, v in peak.items() if k != "Total") * 0.5


@pytest.mark.slow
def test_more_tokens_and_fewer_ranks_need_more() -> None:
    config = read_model(str(CONFIGS / "Qwen2.5-0.5B")).with_layers(2)
    small = update_estimate(config, 8, 2, 256, 128)
    long = update_estimate(config, 8, 8, 256, 128)
    fewer = update_estimate(config, 2, 2, 256, 128)
    assert long["Total"] > small["Total"] and fewer["Total"] > small["Total"]
    assert fewer["OPT"] == pytest.approx(4 * small["OPT"], rel=0.02)


@pytest.mark.slow
def test_the_flagship_7b_settings_are_refused_in_the_actor_update(capsys: pytest.CaptureFixture[str]) -> None:
    """fp32 with 24000 tokens a micro-batch and a 152k vocabulary: the update's activations do
    not fit 80 GiB; the rollout (vLLM's 0.6 share on top of the actor's shards) does."""
    assert main(["--plan-memory", "--device-memory", "80", *FLAGSHIP]) == 2
    out, err = capsys.readouterr()
    assert "training phases traced with 2 and 3 layers, extrapolated to 28" in out
    assert "actor micro-batch 15 x 1536 tokens on 8 ranks" in out
    assert ("the actor update phase needs" in err and "80.0 GiB are available" in err
            and "its largest term is activations" in err)
    assert "Fix: fewer micro-batch tokens (`actor_rollout_ref.actor.ppo_max_token_len_per_gpu`" in err
    assert "`actor_rollout_ref.model.enable_gradient_checkpointing=true`" in err
    plan = plan_config(load_config(FLAGSHIP), 80)
    phases = {p.name: p for p in plan.phases}
    assert phases["rollout"].fits and phases["weight sync"].fits and not phases["actor update"].fits
    terms = dict(phases["actor update"].terms)
    assert terms["parameter shards"] == pytest.approx(7.616e9 * 4 / 8, rel=0.03)
    assert terms["AdamW moments"] == pytest.approx(2 * 7.616e9 * 4 / 8, rel=0.03)
    # vLLM's share is of the TOTAL memory, on top of the actor's shards and moments
    rollout = dict(phases["rollout"].terms)
    assert rollout["vLLM share (gpu_memory_utilization x total)"] == int(0.6 * 80 * GIB)
    assert rollout["actor shards + AdamW moments"] == pytest.approx(3 * 7.616e9 * 4 / 8, rel=0.03)


@pytest.mark.slow
def test_a_rollout_share_too_large_for_what_the_trainer_holds_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*FLAGSHIP, "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=True"]
    assert main(["--plan-memory", *overrides]) == 2
    err = capsys.readouterr().err
    assert "the rollout phase needs" in err and "gpu_memory_utilization x total" in err
    assert "Fix: a lower `actor_rollout_ref.rollout.gpu_memory_utilization`" in err


@pytest.mark.slow
def test_a_reasonable_7b_configuration_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*FLAGSHIP, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=True"]
    assert main(["--plan-memory", "--device-memory", "80", *overrides]) == 0
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" not in out and "error" not in err
    assert out.startswith("memory plan: Qwen2.5-7B-Instruct, 7.62B parameters, 80 GiB per device")


@pytest.mark.slow
def test_offload_lowers_the_rollout_and_sync_but_not_the_update() -> None:
    """The update runs with the shards and the AdamW moments on the device whatever the offload
    (`Phases.on_device("update_actor", model, optim)`): offload frees them between updates, for the
    rollout and the weight sync, and brings them back for the update. Measured on an H200 (bench
    README, "One-GPU check"): with both offloads on, the second update's peak held the onloaded
    moments, 1.27-1.86 x a plan that counted them as host-resident."""
    base = FLAGSHIP
    offload = ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"]
    kept = {p.name: p for p in plan_config(load_config(base), 80).phases}
    off = {p.name: p for p in plan_config(load_config([*base, *offload]), 80).phases}
    assert off["actor update"].peak == kept["actor update"].peak
    terms = dict(off["actor update"].terms)
    assert terms["parameter shards"] == pytest.approx(7.616e9 * 4 / 8, rel=0.03)
    assert terms["AdamW moments"] == pytest.approx(2 * 7.616e9 * 4 / 8, rel=0.03)
    held = 3 * 7.616e9 * 4 / 8  # fp32 shards and two moments per rank
    assert kept["rollout"].peak - off["rollout"].peak == pytest.approx(held, rel=0.03)
    assert kept["weight sync"].peak - off["weight sync"].peak == pytest.approx(held, rel=0.03)
