"""verl's fully-async loop (`python -m trainer.fully_async`) on a real two-node Ray cluster on
this machine (the package's `two_nodes`: GPUs declared, the ranks computing on the CPU): the
trainer's two ranks on one node, the rollout pool's two ranks on the other, each streaming its
own prompts into the queue, with verl's default partial rollout (the responses in flight at a
sync continued under the new weights). Every trained sample within the staleness bound; each
part of a continued response with its own weights' log-probs; each prompt of the run trained
exactly once across a stop and a resume (the queue and the calls in flight dropped at the stop,
their prompts handed out again); the pool holding exactly the trainer's weights after the last sync."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.async_rl.conftest import stopped_after
from tests.trainer.async_rl.test_one_step_off import base
from tests.trainer.test_distributed import toy  # noqa: F401 (a fixture)
from trainer.config import ConfigError, load_config
from trainer.config.async_training import check_separate_pools_built
from trainer.metrics import read_jsonl

#: verl's fully-async settings (its rollouter asserts the first four), a queue of
#: int(4 x 1.5 x 2) = 12 prompts: 8 trained per step, 4 ahead, at most ceil(4 / 8) = 1 version behind.
FULLY_ASYNC = ("actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
               "data.train_batch_size=0", "data.gen_batch_size=1", "actor_rollout_ref.rollout.mode=async",
               "algorithm.rollout_correction.bypass_mode=true", "async_training.partial_rollout=false",
               "async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=2",
               "async_training.require_batches=1", "rollout.total_rollout_steps=24")


def run_cfg(model: Path, data: Path, run: Path, *extra: str) -> Any:
    return load_config(base(model, data, run, *FULLY_ASYNC, "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                            "trainer.device=cpu", f"trainer.rollout_data_dir={run / 'rollouts'}", *extra), env={})


def test_the_loop_takes_only_what_verls_rollouter_asserts_and_refuses_what_is_not_built(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    check_separate_pools_built(run_cfg(tiny_model_dir, data, tmp_path), "fully_async")
    for extra, words in ((("data.train_batch_size=8",), "train_batch_size must be zero"),
                         (("data.gen_batch_size=2",), None),  # refused when the config is read
                         (("actor_rollout_ref.rollout.mode=sync",), "asserts `mode=async`"),
                         (("actor_rollout_ref.rollout.calculate_log_probs=false", "async_training.trigger_parameter_sync_step=1",
                           "algorithm.rollout_correction.bypass_mode=false"), "must rollout calculate"),
                         (("async_training.partial_rollout=true", "actor_rollout_ref.rollout.multi_turn.enable=true"),
                          "multi_turn.enable=true` is not built"),
                         (("algorithm.rollout_correction.bypass_mode=false",), "first update"),
                         (("async_training.compute_prox_log_prob=true",), "not built"),
                         (("trainer.total_training_steps=5",), "set `rollout.total_rollout_steps`")):
        with pytest.raises(ConfigError, match=words):
            check_separate_pools_built(run_cfg(tiny_model_dir, data, tmp_path, *extra), "fully_async")
    check_separate_pools_built(run_cfg(tiny_model_dir, data, tmp_path, "async_training.partial_rollout=true"),
                               "fully_async")  # verl's default, on the HF engine
    check_separate_pools_built(run_cfg(tiny_model_dir, data, tmp_path, "async_training.partial_rollout=true",
                                       "actor_rollout_ref.rollout.name=vllm"), "fully_async")  # and on vLLM
    # bypass off with a sync after every update: the old log-probs recomputed, as verl does then
    check_separate_pools_built(run_cfg(tiny_model_dir, data, tmp_path, "algorithm.rollout_correction.bypass_mode=false",
                                       "async_training.trigger_parameter_sync_step=1"), "fully_async")


def test_the_entry_composes_verls_fully_async_file_beneath_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from trainer.fully_async import main

    assert main(["--print-config", "actor_rollout_ref.hybrid_engine=false", "rollout.total_rollout_steps=7"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert (rollout["mode"], rollout["calculate_log_probs"]) == ("async", True)
    assert (cfg["data"]["gen_batch_size"], cfg["rollout"]["nnodes"], cfg["rollout"]["n_gpus_per_node"]) == (1, 1, 8)
    assert cfg["rollout"]["total_rollout_steps"] == 7 and cfg["algorithm"]["rollout_correction"]["bypass_mode"]
    assert cfg["async_training"]["trigger_parameter_sync_step"] == 4  # verl's, this trainer's default too


def mid_generation(driver_class: Any) -> Any:
    """`driver_class` whose every weight sync waits until a pool rank has begun a call (while the
    rollouter has work to hand out), so that the sync lands early in that call, mid-generation;
    it keeps the actor's weights of every version (`versions`), every sample finished (`finished`)
    and every sample it trains (`trained`)."""
    import ray

    class MidGeneration(driver_class):  # type: ignore[misc, valid-type]
        versions: dict[int, dict[str, Any]]
        finished: list[Any]
        trained: list[Any]

        def _weights(self) -> dict[str, Any]:
            refs = self.actor_group.run("export_weights")[0]
            return {name: t.clone() for ref in refs for name, t in ray.get(ref)}

        def _start_rollouter(self) -> Any:
            self.versions, self.finished, self.trained = {self.global_step - 1: self._weights()}, [], []
            rollouter = super()._start_rollouter()
            check, paused, finish = rollouter.check, rollouter.paused, rollouter.queue.finish

            def finished(*args: Any) -> Any:
                sample = finish(*args)
                self.finished.append(sample)
                return sample

            def recorded(samples: list[Any]) -> None:
                check(samples)
                self.trained.extend(samples)

            def mid(why: str, abort: bool = False) -> Any:
                if abort:
                    self.versions[rollouter.queue.version + 1] = self._weights()
                    with rollouter.cond:  # a call begun since, or none can begin
                        calls = rollouter.calls
                        assert rollouter.cond.wait_for(lambda: (rollouter.calls > calls and any(rollouter.busy))
                                                       or not rollouter._may_hand_out(), timeout=300)
                return paused(why, abort)

            rollouter.check, rollouter.paused, rollouter.queue.finish = recorded, mid, finished
            return rollouter

    return MidGeneration


def test_fully_async_streams_within_the_bound_continues_responses_across_a_sync_and_a_stop_trains_every_prompt_once(
        two_nodes: Any, tiny_model_dir: Path, toy: Path, tmp_path: Path) -> None:  # noqa: F811
    """verl's default `async_training.partial_rollout=true`, the syncs made to land mid-generation
    (long responses): the responses in flight are aborted and continued under the new weights,
    each part's rollout log-probs those its own version's weights give for its tokens, no
    response past its budget, every sample within the bound; then a stop (what is queued, in
    flight or paused mid-response is dropped) and a resume that trains every prompt of the run once."""
    import ray
    import torch

    from trainer import models
    from trainer.async_rl.fully_async import FullyAsyncDriver
    from trainer.data import PromptLoader
    from trainer.exit_codes import REQUEUE_EXIT_CODE

    budget = 96
    # 8 prompts trained and 16 ahead per sync, so the rollouter may hand out every prompt of the run
    # at once: it is generating at a sync until it has generated them all (at most 2 versions
    # behind); calls of 2 prompts
    partial = ("async_training.partial_rollout=true", f"data.max_response_length={budget}",
               "async_training.staleness_threshold=2", "async_training.concurrent_samples_per_replica=2")
    run = tmp_path / "run"
    driver = stopped_after(mid_generation(FullyAsyncDriver), 2)(run_cfg(tiny_model_dir, toy, run, "trainer.test_freq=2",
                                                                         *partial))
    try:
        assert driver.total_steps == 3  # int(24 prompts / (4 per update x 2 updates per sync))
        assert driver.fit() == REQUEUE_EXIT_CODE
        layout = json.loads((run / "workers.json").read_text())
        assert len(layout["rollout"]) == 2
        assert {n["ray_node"] for n in layout["rollout"]}.isdisjoint({n["ray_node"] for n in layout["actor_rollout_ref"]})
        rows = read_jsonl(run / "metrics.jsonl")
        assert [r["training/updates"] for r in rows] == [2, 4]
        assert [r["fully_async/count/current_param_version"] for r in rows] == [1, 2]
        assert any(k.startswith("val-core/") for k in rows[1])  # validated on the pool, the rollouter paused
        for r in rows:
            assert r["fully_async/static/max_required_samples"] == 24 and r["fully_async/static/max_staleness"] == 2
            assert r["fully_async/lag/max"] <= 2 and r["timing_s/param_sync"] > 0
            # the sync's size and rate, per pool rank: the tiny model's fp32 weights each time
            assert r["dp/rank_0/rollout_pool/weight_sync_gb"] == r["dp/rank_1/rollout_pool/weight_sync_gb"] > 0
            assert r["dp/rank_0/rollout_pool/weight_sync_gb_per_s"] > 0
            assert 0 <= r["fully_async/rollouter/idle_ratio"] <= 1 and r["timing_s/gen"] >= 0
        # both pool ranks generated: the stream is each rank's own (counted over the run: at a load of 40
        # a rank's call outlasted a whole step, which then logged the other rank's rows alone)
        assert all(sum(r.get(f"rollout_pool/rank_{k}/gen_rows", 0) for r in rows) > 0 for k in (0, 1)), rows
        # the rollouter ran ahead: samples of the steps before were trained, none further behind
        histogram = {int(k.rsplit("/", 1)[1]): v for k, v in rows[-1].items()
                     if k.startswith("fully_async/staleness/")}
        assert set(histogram) <= {0, 1, 2} and sum(histogram.values()) == 16, histogram
        # responses paused at a sync and continued after it
        assert any(s.first_version < s.version for s in driver.finished), "no sync landed mid-generation"
        assert {s.prompt_id for s in driver.trained} <= {s.prompt_id for s in driver.finished}
        model, checked = models.load_actor(tiny_model_dir), 0
        for s in driver.finished:
            b = s.payload
            assert b.aborted is None and int(b.response_mask.sum(-1).max()) <= budget
            for row, parts in enumerate(s.parts):
                assert sum(n for _, n in parts) == int(b.response_mask[row].sum())
                assert parts[0][0] == s.first_version and parts[-1][0] <= s.version
                offset = 0
                for version, n in parts:  # each part against its own version's weights
                    model.load_state_dict(driver.versions[version])
                    with torch.no_grad():
                        expected, _ = models.compute_log_probs(model, b.input_ids[row:row + 1],
                                                               b.attention_mask[row:row + 1], b.response_length)
                    got = b.rollout_log_probs[row, offset:offset + n]
                    assert torch.allclose(got, expected[0, offset:offset + n], atol=1e-4), (s.prompt_id, row, version)
                    offset, checked = offset + n, checked + int(n > 0 and len(parts) > 1)
        assert checked > 0
    finally:
        ray.shutdown()

    resumed = FullyAsyncDriver(run_cfg(tiny_model_dir, toy, run, *partial))
    try:
        assert resumed.fit() == 0
        # the last sync gave the pool exactly the trainer's weights, as version 3
        actor = resumed.actor_group.run("weights_digest")[0]
        pool = resumed.stages.pool
        assert pool is not None and pool.run("loaded_version") == [3, 3]
        for digest in pool.run("weights_digest"):
            for name, value in actor.items():
                assert math.isclose(digest[name], value, rel_tol=1e-9, abs_tol=1e-9), name
        order = PromptLoader(resumed.train_set, 1, shuffle=True, seed=resumed.cfg.data.seed)
        first_24 = Counter(resumed.tokenizer.decode(order.example_at(p).prompt_ids, skip_special_tokens=True)
                           for p in range(24))
    finally:
        ray.shutdown()
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["training/global_step"] for r in rows] == [1, 2, 3] and rows[-1]["training/updates"] == 6
    # every prompt of the run trained once (its n=2 rows), across the stop: the six updates'
    # dumps hold exactly the run's 24 prompts (those paused mid-response at the stop among them)
    trained: Counter[str] = Counter()
    for update in range(1, 7):
        lines = (run / "rollouts" / f"{update}.jsonl").read_text().splitlines()
        assert len(lines) == 8, update  # 4 prompts x 2 responses
        trained.update(json.loads(line)["input"] for line in lines)
    assert trained == Counter({text: 2 * k for text, k in first_24.items()})
