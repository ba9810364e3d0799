"""The memory plan (`python -m trainer --plan-memory`): the public models' configs read as their
published sizes, the FSDP2 trace under `FakeTensorMode` at 16 fake ranks, the seeds' flagship
Qwen2.5-7B settings on 8 x 80 GiB refused with the phase, largest term and fix, and a reasonable
configuration accepted. The traces run for real (a subprocess with torch and transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer.__main__ import main
from trainer.config import load_config
from trainer.memplan import (
    GIB,
    ModelShape,
    plan_config,
    read_model,
    run_traces,
    update_estimate,
    update_estimates,
)

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
    small, long, fewer = update_estimates(config, [(8, 2), (8, 8), (2, 2)], 256, 128)  # one trace process
    assert update_estimate(config, 8, 2, 256, 128) == small  # one case alone: the same trace
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


def test_a_critic_sized_by_nothing_is_refused_rather_than_planned(capsys: pytest.CaptureFixture[str]) -> None:
    """PPO with a critic and no critic micro-batch size: the plan would put a worker's whole
    mini-batch in one critic micro-batch (hundreds of GiB of activations for a 7B model); verl
    refuses the configuration, and so does the plan, naming the key."""
    ppo = [f"actor_rollout_ref.model.path={QWEN_7B}", f"critic.model.path={QWEN_7B}", "algorithm.adv_estimator=gae",
           "data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=8"]
    assert main(["--plan-memory", *ppo]) == 2
    assert "`critic.ppo_micro_batch_size_per_gpu` (e.g. 4)" in capsys.readouterr().err


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


def test_pinned_blocks_round_to_the_next_power_of_two() -> None:
    """torch's caching host allocator (`CachingHostAllocator.h`, `PowerOf2Ceil`)."""
    from trainer.memplan import pinned

    gate_up = 2 * 18944 * 3584 * 2 // 2  # Qwen2-7B's gate_up_proj, bf16, half of it at TP=2: 136 MB
    assert pinned(gate_up) == 256 * 2**20
    assert [pinned(n) for n in (1, 2, 3, 4096, 4097)] == [1, 2, 4, 4096, 8192]


def test_vllm_sees_the_fused_tensors_of_the_same_parameters() -> None:
    shape = read_model(str(QWEN_7B))
    assert sum(shape.tensors(fused=True)) == sum(shape.tensors()) == shape.params()
    assert shape.tensors(fused=True).count(2 * 18944 * 3584) == shape.layers  # gate_up_proj


# Qwen2-7B GRPO on MI300X nodes of 8 (the `mi300-cluster` profile: `mem: 200G`), TP=2 vLLM,
# every offload on: 16 ranks over 2 nodes.
FLAGSHIP_OFFLOAD = [f"actor_rollout_ref.model.path={QWEN_7B}", "algorithm.adv_estimator=grpo",
                    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                    "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.use_kl_loss=True",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "data.train_batch_size=1024",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "trainer.n_gpus_per_node=8", "trainer.nnodes=2"]


def test_the_host_memory_of_a_node_counts_pinned_blocks_at_their_rounded_size() -> None:
    """The figures of the 200 GiB node: vLLM's level-1 backup of 7.1 GiB of bf16 weights per rank
    is 13.4 GiB pinned (107 GiB on 8 ranks), the offloaded moments 3.5 -> 6.7 GiB per rank; at
    level 1 the node needs 215 GiB and is refused, at level 2 (what the engine does) 108 GiB."""
    from dataclasses import replace

    from trainer.memplan import host_phase, settings_from_config

    shape = read_model(str(QWEN_7B))
    s = settings_from_config(load_config(FLAGSHIP_OFFLOAD), 192, host_gib=200)
    assert (s.gpus_per_node, s.world, s.sleep_level) == (8, 16, 2)
    level1 = dict(host_phase(shape, replace(s, sleep_level=1)).terms)
    assert level1["8 x vLLM level-1 sleep backup (pinned, power-of-two blocks)"] / GIB == pytest.approx(107.0, abs=0.1)
    assert level1["8 x offloaded AdamW moments (pinned, power-of-two blocks)"] / 8 / GIB == pytest.approx(6.74, abs=0.01)
    assert level1["8 x offloaded actor shards"] / 8 / GIB == pytest.approx(shape.params() * 4 / 16 / GIB, rel=1e-3)
    refused = replace(host_phase(shape, replace(s, sleep_level=1)))
    assert not refused.fits and refused.peak / GIB == pytest.approx(215.3, abs=0.1)
    kept = host_phase(shape, s)
    assert kept.fits and kept.peak / GIB == pytest.approx(108.3, abs=0.1)
    assert dict(kept.terms)["8 x vLLM level-2 sleep backup (pinned, power-of-two blocks)"] == 0


def test_a_node_too_small_for_its_host_memory_is_refused_with_the_fix() -> None:
    from trainer.memplan import Plan, host_phase, settings_from_config

    s = settings_from_config(load_config(FLAGSHIP_OFFLOAD), 192, host_gib=96)
    plan = Plan("Qwen2.5-7B", 0, s.device_bytes, (host_phase(read_model(str(QWEN_7B)), s),), ())
    refusal = plan.refusal()
    assert refusal is not None
    assert refusal.startswith("the host memory phase needs 108.3 GiB per node but 96.0 GiB are available "
                              "(`slurm.mem`); its largest term is 8 x offloaded AdamW moments")
    assert "Fix: a larger `slurm.mem`" in refusal and "optimizer_offload=false" in refusal


def test_the_plan_traces_the_packed_path_when_it_runs() -> None:
    """`use_remove_padding` packs a micro-batch into one row: the trace runs that path with the
    workers' attention (no dense (T, T) mask), and its activations are no larger than the padded
    path's for the same real tokens."""
    from trainer.memplan import _trace_spec, settings_from_config

    cfg = load_config([*FLAGSHIP, "actor_rollout_ref.model.use_remove_padding=true"])
    s = settings_from_config(cfg, 80)
    assert s.actor.remove_padding and _trace_spec(read_model(str(QWEN_7B)), s, s.actor, False, 2)["remove_padding"]
    shape = read_model(str(CONFIGS / "Qwen2.5-0.5B"))
    spec = {"config": shape.with_layers(2), "world": 2, "rows": 4, "seq_len": 256, "response_len": 128,
            "critic": False, "grad_ckpt": False, "param_dtype": "fp32", "reduce_dtype": "fp32"}
    padded, packed = run_traces([spec, {**spec, "remove_padding": True}])
    assert packed["ACT"] <= padded["ACT"] and packed["Total"] <= padded["Total"] * 1.01, (packed, padded)


def test_server_mode_counts_its_worker_processes_on_the_device_and_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout.mode=async`: vLLM's worker on each GPU is a process of its own (the in-process
    engine lives in the trainer's). Its CUDA context stays while it sleeps, so the update and the
    weight sync carry one more; the host carries one more process per GPU and, at TP=2, one
    engine core per replica (4 on a node of 8)."""
    from dataclasses import replace

    from trainer.memplan import CUDA_CONTEXT, HOST_PROCESS, host_phase, plan, settings_from_config

    shape = read_model(str(QWEN_7B))
    inproc = settings_from_config(load_config(FLAGSHIP_OFFLOAD), 192, host_gib=200)
    server = settings_from_config(load_config([*FLAGSHIP_OFFLOAD, "actor_rollout_ref.rollout.mode=async"]), 192,
                                  host_gib=200)
    assert (inproc.server_mode, server.server_mode) == (False, True)
    host = dict(host_phase(shape, server).terms)
    assert host["8 x server-mode vLLM worker process"] == 8 * HOST_PROCESS
    assert host["4 x server-mode vLLM engine core"] == 4 * HOST_PROCESS
    assert host_phase(shape, server).peak - host_phase(shape, inproc).peak == 12 * HOST_PROCESS
    one = dict(host_phase(shape, replace(server, tp=1)).terms)
    assert one["0 x server-mode vLLM engine core"] == 0  # one GPU: the engine core runs the worker
    # the device phases: the update's trace (a subprocess) replaced by a fixed peak; the terms compared are others
    import trainer.memplan as memplan

    monkeypatch.setattr(memplan, "traced_peaks", lambda s, sides, layers: [{"ACT": GIB}] * len(sides))
    a = {p.name: p for p in plan(shape, inproc).phases}
    b = {p.name: p for p in plan(shape, server).phases}
    for name in ("actor update", "weight sync"):
        assert b[name].peak - a[name].peak == CUDA_CONTEXT, name
    assert b["rollout"].peak == a["rollout"].peak  # inside vLLM's share while it generates


def test_cuda_graphs_take_their_room_from_the_kv_cache_unless_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM >= 0.21 takes its CUDA graphs out of the KV cache's room inside
    `gpu_memory_utilization`: with graphs (verl's and our default, `enforce_eager=false`) the KV
    cache phase carries them and the planned KV cache is that much smaller; eager has none; the
    share the rollout phase reserves is the same either way."""
    import re

    import trainer.memplan as memplan
    from trainer.memplan import CUDA_GRAPHS, plan, settings_from_config

    monkeypatch.setattr(memplan, "traced_peaks", lambda s, sides, layers: [{"ACT": GIB}] * len(sides))
    shape = read_model(str(QWEN_7B))
    graphs = settings_from_config(load_config(FLAGSHIP), 80)
    eager = settings_from_config(load_config([*FLAGSHIP, "actor_rollout_ref.rollout.enforce_eager=true"]), 80)
    a, b = plan(shape, graphs), plan(shape, eager)
    kv = {p.name: p for p in a.phases}["vLLM KV cache"], {p.name: p for p in b.phases}["vLLM KV cache"]
    assert dict(kv[0].terms)["CUDA graphs (`enforce_eager=false`)"] == CUDA_GRAPHS
    assert dict(kv[1].terms)["CUDA graphs (`enforce_eager=false`)"] == 0
    assert {p.name: p for p in a.phases}["rollout"].peak == {p.name: p for p in b.phases}["rollout"].peak

    def kv_gib(made) -> float:
        (note,) = [n for n in made.notes if n.startswith("vLLM KV cache:")]
        return float(re.match(r"vLLM KV cache: ([\d.]+) GiB", note).group(1))

    assert kv_gib(b) - kv_gib(a) == pytest.approx(CUDA_GRAPHS / GIB, abs=0.11)


def test_a_rollout_pool_is_planned_by_role() -> None:
    """The share that the colocated trainer refuses (vLLM's 0.9 beside the trainer's shards) is
    planned on the pool's own devices under one-step-off: the trainer's phases hold no engine,
    the pool's hold the engine alone, each named."""
    overrides = [*FLAGSHIP, "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.hybrid_engine=false",
                 "rollout.nnodes=1", "rollout.n_gpus_per_node=8"]
    cfg = load_config(overrides, env={})
    made = plan_config(cfg, 80)
    names = [p.name for p in made.phases]
    assert "rollout" not in names and {"rollout pool: rollout", "rollout pool: vLLM KV cache"} <= set(names), names
    pool_rollout = next(p for p in made.phases if p.name == "rollout pool: rollout")
    assert {t for t, _ in pool_rollout.terms} == {"CUDA context", "vLLM share (gpu_memory_utilization x total)",
                                                  "received buckets"}
    sync = next(p for p in made.phases if p.name == "weight sync")
    assert "rollout engine weights" not in {t for t, _ in sync.terms}
    # the broadcast holds one bucket beside the gathered one on each side, two when pipelined
    bucket = dict(sync.terms)["gathered bucket"]
    assert dict(sync.terms)["broadcast buffers"] == bucket == dict(pool_rollout.terms)["received buckets"]
    piped = plan_config(load_config([*overrides, "async_training.checkpoint_engine.overlap_broadcast_and_consume=true"],
                                    env={}), 80)
    assert dict(next(p for p in piped.phases if p.name == "weight sync").terms)["broadcast buffers"] == 2 * bucket
    assert dict(next(p for p in piped.phases if p.name == "rollout pool: rollout").terms)["received buckets"] == 2 * bucket
    stored = plan_config(load_config([*overrides, "async_training.checkpoint_engine.enable=false"], env={}), 80)
    assert dict(next(p for p in stored.phases if p.name == "weight sync").terms)["broadcast buffers"] == 0
    update = next(p for p in made.phases if p.name == "actor update")
    assert dict(update.terms).get("idle vLLM", 0) == 0
    assert made.refusal() is None  # colocated, this share is refused (the test above)


def test_the_one_step_off_entry_plans_the_pool_the_launcher_asks_it_to(capsys: pytest.CaptureFixture[str]) -> None:
    """What `hpcrl submit --loop one-step-off` runs before the queue (`python -m trainer.one_step_off
    --plan-memory`): the pool's phases in the table; the synchronous entry refuses the same overrides."""
    from trainer.one_step_off import main as one_step_off_main

    pool = [*FLAGSHIP, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.hybrid_engine=false",
            "rollout.nnodes=1", "rollout.n_gpus_per_node=8"]
    assert one_step_off_main(["--plan-memory", "--device-memory", "80", *pool]) == 0
    out = capsys.readouterr().out
    assert "rollout pool: rollout" in out and "rollout pool: vLLM KV cache" in out, out
    assert main(["--plan-memory", *pool]) == 2
    assert "python -m trainer.one_step_off" in capsys.readouterr().err
    # the fully-async entry plans the same pools (its updates take mini-batches, as one-step-off's)
    from trainer.fully_async import main as fully_async_main

    streamed = [*pool, "data.train_batch_size=0", "async_training.partial_rollout=false"]
    assert fully_async_main(["--plan-memory", "--device-memory", "80", *streamed]) == 0
    assert "rollout pool: vLLM KV cache" in capsys.readouterr().out


def test_the_critic_is_planned_with_its_own_override_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`critic.model.override_config` edits the critic's shape as the critic is built (the actor's
    own override does not reach it): its traced update and its resident shards are the edited
    critic's. The update's trace (a subprocess) is replaced by a fixed peak; the shapes it is
    given and the shard terms are compared."""
    import trainer.memplan as memplan

    seen: list[list[tuple[int, bool]]] = []

    def fake(s: Any, sides: list[Any], layers: str) -> list[dict[str, int]]:
        seen.append([(shape.layers, critic) for shape, _, critic in sides])
        return [{"ACT": GIB}] * len(sides)

    monkeypatch.setattr(memplan, "traced_peaks", fake)
    gae = [*FLAGSHIP, "algorithm.adv_estimator=gae", f"critic.model.path={QWEN_7B}"]
    same = plan_config(load_config(gae), 80)
    halved = plan_config(load_config([*gae, "+critic.model.override_config.num_hidden_layers=14",
                                      "+actor_rollout_ref.model.override_config.max_position_embeddings=4096"]), 80)
    assert seen == [[(28, False), (28, True)], [(28, False), (14, True)]]

    def critic_shards(made: Any) -> int:
        return dict({p.name: p for p in made.phases}["actor update"].terms)["critic shards + AdamW moments"]

    layer = (read_model(str(QWEN_7B)).params() - ModelShape({**read_model(str(QWEN_7B)).config,
                                                             "num_hidden_layers": 0}).params()) // 28
    assert critic_shards(same) - critic_shards(halved) == pytest.approx(14 * layer * 12 // 8, rel=1e-6)


def test_a_trace_is_kept_and_read_back_for_the_same_spec_and_code(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The trace cache: the same spec traced by the same code is read back, not traced again (a
    resubmission's plan); another spec, or a change to the tracing code, is traced anew; `off`
    keeps nothing. Real traces of a 2-layer model."""
    import trainer.memplan as memplan

    calls: list[int] = []
    real = memplan._trace_now

    def counted(specs: list[dict[str, Any]]) -> list[dict[str, int]]:
        calls.append(len(specs))
        return real(specs)

    monkeypatch.setattr(memplan, "_trace_now", counted)
    monkeypatch.setenv("HPCRL_MEMTRACE_CACHE", str(tmp_path / "cache"))
    config = read_model(str(CONFIGS / "Qwen2.5-0.5B")).with_layers(2)
    first = update_estimate(config, 2, 1, 64, 32, layers="full")
    assert calls == [1] and len(list((tmp_path / "cache").glob("*.json"))) == 1
    assert update_estimate(config, 2, 1, 64, 32, layers="full") == first and calls == [1]  # read back
    both = update_estimates(config, [(2, 1), (4, 1)], 64, 32)  # the first read back, the other traced
    assert both[0] == first and calls == [1, 1] and both[1]["OPT"] < first["OPT"]
    monkeypatch.setattr(memplan, "_TRACED_BY", (*memplan._TRACED_BY, "memplan.py"))  # other code
    assert update_estimate(config, 2, 1, 64, 32, layers="full") == first and calls == [1, 1, 1]
    monkeypatch.setenv("HPCRL_MEMTRACE_CACHE", "off")
    update_estimate(config, 2, 1, 64, 32, layers="full")
    assert calls == [1, 1, 1, 1] and memplan.trace_cache() is None
