"""Placement on the lab as on 2 nodes of 4 GPUs: the lab's CPU nodes declare 4 GPUs each to Ray
(profile `ray.num_gpus: 4`), and Ray then hands out GPU ids and sets `CUDA_VISIBLE_DEVICES` per
worker exactly as on a GPU node. A GRPO job (rollout tensor-parallel size 2) and a GAE job (with
the critic) through `hpcrl submit` give every process one distinct (node, GPU id), keep each
tensor-parallel group on one node, host the critic in its rank's process, and each rank uses the
device index that matches Ray's id: with Ray setting the list per worker, and with
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1` leaving the node's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lab.test_agent import finished, run_logs
from tests.lab.test_distributed import payload_log, submit_ppo
from trainer.metrics import read_jsonl

pytestmark = [pytest.mark.lab, pytest.mark.slow]

NODES, PER_NODE = 2, 4


def write_site(sites: Path, shared: Path, name: str, env: dict[str, str]) -> None:
    sites.mkdir(parents=True, exist_ok=True)
    (sites / f"{name}.yaml").write_text(
        f"extends: slurmlab\nrun_root: {shared / 'runs'}\nslurm:\n  time: '00:15:00'\n"
        f"container:\n  runtime: none\nray:\n  num_gpus: {PER_NODE}\nenv: {json.dumps(env)}\n")


def overrides(shared: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"data.train_files={shared / 'data' / 'train.parquet'}", f"data.val_files={shared / 'data' / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", f"actor_rollout_ref.model.path={shared / 'model'}",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.val_before_train=false", "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out}", f"trainer.run_dir={out}", "trainer.save_freq=-1",
        f"trainer.nnodes={NODES}", f"trainer.n_gpus_per_node={PER_NODE}", "trainer.total_training_steps=1",
        # the declared GPUs do not exist: the workers train on the CPU on purpose (without this a
        # worker granted a GPU that torch cannot see refuses to start)
        "trainer.device=cpu", "critic.ppo_micro_batch_size_per_gpu=4",
        *extra,
    ]


def check_placement(out: Path, roles: list[str], tp: int, noset: bool) -> None:
    workers = json.loads((out / "workers.json").read_text())
    assert sorted(workers) == sorted(roles), workers
    ranks = workers["actor_rollout_ref"]
    assert [w["rank"] for w in ranks] == list(range(NODES * PER_NODE))
    # one process per rank, each with its own GPU: distinct (node, Ray GPU id), 4 per node
    assert len({w["pid"] for w in ranks}) == len(ranks), ranks
    places = [(w["hostname"], w["gpu"]["ray_id"]) for w in ranks]
    assert len(set(places)) == len(places), places
    hosts = sorted({h for h, _ in places})
    assert len(hosts) == NODES and all(sorted(g for h, g in places if h == host) == ["0", "1", "2", "3"]
                                       for host in hosts), places
    # rank r on node r // 4: the ranks of a tensor-parallel engine share a node
    for start in range(0, len(ranks), tp):
        assert len({w["hostname"] for w in ranks[start:start + tp]}) == 1, ranks[start:start + tp]
    assert len({w["hostname"] for w in ranks[:PER_NODE]}) == 1
    # the device each rank chose is Ray's id: its own list (index 0), or its place in the node's
    for w in ranks:
        gpu = w["gpu"]
        if noset:
            assert gpu["index"] == int(gpu["ray_id"]) and gpu["LOCAL_RANK"] == gpu["ray_id"], w
            assert gpu["CUDA_VISIBLE_DEVICES"] is None, w
        else:
            assert gpu["index"] == 0 and gpu["LOCAL_RANK"] == "0", w
            assert gpu["CUDA_VISIBLE_DEVICES"] == gpu["HIP_VISIBLE_DEVICES"] == gpu["ray_id"], w
    # the critic lives in its rank's process (colocated), never on a GPU of its own share
    for role in roles:
        assert [(w["pid"], w["gpu"]) for w in workers[role]] == [(w["pid"], w["gpu"]) for w in ranks], role


@pytest.mark.parametrize("estimator, tp, noset", [("grpo", 2, False), ("gae", 1, True)])
def test_one_process_per_gpu_on_two_nodes_of_four(lab, tmp_path: Path, estimator: str, tp: int,
                                                  noset: bool) -> None:
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    shared, sites = tmp_path / "shared", tmp_path / "sites"
    save_tiny(shared / "model", seed=0)
    write_toy_digits(shared / "data", train_size=64, val_size=8, seed=0)
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if noset else {}
    write_site(sites, shared, "lab-gpus", env)
    out, run = shared / "ppo", shared / "runs" / estimator
    job = submit_ppo(lab, sites, "lab-gpus", run, NODES, overrides(
        shared, out, f"algorithm.adv_estimator={estimator}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"))
    rec = finished(lab, job, run, timeout=900)
    assert rec["JobState"] == "COMPLETED", (rec, run_logs(run), payload_log(run)[-4000:])
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    for rank in range(NODES * PER_NODE):
        assert rows[0][f"dp/rank_{rank}/update_actor_tokens"] > 0, rank
    roles = ["actor_rollout_ref", "critic"] if estimator == "gae" else ["actor_rollout_ref"]
    check_placement(out, roles, tp, noset)
