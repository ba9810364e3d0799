"""verl's one-step-off loop (`python -m trainer.one_step_off`) on a real two-node Ray cluster on
this machine (`ray.cluster_utils.Cluster`: two raylets, each declaring GPUs, so Ray places the
pools and sets `CUDA_VISIBLE_DEVICES` per rank exactly as on GPU nodes; the ranks compute on the
CPU with `trainer.device=cpu`): the trainer's two ranks on one node, the rollout pool's rank on
the other; every batch's weights one step behind at most (0, then 1, 1), the pool's engine given
exactly the trainer's weights at each sync, and a checkpoint taken while the next batch is in
flight resuming on that same batch of prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.async_rl.conftest import stopped_after
from tests.trainer.test_distributed import overrides, toy  # noqa: F401 (a fixture)
from trainer.config import ConfigError, load_config
from trainer.config.async_training import check_separate_pools_built
from trainer.metrics import read_jsonl

POOL = ("actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1")


def base(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    """The distributed tests' small GRPO run (:func:`tests.trainer.test_distributed.overrides`),
    with a learning rate that moves the weights within a step and the rollout's log-probs kept."""
    return overrides(model, data, run, "actor_rollout_ref.actor.optim.lr=1e-2", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.rollout.calculate_log_probs=true", *extra)


# ---------------------------------------------------------------------------- which loop runs what


def test_each_entry_runs_only_the_configs_of_its_loop(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    pooled = load_config(base(tiny_model_dir, data, tmp_path, *POOL), env={})
    colocated = load_config(base(tiny_model_dir, data, tmp_path), env={})
    check_separate_pools_built(pooled, "one_step_off")
    check_separate_pools_built(colocated, "sync")
    with pytest.raises(ConfigError, match=r"python -m trainer\.one_step_off"):
        check_separate_pools_built(pooled, "sync")
    with pytest.raises(ConfigError, match="has none"):
        check_separate_pools_built(colocated, "one_step_off")
    with pytest.raises(ConfigError, match="train_batch_size must be zero"):  # verl's fully-async assertion
        check_separate_pools_built(pooled, "fully_async")
    stale = load_config(base(tiny_model_dir, data, tmp_path, *POOL, "async_training.staleness_threshold=0.5"), env={})
    with pytest.raises(ConfigError, match=r"async_training.staleness_threshold=0.5.*reads no `async_training"):
        check_separate_pools_built(stale, "one_step_off")
    remax = load_config(base(tiny_model_dir, data, tmp_path, *POOL, "algorithm.adv_estimator=remax"), env={})
    with pytest.raises(ConfigError, match="greedy baseline"):
        check_separate_pools_built(remax, "one_step_off")
    # verl's only mode: the pool's engines run in-process, every row through its agent loop
    server = load_config(base(tiny_model_dir, data, tmp_path, *POOL, "actor_rollout_ref.rollout.mode=async"), env={})
    check_separate_pools_built(server, "one_step_off")


# ---------------------------------------------------------------------------- on two Ray nodes


def run_cfg(model: Path, data: Path, run: Path, *extra: str) -> Any:
    return load_config(base(model, data, run, *POOL, "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                            "trainer.device=cpu", "trainer.total_training_steps=3",
                            f"trainer.rollout_data_dir={run / 'rollouts'}", *extra), env={})


def test_one_step_off_on_its_own_pool_syncs_exact_weights_and_a_stop_resumes_on_the_batch_in_flight(
        two_nodes: Any, tiny_model_dir: Path, toy: Path, tmp_path: Path) -> None:  # noqa: F811
    import ray

    from trainer.async_rl.one_step_off import OneStepOffDriver
    from trainer.data import PromptLoader
    from trainer.exit_codes import REQUEUE_EXIT_CODE
    from trainer.stop import STOP_FILE

    # a stop asked while step 2 trains and batch 3 is generated
    StoppedAfterStep2 = stopped_after(OneStepOffDriver, 2)
    run = tmp_path / "run"
    driver = StoppedAfterStep2(run_cfg(tiny_model_dir, toy, run, "trainer.test_freq=2"))
    try:
        assert driver.fit() == REQUEUE_EXIT_CODE
        # where the ranks are: the pools on nodes of their own, each rank its own GPU
        layout = json.loads((run / "workers.json").read_text())
        trainer_nodes = {n["ray_node"] for n in layout["actor_rollout_ref"]}
        pool_nodes = {n["ray_node"] for n in layout["rollout"]}
        assert len(trainer_nodes) == 1 and len(pool_nodes) == 1 and trainer_nodes != pool_nodes, layout
        assert sorted(n["gpu"]["CUDA_VISIBLE_DEVICES"] for n in layout["actor_rollout_ref"]) == ["0", "1"]
        assert [n["gpu"]["CUDA_VISIBLE_DEVICES"] for n in layout["rollout"]] == ["0"]
        # the first batch with the weights it trains, the next one step behind
        rows = read_jsonl(run / "metrics.jsonl")
        assert [r["one_step_off/lag"] for r in rows] == [0, 1]
        assert [r["one_step_off/weight_version"] for r in rows] == [0, 0]
        assert rows[-1]["one_step_off/staleness/0"] == 1 and rows[-1]["one_step_off/staleness/1"] == 1
        assert rows[1]["timing_s/generate_async"] > 0 and "timing_s/sync_rollout_weights" in rows[1]
        assert rows[1]["dp/rank_0/rollout_pool/weight_sync_gb"] > 0  # and its rate, logged at every sync
        assert rows[1]["dp/rank_0/rollout_pool/weight_sync_gb_per_s"] > 0
        assert rows[1]["dp/rank_0/rollout_pool/broadcast_wait_s"] >= 0  # the default: the collective broadcast
        # validated on the pool at step 2, batch 3 in flight
        assert any(k.startswith("val-core/") for k in rows[1]) and "timing_s/testing" in rows[1], sorted(rows[1])
        # step 1's batch came from the trainer's own weights: the pool's log-probs are the actor's
        assert rows[0]["training/rollout_probs_diff_max"] < 1e-4, rows[0]
        assert rows[1]["training/rollout_probs_diff_max"] > 1e-4, "the update changed nothing: no lag to see"
        # the pool holds the weights of the last sync (version 1); the trainer has trained step 2
        actor_digest = driver.actor_group.run("weights_digest")[0]
        pool = driver.stages.pool
        assert pool is not None
        before = pool.run("weights_digest")[0]
        assert actor_digest.keys() == before.keys()
        assert max(abs(before[k] - v) / max(v, 1e-12) for k, v in actor_digest.items()) > 1e-6
        driver.stages.sync_weights(2)
        after = pool.run("weights_digest")[0]
        for name, value in actor_digest.items():
            assert math.isclose(after[name], value, rel_tol=1e-9, abs_tol=1e-9), name
        assert pool.run("loaded_version") == [2]
        # through the object store instead (`checkpoint_engine.enable=false`): the same weights
        from trainer.config.async_training import CheckpointEngineConfig
        from trainer.stages.sync import sync_pool

        noted: dict[str, Any] = {}
        sync_pool(driver.actor_group, pool, 3, noted.__setitem__, CheckpointEngineConfig(False, False, 4096))
        assert pool.run("weights_digest")[0] == after and pool.run("loaded_version") == [3]
        assert "rollout_pool/broadcast_wait_s" not in noted and noted["rollout_pool/weight_sync_gb"][0] > 0
    finally:
        ray.shutdown()

    # the checkpoint of step 2 was taken while batch 3 was in flight: the resumed run generates
    # that same batch (the data order's third), with the checkpoint's weights
    assert not (run / STOP_FILE).exists()
    resumed = OneStepOffDriver(run_cfg(tiny_model_dir, toy, run))
    try:
        assert resumed.fit() == 0
        order = PromptLoader(resumed.train_set, 8, shuffle=True, seed=resumed.cfg.data.seed)
        third = [order.next_batch() for _ in range(3)][-1]
        expected = sorted(resumed.tokenizer.decode(e.prompt_ids, skip_special_tokens=True) for e in third)
    finally:
        ray.shutdown()
    trained = sorted({json.loads(r)["input"] for r in (run / "rollouts" / "3.jsonl").read_text().splitlines()})
    assert trained == sorted(set(expected))
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["training/global_step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["one_step_off/lag"] == 0  # generated after the resume, with the checkpoint's weights


def test_the_entry_composes_verls_one_step_off_file_beneath_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    """As verl's `one_step_off_policy.main_ppo` composes `one_step_off_ppo_trainer.yaml`: the engine
    kept awake, the rollout's log-probs computed and used as the old ones (bypass), a pool of 1 x 8;
    the command line still wins, and a `--config-name` replaces the file."""
    from trainer.one_step_off import main

    assert main(["--print-config", "actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=4"]) == 0
    out = capsys.readouterr().out
    import yaml

    cfg = yaml.safe_load(out)
    arr = cfg["actor_rollout_ref"]
    assert (arr["rollout"]["free_cache_engine"], arr["rollout"]["calculate_log_probs"]) == (False, True)
    assert cfg["algorithm"]["rollout_correction"]["bypass_mode"] is True
    assert (cfg["rollout"]["nnodes"], cfg["rollout"]["n_gpus_per_node"]) == (1, 4)
    # the synchronous entry composes none of it
    from trainer.__main__ import main as sync_main

    assert sync_main(["--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["algorithm"]["rollout_correction"]["bypass_mode"] is False


#: verl's one-step-off scripts (FSDP2, vLLM) at the verl commit followed, as
#: `python -m trainer.one_step_off` reads them, and what still turns each away.
ONE_STEP_OFF_SCRIPTS = {
    "dapo_7b_math_fsdp2_4_12.sh": "ulysses_sequence_parallel_size=4` is not supported yet (sequence parallelism)",
    "dapo_7b_math_fsdp2_64_64.sh": "ulysses_sequence_parallel_size=4` is not supported yet (sequence parallelism)",
    "dapo_7b_math_fsdp2_64_64_ris.sh": "ulysses_sequence_parallel_size=4` is not supported yet (sequence parallelism)",
    "grpo_0.6b_gsm8k_fsdp2_2_6.sh": "tensor-parallel engines in a pool are not built",
    "grpo_3b_gsm8k_fsdp2_2_6.sh": "tensor-parallel engines in a pool are not built",
    "grpo_qwen3_8b_gsm8k_fsdp2_8_8_npu.sh": "fsdp_config.fsdp_size=8`: FSDP wrapping and sharding options",
}


def test_verls_one_step_off_scripts_are_read_as_the_entry_reads_them() -> None:
    """Each refusal names one feature; a script that comes to be accepted, or refused for another
    reason, shows here (and in `python -m tests.trainer.verl_examples check`)."""
    from tests.trainer.verl_examples import FIXTURE, one_step_off_outcome

    scripts = json.loads(FIXTURE.read_text())["one_step_off"]
    got = {Path(name).name: one_step_off_outcome(args) for name, args in scripts.items()}
    assert got.keys() == ONE_STEP_OFF_SCRIPTS.keys()
    for name, words in ONE_STEP_OFF_SCRIPTS.items():
        assert got[name].startswith("refused: ") and words in got[name], (name, got[name])
