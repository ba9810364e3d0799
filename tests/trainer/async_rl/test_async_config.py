"""verl's asynchronous keys: `async_training.*`, the top-level `rollout.*` pool,
`actor_rollout_ref.hybrid_engine=false`, `data.gen_batch_size`; verl 0.9.1's own async entry
configs (kept in `tests/data/verl_config/async_0.9.1/`, copied unchanged from
`verl/experimental/{fully_async_policy,one_step_off_policy}/config/`), and the refusals made
before any queue exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer.config import ConfigError, check_run, expand_args, load_config
from trainer.config.async_training import ACT_IN_POOL_LOOPS, queue_bounds, total_rollout_steps
from trainer.config.overrides import _resolve_key

ASYNC_DIR = Path(__file__).parents[2] / "data" / "verl_config" / "async_0.9.1"
#: What verl's async shell scripts add on the command line to either config: the separate
#: deployment (both entries assert `not hybrid_engine`).
SEPARATE = ["actor_rollout_ref.hybrid_engine=false"]
#: What `python -m trainer.fully_async` asserts beyond a pool, as verl's rollouter does, and
#: `partial_rollout` off (each sync waits for the calls in flight).
STREAMED = ["critic.ppo_micro_batch_size_per_gpu=4", "data.train_batch_size=0", "data.gen_batch_size=1", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.bypass_mode=true",
            "async_training.partial_rollout=false"]
def verl_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((ASYNC_DIR / f"{name}.yaml").read_text())


def file_args(name: str) -> list[str]:
    return [f"--config-path={ASYNC_DIR}", f"--config-name={name}"]


def verl_args(name: str, extra: list[str]) -> list[Any]:
    """The overrides of verl's file `name` (every key of it, its NCCL checkpoint engine included)
    and `extra`."""
    return expand_args([*file_args(name), *extra])


def test_verl_fully_async_config_loads_with_its_values() -> None:
    cfg = load_config(verl_args("fully_async_ppo_trainer", SEPARATE), env={})
    verl = verl_file("fully_async_ppo_trainer")
    for key, value in verl["async_training"].items():
        assert getattr(cfg.async_training, key) == value, key
    for key, value in verl["rollout"].items():
        assert getattr(cfg.rollout, key) == value, key
    assert (cfg.data.gen_batch_size, cfg.actor_rollout_ref.hybrid_engine) == (1, False)
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.algorithm.rollout_correction.bypass_mode is True  # the rollout's log-probs are the old ones
    assert cfg.actor_rollout_ref.actor.use_rollout_log_probs is True  # declared by verl 0.9.1, read nowhere
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"  # the pools' broadcast
    with pytest.raises(ConfigError, match=r"synchronous loop does not run. Fix: .*python -m trainer.one_step_off"):
        check_run(cfg)
    # `python -m trainer.fully_async` asserts what verl's rollouter asserts: the base file's training
    # batch (verl's scripts set `data.train_batch_size=0`), then its mode (verl's default is
    # `async`, this trainer's `sync`); then verl's `partial_rollout=true` runs on the HF engine only
    with pytest.raises(ConfigError, match="train_batch_size must be zero"):
        check_run(cfg, "fully_async")
    streamed = verl_args("fully_async_ppo_trainer", [*SEPARATE, "data.train_batch_size=0",
                                                             "critic.ppo_micro_batch_size_per_gpu=4"])
    with pytest.raises(ConfigError, match="asserts `mode=async`"):
        check_run(load_config(streamed, env={}), "fully_async")
    check_run(load_config([*streamed, "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.name=hf"],
                          env={}), "fully_async")
    # verl's fully-async file as it stands (vLLM, `partial_rollout=true`): the pool's in-process vLLM aborts
    check_run(load_config([*streamed, "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.name=vllm"],
                          env={}), "fully_async")
    check_run(load_config([*streamed, "actor_rollout_ref.rollout.mode=async", "async_training.partial_rollout=false"],
                          env={}), "fully_async")
    with pytest.raises(ConfigError, match=r"`data.gen_batch_size=1`.*one-step-off"):
        check_run(cfg, "one_step_off")


def test_verl_one_step_off_config_loads_with_its_values() -> None:
    # verl's own start refuses its default estimator (gae) without a critic micro-batch too
    cfg = load_config(verl_args("one_step_off_ppo_trainer", [*SEPARATE, "critic.ppo_micro_batch_size_per_gpu=4"]),
                      env={})
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 8)
    assert cfg.actor_rollout_ref.rollout.free_cache_engine is False
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    check_run(cfg, "one_step_off")  # runs as verl's file says (`python -m trainer.one_step_off`)
    with pytest.raises(ConfigError, match=r"Fix: start it with `python -m trainer.one_step_off`"):
        check_run(cfg)


def test_every_key_the_issue_names_is_a_key() -> None:
    for key in ("async_training.staleness_threshold", "async_training.trigger_parameter_sync_step",
                "async_training.require_batches", "async_training.partial_rollout",
                "async_training.use_rollout_log_probs", "async_training.compute_prox_log_prob",
                "async_training.use_trainer_do_validate", "async_training.checkpoint_engine.enable",
                "async_training.checkpoint_engine.overlap_broadcast_and_consume",
                "async_training.checkpoint_engine.device_buffer_size_M", "rollout.nnodes",
                "rollout.n_gpus_per_node", "rollout.n", "rollout.total_rollout_steps", "rollout.total_epochs",
                "rollout.test_freq", "data.gen_batch_size", "actor_rollout_ref.hybrid_engine"):
        _resolve_key(key)


def test_colocated_default_has_no_pool() -> None:
    cfg = load_config(["critic.ppo_micro_batch_size_per_gpu=4"], env={})
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, cfg.actor_rollout_ref.hybrid_engine) == (0, 0, True)
    check_run(cfg)  # the start's checks pass: no pool, nothing refused


def test_hybrid_engine_false_without_a_rollout_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"the rollout pool is empty .*Fix: give the pool its nodes"):
        load_config(SEPARATE, env={})
    with pytest.raises(ConfigError, match=r"the rollout pool is empty \(`rollout.nnodes=1` x `rollout.n_gpus_per_node=0`\)"):
        load_config([*SEPARATE, "rollout.nnodes=1"], env={})


def test_a_rollout_pool_without_hybrid_engine_false_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"Fix: add `actor_rollout_ref.hybrid_engine=false`"):
        load_config(["rollout.nnodes=1", "rollout.n_gpus_per_node=8"], env={})


@pytest.mark.parametrize("key", [*ACT_IN_POOL_LOOPS, "async_training.staleness_threshold",
                                 "async_training.trigger_parameter_sync_step"])
def test_async_keys_with_the_colocated_trainer_are_refused(key: str) -> None:
    default = load_config([], env={})
    value: Any = default
    for part in key.split("."):
        value = getattr(value, part)
    other = (not value) if isinstance(value, bool) else value + 1
    with pytest.raises(ConfigError, match=rf"`{key}={other}` sets verl's asynchronous training.*Fix:"):
        load_config([f"{key}={str(other).lower()}"], env={})
    pooled = load_config([f"{key}={str(other).lower()}", *SEPARATE, "rollout.nnodes=1",
                          "rollout.n_gpus_per_node=8"], env={})
    # accepted in a pool config, and never ignored: one-step-off reads none of them; the fully-async
    # loop reads them, or refuses a value it does not honour
    with pytest.raises(ConfigError, match=rf"`{key}=.*verl's one-step-off reads no `async_training"):
        check_run(pooled, "one_step_off")
    streamed = load_config([*SEPARATE, "rollout.nnodes=1", "rollout.n_gpus_per_node=8", *STREAMED,
                            f"{key}={str(other).lower()}"], env={})
    if key in ("async_training.compute_prox_log_prob", "async_training.use_trainer_do_validate"):
        with pytest.raises(ConfigError, match=rf"`{key}=true` is not built"):
            check_run(streamed, "fully_async")
    else:
        check_run(streamed, "fully_async")


def test_verl_asserts_on_the_async_keys() -> None:
    pool = [*SEPARATE, "rollout.nnodes=1", "rollout.n_gpus_per_node=8"]
    with pytest.raises(ConfigError, match="staleness_threshold=-0.1` must be 0 or more"):
        load_config([*pool, "async_training.staleness_threshold=-0.1"], env={})
    with pytest.raises(ConfigError, match="trigger_parameter_sync_step=0` must be at least 1"):
        load_config([*pool, "async_training.trigger_parameter_sync_step=0"], env={})
    with pytest.raises(ConfigError, match="require_batches=0` must be at least 1"):
        load_config([*pool, "async_training.require_batches=0"], env={})
    with pytest.raises(ConfigError, match="`async_training.use_dynamic_resource_scheduling=true`"):
        load_config([*pool, "async_training.use_dynamic_resource_scheduling=true"], env={})


def test_an_unreachable_staleness_bound_is_refused_naming_the_smallest_that_works() -> None:
    """2 prompts per update, a sync every update: int(2 x 1.1 x 1) = 2 leaves no prompt ahead;
    the smallest threshold giving one is 1/2."""
    small = [*SEPARATE, "rollout.nnodes=1", "rollout.n_gpus_per_node=8", "data.train_batch_size=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=1"]
    with pytest.raises(ConfigError, match=r"int\(2 x \(1 \+ 0.1\) x 1\) = 2 prompts.*staleness_threshold` >= 0.5"):
        load_config(small, env={})
    assert load_config([*small, "async_training.staleness_threshold=0.5"], env={}).async_training.staleness_threshold == 0.5
    assert load_config([*small, "async_training.staleness_threshold=0"], env={}).async_training.staleness_threshold == 0


def test_pools_larger_than_the_allocation_are_refused() -> None:
    pool = [*SEPARATE, "rollout.nnodes=1", "rollout.n_gpus_per_node=4", "trainer.nnodes=1", "trainer.n_gpus_per_node=4",
            "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    with pytest.raises(ConfigError, match=r"`trainer.nnodes=1` \+ `rollout.nnodes=1` = 2 nodes, and the job has 1.*--nodes 2"):
        load_config(pool, env={"HPCRL_NUM_NODES": "1", "HPCRL_GPUS_PER_NODE": "4"})
    with pytest.raises(ConfigError, match="`rollout.n_gpus_per_node=4` is more than the 2 GPUs per node"):
        load_config(pool, env={"HPCRL_NUM_NODES": "2", "HPCRL_GPUS_PER_NODE": "2"})
    assert load_config(pool, env={"HPCRL_NUM_NODES": "2", "HPCRL_GPUS_PER_NODE": "4"}).rollout.nnodes == 1


def test_gen_batch_size() -> None:
    assert load_config([], env={}).data.gen_batch_size is None
    assert load_config(["data.gen_batch_size=1024"], env={}).data.gen_batch_size == 1024  # the training batch
    with pytest.raises(ConfigError, match=r"`data.gen_batch_size=1`.*with a rollout pool"):
        load_config(["data.gen_batch_size=1"], env={})
    with pytest.raises(ConfigError, match="`data.gen_batch_size=8`"):
        load_config(["data.gen_batch_size=8", *SEPARATE, "rollout.nnodes=1", "rollout.n_gpus_per_node=8"], env={})


def test_queue_bounds_hand_computed() -> None:
    """verl's defaults over ppo_mini_batch_size 32: required 32, int(32 x 1.1 x 4) = 140 (140.8
    truncated), 128 taken per sync, 12 ahead; 1000 prompts give int(1000 / 128) = 7 trainer steps."""
    a = load_config([], env={}).async_training
    b = queue_bounds(32, a, 1000)
    assert (b.required_samples, b.max_required_samples, b.max_queue_size, b.total_train_steps) == (32, 140, 140, 7)
    assert (b.per_sync, b.ahead) == (128, 12)


def test_standalone_memory_share_only_at_verls_default() -> None:
    key = "actor_rollout_ref.rollout.standalone_gpu_memory_utilization"
    load_config([f"{key}=null"], env={})
    with pytest.raises(ConfigError, match=rf"`{key}=0.5` is not supported yet \(a GPU memory share of the rollout pool's own"):
        load_config([f"{key}=0.5"], env={})


def test_total_rollout_steps_is_verls() -> None:
    """verl: `len(train_dataloader) * trainer.total_epochs` (one prompt per batch), capped by
    `rollout.total_rollout_steps`; 100 prompts, 3 epochs."""
    assert total_rollout_steps(load_config(["trainer.total_epochs=3"], env={}), 100) == 300
    capped = load_config(["trainer.total_epochs=3", "rollout.total_rollout_steps=250"], env={})
    assert total_rollout_steps(capped, 100) == 250
    one = load_config(["trainer.total_epochs=1", "rollout.total_rollout_steps=250"], env={})
    assert total_rollout_steps(one, 100) == 100
    with pytest.raises(ConfigError, match="`rollout.total_rollout_steps=0` must be at least 1"):
        load_config(["rollout.total_rollout_steps=0"], env={})
