"""Slow nodes named (`trainer.stragglers`): a node whose slowest rank generates more slowly per
token than `slow_factor` times the other nodes' median for `slow_steps` steps in a row is named
once; one normal step resets the count; responses of other lengths do not make a node slow; one
node alone is never compared; the per-node paces are metrics."""

from __future__ import annotations

import pytest

from trainer.stragglers import POOL_RANKS, StragglerWatch, rank_pace

NODES = [{"hostname": h} for h in ("node1", "node1", "node2", "node2", "node3", "node3")]


def step(seconds: list[float], tokens: list[float] | None = None) -> dict[str, float]:
    """A step's per-rank figures as the stages record them (the update's time: every rank waits
    for the slowest there, so it is the same on all)."""
    tokens = tokens or [100.0] * len(seconds)
    out: dict[str, float] = {}
    for rank, (s, t) in enumerate(zip(seconds, tokens, strict=True)):
        out |= {f"dp/rank_{rank}/gen_s": s, f"dp/rank_{rank}/gen_tokens": t,
                f"dp/rank_{rank}/update_actor_s": 5.0}
    return out


def test_the_pace_is_seconds_per_generated_token() -> None:
    assert rank_pace(step([2.0, 4.0], [100.0, 0.0]), 2) == [0.02, None]


def test_a_node_past_the_bound_for_enough_steps_is_named_once() -> None:
    watch = StragglerWatch(NODES, factor=2.0, steps=3)
    normal = [1.0, 1.1, 1.0, 0.9, 1.2, 1.0]
    slow = [1.0, 1.1, 1.0, 3.5, 1.2, 1.0]  # rank 3 on node2
    named = []
    for seconds in (slow, slow, normal, slow, slow, slow, slow):
        metrics, found = watch.observe(step(seconds))
        named.append([n.host for n in found])
    assert named == [[], [], [], [], [], ["node2"], []]  # the normal step reset the count; named once
    assert metrics["perf/node/node2/gen_s_per_token"] == pytest.approx(0.035)
    assert metrics["perf/node/node1/gen_s_per_token"] == pytest.approx(0.011)
    _, found = StragglerWatch(NODES, 2.0, 1).observe(step(slow))
    assert found[0].ranks == (2, 3) and found[0].others == pytest.approx(0.0115)
    assert "`--exclude=node2` in `slurm.extra_sbatch`" in found[0].summary(2.0)
    assert "--exclude-slow" in found[0].summary(2.0)


def test_longer_responses_slower_within_the_factor_and_one_node_alone_are_not_named() -> None:
    watch = StragglerWatch(NODES, factor=2.0, steps=1)
    # node2 generated four times the tokens in four times the seconds: the same pace
    assert watch.observe(step([1.0, 1.0, 4.0, 4.0, 1.0, 1.0], [100, 100, 400, 400, 100, 100]))[1] == []
    assert watch.observe(step([1.0, 1.0, 1.9, 1.9, 1.0, 1.0]))[1] == []
    alone = StragglerWatch([{"hostname": "node1"}] * 2, factor=2.0, steps=1)
    metrics, found = alone.observe(step([1.0, 9.0]))
    assert found == [] and metrics == {"perf/node/node1/gen_s_per_token": 0.09}


def test_the_keys_are_checked() -> None:
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"slow_factor=1` .* Fix:"):
        load_config(["trainer.watchdog.slow_factor=1"], env={})
    assert load_config(["trainer.watchdog.slow_steps=5"], env={}).trainer.watchdog.slow_steps == 5


def test_the_driver_names_a_slow_node_in_its_metrics_and_diagnoses_and_hpcrl_status_shows_it(tmp_path) -> None:
    """The driver's step hook (`PPODriver._note_slow_nodes`) on a step's per-rank figures."""
    from types import SimpleNamespace

    from hpcrl.runreport import run_report
    from trainer.driver import PPODriver

    # the trainer's ranks on node1-3; a rollout pool's on pool1-3, its figures in the step's metrics
    pool_nodes = [{"hostname": f"pool{i}"} for i in (1, 2, 3)]
    pool_step = {k.replace("dp/rank_", "rollout_pool/rank_"): v for k, v in step([1.0, 1.0, 4.0]).items()}
    driver = SimpleNamespace(stragglers=[StragglerWatch(NODES, 2.0, 1), StragglerWatch(pool_nodes, 2.0, 1, POOL_RANKS)],
                             run_dir=tmp_path, global_step=7,
                             stages=SimpleNamespace(rank_metrics=step([1.0, 1.1, 1.0, 3.5, 1.2, 1.0])))
    metrics: dict[str, float] = dict(pool_step)
    PPODriver._note_slow_nodes(driver, metrics)  # type: ignore[arg-type]
    assert {k for k in metrics if k.startswith("perf/")} == {f"perf/node/{h}{i}/gen_s_per_token"
                                                             for h in ("node", "pool") for i in (1, 2, 3)}
    lines = run_report(tmp_path).lines()
    assert any(line.startswith("  diagnosis (slow, ") and "node `node2` (rank(s) 2, 3) is slow" in line
               for line in lines), lines
    assert any(line.startswith("  diagnosis (slow, ") and "node `pool3` (rank(s) 2) is slow" in line
               for line in lines), lines
