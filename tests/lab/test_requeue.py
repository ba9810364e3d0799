"""Checkpoint, requeue and resume on the real Slurm lab with the real trainer and the tiny model.

Time limit (Slurm's warning signal), `scontrol requeue` from outside then `scancel` and
`hpcrl submit --resume` (a new job in the same run directory, one job at a time), preemption by
the `high` partition with and without GraceTime, kill -9 in the middle of a checkpoint write, and
`max_requeues` reached. Each checks `metrics.jsonl`: every step exactly once.

Steps are slowed in chosen runs only (`tests/payloads/slow_reward.py`: a pause in the reward,
which changes no number) so that the event falls in the middle of a run and later runs are fast.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_hpcrl
from tests.lab import FINISHED

pytestmark = [pytest.mark.lab, pytest.mark.slow]
SLOW_REWARD = REPO / "tests" / "payloads" / "slow_reward.py"
CALCULATOR = REPO / "trainer" / "agent" / "configs" / "calculator_tool_config.yaml"
STEP_RE = re.compile(r"^step:(\d+) ")
SAVED_RE = re.compile(r"^trainer: saved .*/global_step_(\d+) in ")
RESUMED_RE = re.compile(r"^trainer: resumed from .*/global_step_(\d+) \(step (\d+)\)")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and the toy task, in one directory the nodes (and containers) can see."""
    from trainer.tiny import save_tiny

    root = tmp_path_factory.mktemp("assets")
    save_tiny(root / "model", seed=0)
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "toy_digits", "--output",
                    str(root / "data"), "--train-size", "128", "--val-size", "8"],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    from trainer.data import read_rows, write_split

    for split in ("train", "test"):  # the same prompts for verl's tool agent loop, with the calculator
        rows = read_rows([root / "data" / f"{split}.parquet"])
        write_split([{**r, "agent_name": "tool_agent"} for r in rows], root / "data-tools", split)
    return root


def write_site(sites: Path, name: str, run_root: Path, *, time_limit: str = "10", nodes: int = 1,
               max_requeues: int = 3, slow_s: float = 0.0, slow_runs: str = "0",
               extra: str = "") -> None:
    sites.mkdir(exist_ok=True)
    container = extra or "container:\n  runtime: none\n"
    (sites / f"{name}.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\n"
        f"slurm:\n  nodes: {nodes}\n  time: \"{time_limit}\"\n  signal_lead_s: 40\n"
        f"  max_requeues: {max_requeues}\n"
        f"env:\n  SLOW_REWARD_S_PER_ROW: \"{slow_s}\"\n  SLOW_REWARD_RUNS: \"{slow_runs}\"\n"
        f"  OMP_NUM_THREADS: \"1\"\n{container}")


def overrides(assets: Path, steps: int, save_freq: int) -> list[str]:
    return [f"data.train_files={assets / 'data' / 'train.parquet'}",
            f"data.val_files={assets / 'data' / 'test.parquet'}", "data.max_prompt_length=16",
            "data.max_response_length=4", f"actor_rollout_ref.model.path={assets / 'model'}",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.val_before_train=false",
            "trainer.device=cpu", "trainer.logger=['console','jsonl']",
            f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
            "trainer.deadline_margin_s=5", f"custom_reward_function.path={SLOW_REWARD}",
            "custom_reward_function.name=compute_score", "trainer.seed=5"]


def submit(lab, sites: Path, site: str, run_dir: Path, args: list[str], via: str = "sbatch") -> int:
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    proc = run_hpcrl(["submit", "--site", site, "--via", via, "--run-dir", str(run_dir), "--",
                      *args], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split("job id: ")[1].split()[0])


def payload_log(run_dir: Path, restart: int) -> list[str]:
    path = run_dir / str(restart) / "logs" / "payload.log"
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def steps_run(run_dir: Path, restart: int) -> list[int]:
    return [int(m.group(1)) for ln in payload_log(run_dir, restart) if (m := STEP_RE.match(ln))]


def saved(run_dir: Path, restart: int) -> list[int]:
    return [int(m.group(1)) for ln in payload_log(run_dir, restart) if (m := SAVED_RE.match(ln))]


def resumed_from(run_dir: Path, restart: int) -> int | None:
    found = [int(m.group(1)) for ln in payload_log(run_dir, restart) if (m := RESUMED_RE.match(ln))]
    return found[0] if found else None


def logs(run_dir: Path) -> str:
    parts = []
    for f in sorted(run_dir.rglob("*")):
        if f.is_file() and f.suffix in (".out", ".log", ".txt") and "ray-" not in str(f):
            text = f.read_text(errors="replace").splitlines()[-25:]
            parts.append(f"==> {f} <==\n" + "\n".join(text))
    return "\n".join(parts)


def wait_for_step(lab, job: int, run_dir: Path, restart: int, step: int,
                  timeout: float = 300) -> None:
    """Until run `restart` logged `step` (0: until it started); fails at once if the job ended."""
    deadline = time.monotonic() + timeout
    while max(steps_run(run_dir, restart), default=0) < step or not payload_log(run_dir, restart):
        state = lab.state(job)
        assert state not in FINISHED and time.monotonic() < deadline, (
            f"step {step} of run {restart} not reached (job {state})\n{logs(run_dir)}")
        time.sleep(0.2)


def finished(lab, job: int, run_dir: Path, timeout: float = 600) -> dict[str, str]:
    """The job's final record; requeued runs pass through PENDING, not a finished state."""
    try:
        return lab.wait_done(job, timeout=timeout)
    except Exception as e:
        raise AssertionError(f"{e}\n\nrun directory logs:\n{logs(run_dir)}") from None


def check_metrics(run_dir: Path, total: int) -> None:
    from trainer.metrics import read_jsonl

    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, total + 1)), steps


def restart_dirs(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit())


def summary(run_dir: Path, restart: int) -> str:
    path = run_dir / str(restart) / "summary.txt"
    return path.read_text() if path.exists() else ""


@pytest.fixture
def sites(tmp_path: Path) -> Path:
    return tmp_path / "sites"


# ------------------------------------------------------------------ 1. time limit


def test_time_limit_signal_checkpoint_requeue_resume_same_weights(lab, sites, assets, tmp_path):
    """`--time=2` on 2 nodes, warning 40 s before: Slurm's signal reaches the batch script, the
    trainer checkpoints after its step and exits 3, the agent requeues, the rerun rebuilds Ray,
    resumes and finishes; the final weights equal an uninterrupted run's, bit for bit."""
    import torch

    write_site(sites, "rq-time", tmp_path / "runs", time_limit="2", nodes=2, slow_s=1.0)
    run_dir = tmp_path / "runs" / "time"
    args = overrides(assets, steps=12, save_freq=4)
    # `--follow`: the submitting command stays until Slurm forgets the job, printing each step
    # of both runs and the requeue between them, then the run's report
    follow = subprocess.run(
        [sys.executable, "-m", "hpcrl", "submit", "--site", "rq-time", "--via", "sbatch",
         "--run-dir", str(run_dir), "--follow", "--", *args], capture_output=True, text=True,
        timeout=900, env={**lab.env, "HPCRL_SITE_PATH": str(sites), "PYTHONPATH": str(REPO)})
    assert follow.returncode == 0, follow.stdout + follow.stderr + logs(run_dir)
    job = int(follow.stdout.split("job id: ")[1].split()[0])
    rec = finished(lab, job, run_dir, timeout=60)
    assert rec["JobState"] == "COMPLETED", (rec, logs(run_dir))
    assert int(rec["Restarts"]) >= 1 and restart_dirs(run_dir) == list(range(int(rec["Restarts"]) + 1))
    assert (run_dir / "0" / "warning").read_text() == "USR1\n"  # the batch script's trap
    first = summary(run_dir, 0)
    assert "Slurm's time-limit warning reached the batch script" in first, logs(run_dir)
    assert f"requeued job {job} with `scontrol requeue` (restart 1 of at most 3)" in first
    last_run0 = max(steps_run(run_dir, 0))
    assert last_run0 < 12 and saved(run_dir, 0)[-1] == last_run0  # checkpointed on the warning
    assert resumed_from(run_dir, 1) == last_run0  # nothing lost
    check_metrics(run_dir, 12)
    # the same run uninterrupted, outside Slurm
    ref = tmp_path / "ref"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCRL_", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONPATH": str(REPO),
                                                       "HPCRL_RUN_DIR": str(ref),
                                                       "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from trainer.checkpoint import sharded

    mine = sharded.read_group_state(run_dir / "checkpoints" / "global_step_12", "actor")["model"]
    theirs = sharded.read_group_state(ref / "checkpoints" / "global_step_12", "actor")["model"]
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    shown = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/12 ", follow.stdout, re.M)]
    assert shown == list(range(1, 13)), follow.stdout  # each step once, across the requeue
    assert "requeued: run 1 of the job starts" in follow.stdout, follow.stdout
    assert f"run {run_dir}: finished (2 runs: 1 restart)" in follow.stdout, follow.stdout
    status = run_hpcrl(["status", str(run_dir)], lab.env)
    assert f"restarts: {rec['Restarts']}" in status.stdout, status.stdout + status.stderr
    assert "last checkpointed step: 12" in status.stdout


# ------------------------------------------------------------------ 2. scontrol requeue


def test_scontrol_requeue_then_scancel_then_resume(lab_manager, sites, assets, tmp_path):
    """Through submitit: `scontrol requeue` mid-run sends SIGTERM; the trainer finishes its step
    and checkpoints; Slurm requeues (the agent does not add a second requeue); the rerun resumes
    from the newest complete checkpoint, holding the run directory's lease. While it runs,
    `--resume` is refused naming the job, and a second job sbatched by hand (past that check)
    stops at its head's lease, naming the running job, in a run directory of its own (`RUN/2/`):
    one job per run directory. Then `scancel`, and `hpcrl submit --resume` (via sbatch, no
    overrides: the job's own) starts a new job whose run claims the next free `RUN/3/`, never the
    cancelled job's stop request: it resumes from the checkpoint taken at the SIGTERM and
    completes, every step logged once, and `hpcrl status` tells each job's runs."""
    # the step in flight and the save at the SIGTERM, then the agents' summaries, on a loaded
    # 2-core machine: at times more than the lab's usual KillWait (10 s); sites give 30 s or more
    lab = lab_manager.get(extra={"KillWait": "30"})
    write_site(sites, "rq-ext", tmp_path / "runs", slow_s=0.5, slow_runs="0,1")
    run_dir = tmp_path / "runs" / "ext"
    # run 1 is slow and long (20 steps), so that the job still runs through the checks below
    job = submit(lab, sites, "rq-ext", run_dir, overrides(assets, steps=20, save_freq=3),
                 via="submitit")
    wait_for_step(lab, job, run_dir, 0, 4)
    lab.run("scontrol", "requeue", str(job))
    wait_for_step(lab, job, run_dir, 1, 6)
    lease = json.loads((run_dir / "lease.json").read_text())
    assert (lease["job_id"], lease["run"]) == (str(job), 1)  # the requeued run of the same job
    newest = max(saved(run_dir, 0))
    assert newest >= 4 and resumed_from(run_dir, 1) == newest
    assert "Slurm ended the job" in summary(run_dir, 0), logs(run_dir)
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    resume = ["submit", "--site", "rq-ext", "--via", "sbatch", "--run-dir", str(run_dir),
              "--resume"]
    refused = run_hpcrl(resume, env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"job {job} of `{run_dir}` is still RUNNING" in refused.stderr, refused.stderr
    rogue = lab.sbatch(run_dir / "job.sbatch")  # plain Slurm, past hpcrl's own check
    rec = finished(lab, rogue, run_dir, timeout=120)
    assert rec["JobState"] == "FAILED", (rec, logs(run_dir))
    assert f"is held by job {job} " in summary(run_dir, 2), logs(run_dir)
    assert "Slurm lists it as RUNNING" in summary(run_dir, 2)
    lease = json.loads((run_dir / "lease.json").read_text())
    assert (lease["job_id"], lease["run"]) == (str(job), 1) and lab.state(job) == "RUNNING"
    lab.run("scancel", str(job))
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "CANCELLED" and rec["Restarts"] == "1", (rec, logs(run_dir))
    assert (run_dir / "1" / "stop.json").is_file()  # the cancelled run's, left where it was
    stopped = max(saved(run_dir, 1))
    assert stopped == max(steps_run(run_dir, 1)), logs(run_dir)  # saved at the SIGTERM
    proc = run_hpcrl(resume, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = int(proc.stdout.split("job id: ")[1].split()[0])
    rec = finished(lab, second, run_dir)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", (rec, logs(run_dir))
    assert restart_dirs(run_dir) == [0, 1, 2, 3] and resumed_from(run_dir, 3) == stopped
    check_metrics(run_dir, 20)
    status = run_hpcrl(["status", str(run_dir)], env)
    assert f"run {run_dir}: finished (4 runs: 3 restarts)" in status.stdout, status.stdout
    assert f"  run 1: job {job} restart 1: " in status.stdout, status.stdout
    assert f"  run 2: job {rogue} restart 0: LeaseError: " in status.stdout, status.stdout
    assert f"  run 3: job {second} restart 0: " in status.stdout, status.stdout
    assert "last checkpointed step: 20" in status.stdout
    assert not (run_dir / "lease.json").exists()  # the last head gave it back
def redone(run_dir: Path, restart: int) -> int | None:
    """Steps the run `restart` says it redoes (the trainer's line after resuming)."""
    found = [int(m.group(1)) for ln in payload_log(run_dir, restart)
             if (m := re.match(r"^trainer: (\d+) step\(s\) redone", ln))]
    return found[0] if found else None


def wait_for_resume(lab, job: int, run_dir: Path, restart: int, timeout: float = 300
                    ) -> tuple[int | None, int]:
    """Until run `restart` said how many steps it redoes: (the step it resumed from, that many)."""
    deadline = time.monotonic() + timeout
    while (count := redone(run_dir, restart)) is None:
        assert time.monotonic() < deadline and lab.state(job) not in FINISHED, logs(run_dir)
        time.sleep(0.2)
    return resumed_from(run_dir, restart), count


def test_scontrol_requeue_from_outside_saves_at_the_stop_on_two_nodes(lab, sites, assets,
                                                                      tmp_path):
    """Through submitit, 2 nodes: `scontrol requeue` mid-run sends SIGTERM to every process of
    the job (batch shell, agents, trainer, raylets, Ray's workers); Ray's processes outlive it, the
    trainer finishes its step and checkpoints within `KillWait`; Slurm requeues (the agent does
    not add a second requeue); the rerun resumes from that checkpoint: no step redone."""
    write_site(sites, "rq-ext", tmp_path / "runs", nodes=2, slow_s=0.25)
    run_dir = tmp_path / "runs" / "ext"
    args = [*overrides(assets, steps=16, save_freq=5), "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",  # a rank on each node, in Ray's worker processes
            # every row through verl's tool agent loop, with the calculator tool
            f"data.train_files={assets / 'data-tools' / 'train.parquet'}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]
    job = submit(lab, sites, "rq-ext", run_dir, args, via="submitit")
    wait_for_step(lab, job, run_dir, 0, 8)
    lab.run("scontrol", "requeue", str(job))
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, logs(run_dir))
    last = max(steps_run(run_dir, 0))
    assert saved(run_dir, 0)[-1] == last and resumed_from(run_dir, 1) == last, logs(run_dir)
    assert redone(run_dir, 1) == 0, logs(run_dir)
    head_log = (run_dir / "0" / "logs").glob("agent-0-*.log")
    assert any("Ray's processes block SIGTERM" in p.read_text() for p in head_log), logs(run_dir)
    assert "Slurm ended the job" in summary(run_dir, 0), logs(run_dir)
    check_metrics(run_dir, 16)
    from trainer.metrics import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")  # the agent loops ran in both runs
    assert all(r["num_turns/min"] >= 2 and "agent_loop/generate_sequences/mean" in r for r in rows), rows[-1]


def test_three_nodes_requeue_in_grace_then_past_it_then_hpcrl_cancel(lab, sites, assets, tmp_path):
    """3 nodes, one job, three stops: run 0 (fast steps) is requeued and saves at the stop (0
    steps redone); run 1's steps outlast `KillWait` (10 s here), so the requeue's SIGKILL comes
    before the save: run 2 redoes the steps since the newest checkpoint (at most `save_freq`),
    as the head's note at the SIGTERM and the trainer's line after resuming say; run 2 ends with
    `hpcrl cancel`, which checkpoints first, then cancels the job."""
    save_freq = 4
    write_site(sites, "rq-three", tmp_path / "runs", nodes=3, slow_s=1.25, slow_runs="1,2")
    run_dir = tmp_path / "runs" / "three"
    args = [a.replace("=4", "=6") if "batch_size" in a else a  # 12 rows a step: 15 s when slow
            for a in overrides(assets, steps=15, save_freq=save_freq)]
    job = submit(lab, sites, "rq-three", run_dir, [*args, "trainer.nnodes=3",
                                                     "trainer.n_gpus_per_node=1"])
    wait_for_step(lab, job, run_dir, 0, 3)
    lab.run("scontrol", "requeue", str(job))
    resumed = wait_for_resume(lab, job, run_dir, 1)
    first = max(steps_run(run_dir, 0))
    assert saved(run_dir, 0)[-1] == first and resumed == (first, 0), logs(run_dir)
    wait_for_step(lab, job, run_dir, 1, first + 1)  # a slow step just ended: the next one
    lab.run("scontrol", "requeue", str(job))        # outlasts KillWait
    resumed = wait_for_resume(lab, job, run_dir, 2)
    newest = max(saved(run_dir, 0) + saved(run_dir, 1))
    last = max(steps_run(run_dir, 1))
    assert resumed == (newest, last - newest), logs(run_dir)
    assert 1 <= last - newest <= save_freq, logs(run_dir)
    note = next((run_dir / "1" / "logs").glob("agent-0-*.log")).read_text()
    assert "Slurm kills every process left KillWait (10 s) later" in note, note[-3000:]
    assert f"resumes from the newest checkpoint, step {newest}, and redoes" in note
    wait_for_step(lab, job, run_dir, 2, newest + 1)
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    cancel = run_hpcrl(["cancel", str(run_dir)], env)
    assert cancel.returncode == 0 and "to checkpoint and stop" in cancel.stdout, cancel.stderr
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "CANCELLED" and rec["Restarts"] == "2", (rec, logs(run_dir))
    stopped = max(steps_run(run_dir, 2))
    assert stopped < 15 and saved(run_dir, 2)[-1] == stopped, logs(run_dir)
    assert "`hpcrl cancel` by" in summary(run_dir, 2), logs(run_dir)
    assert "cancelled job" in summary(run_dir, 2) and not (run_dir / "cancel.json").exists()
    check_metrics(run_dir, stopped)


# ------------------------------------------------------------------ 3. preemption


@pytest.mark.parametrize("grace", [0, 20])
def test_preemption_by_high_partition(lab_manager, sites, assets, tmp_path, grace):
    """A job in `high` takes the node: with GraceTime 0 Slurm requeues at once (loss bounded by
    `save_freq`), with GraceTime 20 the trainer checkpoints in time and the agent requeues (Slurm
    would not: the job ended within its grace time); the run completes after the preemptor."""
    lab = lab_manager.get(grace_time=grace)
    save_freq = 3
    write_site(sites, f"rq-pre{grace}", tmp_path / "runs", slow_s=0.5)
    run_dir = tmp_path / "runs" / f"pre{grace}"
    job = submit(lab, sites, f"rq-pre{grace}", run_dir, overrides(assets, 10, save_freq))
    wait_for_step(lab, job, run_dir, 0, save_freq + 1)
    node = lab.job(job)["NodeList"]
    high = lab.sbatch("#!/bin/bash\nsleep 8\n", "-p", "high", "-N", "1", "-c", "2", "-w", node,
                      "-o", "/dev/null")
    assert lab.wait_done(high, timeout=120)["JobState"] == "COMPLETED"
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED" and int(rec["Restarts"]) >= 1, (rec, logs(run_dir))
    lost = max(steps_run(run_dir, 0)) - (resumed_from(run_dir, 1) or 0)
    assert lost <= save_freq if grace == 0 else lost == 0, (lost, logs(run_dir))
    if grace:
        assert "preempted within the partition's grace time" in summary(run_dir, 0), logs(run_dir)
        assert f"requeued job {job} with `scontrol requeue`" in summary(run_dir, 0)
    check_metrics(run_dir, 10)


# ------------------------------------------------------------------ 4. kill -9 mid-checkpoint


def trainer_pid(run_dir: Path) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainer" in cmd and f"HPCRL_RUN_DIR={run_dir}".encode() in env:
            return int(entry.name)
    return None


def kill_during_save(lab, job: int, run_dir: Path, point: str, timeout: float = 300) -> tuple[str, int]:
    """Kill -9 the trainer while it writes a checkpoint newer than the newest complete one (once
    there is one), at `point`: `started` (temporary directory made), `states` (a shard file
    written), `export` (HF export under way). Returns the temporary directory's name and the
    newest complete step at the kill."""
    from trainer.checkpoint import full_state as ckpt

    root = run_dir / "checkpoints"
    deadline = time.monotonic() + timeout
    pid = None
    while time.monotonic() < deadline:
        assert lab.state(job) not in FINISHED, logs(run_dir)
        pid = pid or trainer_pid(run_dir)
        newest = ckpt.find_latest_checkpoint(root)
        for tmp in (root.glob(".tmp-*-global_step_*") if newest and pid else []):
            step = int(re.findall(r"global_step_(\d+)", tmp.name)[0])
            reached = {"started": True, "states": any((tmp / "actor").glob("*.distcp")),
                       "export": (tmp / "huggingface").exists()}
            if step > ckpt.step_of(newest) and reached[point] and tmp.is_dir():
                os.kill(pid, signal.SIGKILL)
                return tmp.name, ckpt.step_of(newest)
        time.sleep(0.001)
    raise AssertionError(f"no checkpoint write to interrupt at `{point}`\n{logs(run_dir)}")


def test_kill_9_while_writing_a_checkpoint(lab, sites, assets, tmp_path):
    """At several points of a checkpoint write the payload dies (the job fails, exit 137); the
    job requeued by hand resumes from the previous complete checkpoint, never the partial one."""
    from trainer.checkpoint import full_state as ckpt

    write_site(sites, "rq-kill", tmp_path / "runs", slow_s=0.3, slow_runs="0,1,2")
    run_dir = tmp_path / "runs" / "kill"
    job = submit(lab, sites, "rq-kill", run_dir, overrides(assets, steps=6, save_freq=2))
    for restart, point in enumerate(("started", "states", "export")):
        partial, complete = kill_during_save(lab, job, run_dir, point)
        rec = finished(lab, job, run_dir)
        assert rec["JobState"] == "FAILED" and rec["ExitCode"].startswith("137"), rec
        assert (run_dir / "checkpoints" / partial).is_dir(), partial  # left behind, partial
        assert ckpt.find_latest_checkpoint(run_dir / "checkpoints") == ckpt.step_dir(
            run_dir / "checkpoints", complete)
        lab.run("scontrol", "requeue", str(job))
        wait_for_step(lab, job, run_dir, restart + 1, 0)
        deadline = time.monotonic() + 180
        while resumed_from(run_dir, restart + 1) is None:
            assert time.monotonic() < deadline and lab.state(job) not in FINISHED, logs(run_dir)
            time.sleep(0.2)
        assert resumed_from(run_dir, restart + 1) == complete, (point, logs(run_dir))
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "COMPLETED", (rec, logs(run_dir))
    check_metrics(run_dir, 6)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the next save removed them


# ------------------------------------------------------------------ 5. max_requeues


@pytest.mark.containers
def test_max_requeues_reached_stops_with_a_message(lab, lab_images, sites, assets, tmp_path):
    """In Podman, `max_requeues: 0`: a stop request (the run directory's STOP file) ends in a
    checkpoint and status 3, and the agent does not requeue: the job fails with a message saying
    so, and the checkpoint is complete and matches the last step."""
    from trainer.checkpoint import full_state as ckpt

    write_site(sites, "rq-max", tmp_path / "runs", max_requeues=0, slow_s=0.3,
               extra="container:\n  binds: ['${sys:prefix}', '${sys:base_prefix}', "
                     f"'${{sys:source_root}}', '{assets}']\n")
    run_dir = tmp_path / "runs" / "max"
    job = submit(lab, sites, "rq-max", run_dir, overrides(assets, steps=30, save_freq=-1))
    wait_for_step(lab, job, run_dir, 0, 2)
    (run_dir / "STOP").touch()
    rec = finished(lab, job, run_dir)
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "3:0", (rec, logs(run_dir))
    assert rec["Restarts"] == "0"
    node_log = (run_dir / "logs" / f"{job}-node0.out").read_text()
    assert "max_requeues reached" in node_log and "checkpoint is intact" in node_log
    assert "max_requeues reached" in summary(run_dir, 0)
    last = max(steps_run(run_dir, 0))
    newest = ckpt.find_latest_checkpoint(run_dir / "checkpoints")
    assert newest is not None and ckpt.step_of(newest) == last
    assert ckpt.load_state(newest, "trainer_state")["global_step"] == last
    assert not (run_dir / "STOP").exists()
    check_metrics(run_dir, last)
