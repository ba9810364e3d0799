"""Distributed PPO on the Slurm lab, driven by the node agent: `hpcrl submit --via sbatch -- <trainer
overrides>` trains the tiny model across the 3 nodes (one rank per node, in Podman), every node
generates and trains (per-rank metrics, `workers.json`), reward rises, a checkpoint is written,
and a rerun on 2 bare nodes resumes from it, its reward from a discriminative reward model
(`reward_model.enable=true`, a tiny sequence classifier colocated on the actor's ranks) in place of
the rule; then verl's one-step-off recipe
(`hpcrl submit --loop one-step-off`) resumes it once more on 2 nodes, the trainer on one and
the rollout pool on the other, each batch generated one step ahead; last, verl's fully-async
recipe (`hpcrl submit --loop fully-async`) runs 5 steps of its own on 2 nodes, the rollouter
streaming from the pool's node, requeued from outside after step 2 (every prompt trained once)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from hpcrl.slurm_env import expand_hostlist
from tests.conftest import run_hpcrl
from tests.lab.test_agent import finished, run_logs
from tests.lab.test_requeue import wait_for_step
from trainer.checkpoint import full_state as ckpt
from trainer.metrics import read_jsonl

pytestmark = [pytest.mark.lab, pytest.mark.slow]

#: A rollout pool of one rank on a node of its own (verl's `hybrid_engine=False`).
POOL = ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.calculate_log_probs=true"]


def write_sites(sites: Path, shared: Path) -> None:
    """Test profiles extending the lab's: Podman with `shared` bound in, and bare."""
    from tests.lab.cluster import LAB_LABEL

    binds = ["${sys:prefix}", "${sys:base_prefix}", "${sys:source_root}", str(shared)]
    flags = ["--label", LAB_LABEL]
    sites.mkdir(parents=True, exist_ok=True)
    run_root = shared / "runs"
    (sites / "lab-ppo-podman.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\nslurm:\n  time: '00:15:00'\n"
        f"container:\n  binds: {json.dumps(binds)}\n  extra_flags: {json.dumps(flags)}\n")
    (sites / "lab-ppo-bare.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\nslurm:\n  time: '00:15:00'\ncontainer:\n  runtime: none\n")


def trainer_overrides(shared: Path, nnodes: int, steps: int) -> list[str]:
    data, model, out = shared / "data", shared / "model", shared / "ppo"
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-3", "algorithm.adv_estimator=grpo", "data.train_batch_size=24",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
        "trainer.val_before_train=false", "trainer.logger=[console,jsonl]", "trainer.seed=7",
        f"trainer.default_local_dir={out}", f"trainer.run_dir={out}",
        f"trainer.nnodes={nnodes}", "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=8",
    ]


def submit_ppo(lab, sites: Path, site: str, run_dir: Path, nodes: int, overrides: list[str],
               *flags: str) -> int:
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    proc = run_hpcrl(["submit", "--site", site, "--via", "sbatch", "--run-dir", str(run_dir),
                      "--nodes", str(nodes), *flags, "--", *overrides], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split("job id: ")[1].split()[0])


def payload_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("payload.log"))


def check_ranks(shared: Path, rows: list[dict], nodes: list[str], container: str) -> None:
    workers = json.loads((shared / "ppo" / "workers.json").read_text())["actor_rollout_ref"]
    assert sorted(w["hostname"] for w in workers) == nodes, workers
    assert {w["container"] for w in workers} == {container}, workers
    for row in rows:
        for rank in range(len(nodes)):
            for key in ("gen_rows", "gen_tokens", "update_actor_tokens", "old_log_prob_s"):
                assert row[f"dp/rank_{rank}/{key}"] > 0, (rank, key, row)
        assert f"dp/rank_{len(nodes)}/gen_rows" not in row


def trained_prompts(shared: Path, updates: int) -> Counter[str]:
    """The prompts of updates 1..`updates` (`trainer.rollout_data_dir`), each row counted."""
    out: Counter[str] = Counter()
    for update in range(1, updates + 1):
        out.update(json.loads(line)["input"] for line in (shared / "fa" / "rollouts" / f"{update}.jsonl").open())
    return out


def expected_prompts(shared: Path, count: int, n: int) -> Counter[str]:
    """The run's first `count` prompts in its data order, each `n` times."""
    from trainer import models as M
    from trainer.data import PromptDataset, PromptLoader

    tokenizer = M.load_tokenizer(str(shared / "model"))
    loader = PromptLoader(PromptDataset([shared / "data" / "train.parquet"], tokenizer, max_prompt_length=16),
                          1, shuffle=True, seed=1)
    texts = Counter(tokenizer.decode(loader.example_at(p).prompt_ids, skip_special_tokens=True) for p in range(count))
    return Counter({text: k * n for text, k in texts.items()})


def check_reward_model_scored(shared: Path, row: dict) -> None:
    """The step's reward came from the reward model: the dumped rows (`trainer.rollout_data_dir`)
    carry scores the rule would not give their responses, and the step's score metric is their mean."""
    from trainer.rewards.toy import toy_digits_score

    step = row["step"]
    dumped = [json.loads(line) for line in (shared / "dump" / f"{step}.jsonl").read_text().splitlines()]
    assert len(dumped) == 24 * 8, len(dumped)
    scores = [d["score"] for d in dumped]
    assert row["critic/score/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5), (row, scores[:8])
    by_rule = [toy_digits_score(d["output"]) for d in dumped]
    differ = sum(abs(s - r) > 1e-4 for s, r in zip(scores, by_rule, strict=True))
    assert differ > len(scores) // 2, (differ, scores[:8], by_rule[:8])
    assert len(set(scores)) > 1, scores[:8]  # a score per response, not one constant


def submit_fully_async(lab, sites: Path, shared: Path, site: str = "lab-ppo-bare", save_freq: int = -1
                       ) -> tuple[Path, int]:
    """Fully async on two nodes, a run of its own: the rollouter streams from the pool's node into
    the queue, 12 prompts per update, a sync after each, 6 prompts ahead at most; the test requeues
    it from outside (`scontrol requeue`) after its second step, the queue and the calls in flight
    dropped (the node-failure scenario kills the pool's node instead, on a site of its own,
    checkpointing every `save_freq` steps)."""
    run_fa = shared / "runs" / "fully-async"
    streamed = [*POOL, "data.train_batch_size=0", "data.gen_batch_size=1", "actor_rollout_ref.rollout.mode=async",
                "async_training.partial_rollout=false", "async_training.trigger_parameter_sync_step=1",
                "async_training.staleness_threshold=0.5", "rollout.total_rollout_steps=60",
                f"trainer.save_freq={save_freq}",
                f"trainer.default_local_dir={shared / 'fa'}", f"trainer.run_dir={shared / 'fa'}",
                f"trainer.rollout_data_dir={shared / 'fa' / 'rollouts'}"]
    return run_fa, submit_ppo(lab, sites, site, run_fa, 2,
                              [*trainer_overrides(shared, 1, 3)[:-2], *streamed], "--loop", "fully-async")


def test_ppo_on_three_nodes_then_resume_on_two(lab_manager, lab_images, tmp_path: Path) -> None:
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny, save_tiny_rm

    shared, sites = tmp_path / "shared", tmp_path / "sites"
    save_tiny(shared / "model", seed=0)
    save_tiny_rm(shared / "rm")
    write_toy_digits(shared / "data", train_size=512, val_size=16, seed=0)
    write_sites(sites, shared)
    # five nodes: the fully-async run (2 nodes, a run of its own) goes beside the 3-node run
    lab = lab_manager.get(nodes=5)

    run3 = shared / "runs" / "three"
    job = submit_ppo(lab, sites, "lab-ppo-podman", run3, 3, trainer_overrides(shared, 3, 16))
    run_fa, fa_job = submit_fully_async(lab, sites, shared)
    wait_for_step(lab, fa_job, run_fa, 0, 2, timeout=600)
    lab.run("scontrol", "requeue", str(fa_job))
    rec = finished(lab, job, run3, timeout=900)
    assert rec["JobState"] == "COMPLETED", (rec, run_logs(run3), payload_log(run3)[-4000:])
    rows = read_jsonl(shared / "ppo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    check_ranks(shared, rows, ["node1", "node2", "node3"], "podman")
    score = [r["critic/score/mean"] for r in rows]
    assert sum(score[-3:]) / 3 > sum(score[:3]) / 3 + 0.3, score
    saved = ckpt.find_latest_checkpoint(shared / "ppo")
    assert saved == shared / "ppo" / "global_step_16"
    assert ckpt.load_state(saved, "trainer_state")["world_size"] == 3

    run2 = shared / "runs" / "two"
    rm = ["reward_model.enable=true", f"reward_model.model.path={shared / 'rm'}",
          f"trainer.rollout_data_dir={shared / 'dump'}"]
    job = submit_ppo(lab, sites, "lab-ppo-bare", run2, 2, [*trainer_overrides(shared, 2, 18), *rm])
    rec = finished(lab, job, run2, timeout=900)
    log = payload_log(run2)
    assert rec["JobState"] == "COMPLETED", (rec, run_logs(run2), log[-4000:])
    assert "resumed" in log and "(saved on 3 rank(s)) on 2 rank(s)" in log, log[-4000:]
    rows = read_jsonl(shared / "ppo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 19))
    check_ranks(shared, rows[-2:], expand_hostlist(rec["NodeList"]), "none")
    for row in rows[-2:]:
        check_reward_model_scored(shared, row)
    assert ckpt.find_latest_checkpoint(shared / "ppo") == shared / "ppo" / "global_step_18"

    # one-step-off on two nodes: the trainer's rank on one, the rollout pool's on the other
    run_off = shared / "runs" / "one-step-off"
    job = submit_ppo(lab, sites, "lab-ppo-bare", run_off, 2, [*trainer_overrides(shared, 1, 21), *POOL],
                     "--loop", "one-step-off")
    rec = finished(lab, job, run_off, timeout=900)
    off_log = payload_log(run_off)
    assert rec["JobState"] == "COMPLETED", (rec, run_logs(run_off), off_log[-4000:])
    assert json.loads((run_off / "job.json").read_text())["payload"][1:3] == ["-m", "trainer.one_step_off"]
    assert "(saved on 2 rank(s)) on 1 rank(s)" in off_log, off_log[-4000:]
    layout = json.loads((shared / "ppo" / "workers.json").read_text())
    (trainer_node,), (pool_node,) = ({w["hostname"] for w in layout[g]} for g in ("actor_rollout_ref", "rollout"))
    assert trainer_node != pool_node and {trainer_node, pool_node} == set(expand_hostlist(rec["NodeList"])), layout
    rows = read_jsonl(shared / "ppo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 22))
    # the first batch after the resume is generated with the checkpoint's weights, then one step behind
    assert [r["one_step_off/lag"] for r in rows[-3:]] == [0, 1, 1], rows[-3:]
    assert [r["one_step_off/weight_version"] for r in rows[-3:]] == [18, 18, 19]
    assert all(r["rollout_pool/rank_0/gen_rows"] == 24 for r in rows[-3:])

    # the fully-async run, requeued after its second step while the first run trained
    rec = finished(lab, fa_job, run_fa, timeout=900)
    fa_log = payload_log(run_fa)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, run_logs(run_fa), fa_log[-4000:])
    assert json.loads((run_fa / "job.json").read_text())["payload"][1:3] == ["-m", "trainer.fully_async"]
    layout = json.loads((shared / "fa" / "workers.json").read_text())
    (trainer_node,), (pool_node,) = ({w["hostname"] for w in layout[g]} for g in ("actor_rollout_ref", "rollout"))
    assert trainer_node != pool_node, layout
    rows = read_jsonl(shared / "fa" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # int(60 prompts / 12 per step)
    assert all(r["fully_async/lag/max"] <= 1 and r["rollout_pool/rank_0/gen_rows"] > 0 for r in rows), rows
    # every prompt of the run trained exactly once across the requeue: the five updates' dumps
    # hold the run's 60 prompts, each with its 8 responses
    assert trained_prompts(shared, 5) == expected_prompts(shared, 60, 8)
    print(f"python: {sys.executable}; checkpoint timings:\n" + "\n".join(
        line for line in (payload_log(run3) + log + off_log + fa_log).splitlines()
        if "saved" in line or "resumed" in line))
