"""The seeds' `main_ppo` command lines on the Slurm lab: each runs unchanged but for the
substitutions in `LAB` below (the model and data paths, and sizes scaled to two 2-CPU lab nodes
with a tiny model), through `hpcrl submit` on 2 nodes, to its checkpoint. The flagship, the AMD
Slurm script's line (verl's multinode guide: PPO with a critic, vLLM rollout with
`tensor_model_parallel_size=2`), forms one vLLM engine across the two nodes (TP=2 over gloo),
and so does the ROCm GRPO line, which names no engine and gets verl's default, vLLM.

It runs in the vLLM virtualenv (`make test`'s second stage): the lab's jobs use the Python that
runs this test, and vLLM lives in `.venv-vllm`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpcrl.runreport import read_metrics
from tests.conftest import run_hpcrl
from tests.lab import FINISHED
from tests.lab.test_agent import finished, run_logs
from tests.lab.test_requeue import redone, saved
from tests.trainer.rollout.vllm_support import require_vllm
from tests.trainer.test_config import seed_command_lines
from trainer.checkpoint import full_state as ckpt
from trainer.metrics import read_jsonl
from trainer.rollout.vllm import remove_cpu_shm

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.vllm]

#: The seed lines (blocks of tests/data/verl_seed_overrides.txt) by where they come from.
SEED_LINES = {"rocm-ppo": 0, "rocm-grpo": 1, "skypilot": 3, "dstack": 4, "amd-slurm": 5}

#: Every change made to a seed line, in one place: paths to what exists here, sizes for two
#: 2-CPU nodes with a tiny model. A key the line sets gets this value; a key it lacks is added
#: only if `ADDED` allows it (the paths and the node count, which some lines leave to verl's
#: defaults or to the shell). Nothing else of a line is touched.
LAB = {
    "data.train_files": "{data}/train.parquet",
    "data.val_files": "{data}/test.parquet",
    "actor_rollout_ref.model.path": "{model}",
    "critic.model.path": "{model}",
    "data.train_batch_size": "4",
    "data.val_batch_size": "4",
    "data.max_prompt_length": "16",
    "data.max_response_length": "8",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "2",
    "critic.ppo_micro_batch_size_per_gpu": "2",
    "trainer.n_gpus_per_node": "1",
    "trainer.nnodes": "2",
    "trainer.total_epochs": "1",
}
ADDED = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "trainer.nnodes",
         "trainer.total_epochs")


def lab_line(seed: str, data: Path, model: Path, out: Path) -> list[str]:
    words = seed_command_lines()[SEED_LINES[seed]]
    keys = [w.split("=", 1)[0] for w in words]
    line = [f"{k}={LAB[k].format(data=data, model=model)}" if k in LAB else w
            for k, w in zip(keys, words, strict=True)]
    line += [f"{k}={LAB[k].format(data=data, model=model)}" for k in ADDED if k not in keys]
    # where the run writes (hpcrl's run directory holds both by default; named here for the test)
    return [*line, f"trainer.default_local_dir={out}", f"trainer.run_dir={out}"]


def submit_seed(lab, tmp_path: Path, seed: str) -> tuple[object, Path, Path]:
    """`hpcrl submit` of the seed line on 2 lab nodes: (the finished process, run dir, output)."""
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    shared, sites = tmp_path / "shared", tmp_path / "sites"
    # positions for verl's default lengths (512 + 512), which the lines that set none keep: vLLM
    # refuses a context longer than the model's
    model = save_tiny(shared / "model", seed=0, max_position_embeddings=1024)
    data, out = shared / "data", shared / "ppo"
    write_toy_digits(data, train_size=8, val_size=4, seed=0)
    sites.mkdir()
    (sites / "lab-seed.yaml").write_text(
        f"extends: slurmlab\nrun_root: {shared / 'runs'}\nslurm:\n  time: '00:15:00'\n"
        "container:\n  runtime: none\n")
    run_dir = shared / "runs" / "seed"
    proc = run_hpcrl(["submit", "--site", "lab-seed", "--via", "sbatch", "--run-dir", str(run_dir),
                      "--nodes", "2", "--", *lab_line(seed, data, model, out)],
                     {**lab.env, "HPCRL_SITE_PATH": str(sites)})
    return proc, run_dir, out


REQUEUED = "amd-slurm"
"""The line whose job is requeued from outside after its first step (`scontrol requeue`: SIGTERM
to every process of the job, vLLM's engine processes in Ray's workers included)."""


def requeue_after_step_one(lab, job: int, run_dir: Path, out: Path) -> None:
    deadline = time.monotonic() + 600
    while not any(r["step"] >= 1 for r in read_metrics(out / "metrics.jsonl")):
        assert time.monotonic() < deadline and lab.state(job) not in FINISHED, run_logs(run_dir)
        time.sleep(0.2)
    lab.run("scontrol", "requeue", str(job))


#: The lines whose rollout is one vLLM engine across the two nodes (TP=2): the AMD Slurm line
#: names vLLM, the ROCm GRPO line gets it as verl's default `rollout.name`.
TP2 = ("amd-slurm", "rocm-grpo")


def check_seed_line(lab, seed: str, job: int, run_dir: Path, out: Path) -> None:
    """The line's job completed its two steps and its checkpoint as the line asks."""
    rec = finished(lab, job, run_dir, timeout=900)
    payload = "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("payload.log"))
    assert rec["JobState"] == "COMPLETED", (rec, run_logs(run_dir), payload[-4000:])
    if seed == REQUEUED:  # saved at the SIGTERM (the line saves nowhere else): nothing redone
        assert rec["Restarts"] == "1", rec
        assert saved(run_dir, 0) and redone(run_dir, 1) == 0, payload[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")
    before = [r for r in rows if r["step"] == 0]  # validation before training (verl's default)
    assert bool(before) == (seed in ("rocm-ppo", "rocm-grpo")), rows  # the lines keeping it
    assert all("val-core/toy_digits/reward/mean@1" in r for r in before), before
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]  # 8 prompts, batches of 4, one epoch
    for r in rows:
        if seed in TP2:  # one engine across the two nodes: both ranks answered every prompt
            assert r["dp/rank_0/gen_rows"] == r["dp/rank_1/gen_rows"] == 4, r
            assert r["dp/rank_0/gen_tokens"] == r["dp/rank_1/gen_tokens"] > 0, r  # and the same tokens
        else:  # two engines, one per node, data-parallel
            assert r["dp/rank_0/gen_rows"] == r["dp/rank_1/gen_rows"] == 2, r
        assert ("critic/vf_loss" in r) == (seed != "rocm-grpo"), r  # GRPO trains no critic
    assert ckpt.find_latest_checkpoint(out) == out / "global_step_2"


def test_every_seed_line_runs_on_two_nodes_to_its_checkpoint(lab_manager, tmp_path: Path) -> None:
    """The five lines submitted at once to a 4-node lab: Slurm runs two at a time (each on 2
    nodes), the requeued line first; each is then checked, and every line's failure is reported."""
    require_vllm()
    # the requeued line's vLLM step on 2 CPUs outlasts the lab's usual KillWait (10 s): a grace
    # that covers the step and the save, as a site's with GPU-fast steps would
    lab = lab_manager.get(nodes=4, extra={"KillWait": "120"})
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    for seed in SEED_LINES:
        assert (tp2 in lab_line(seed, tmp_path, tmp_path, tmp_path)) == (seed in TP2), seed
    jobs: dict[str, tuple[int, Path, Path]] = {}
    for seed in (REQUEUED, *(s for s in SEED_LINES if s != REQUEUED)):
        proc, run_dir, out = submit_seed(lab, tmp_path / seed, seed)
        assert proc.returncode == 0, (seed, proc.stdout + proc.stderr)
        jobs[seed] = (int(proc.stdout.split("job id: ")[1].split()[0]), run_dir, out)
    try:
        requeue_after_step_one(lab, *jobs[REQUEUED])
        failures: dict[str, str] = {}
        for seed, (job, run_dir, out) in jobs.items():
            try:
                check_seed_line(lab, seed, job, run_dir, out)
            except AssertionError as e:
                failures[seed] = str(e)[-6000:]
        assert not failures, "\n\n".join(f"seed line {s}: {m}" for s, m in failures.items())
    finally:
        remove_cpu_shm()  # the jobs' engines ended with their processes, without closing
