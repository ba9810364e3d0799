"""verl as the payload (`hpcrl submit --verl`) on the real Slurm lab, with the stand-in for verl's
stop behaviour (`tests/payloads/verl_standin/`: verl's checkpoint layout, tracker file, early-save
hook read inside a Ray actor, truncating file logger, death on SIGUSR2 and SIGTERM).

One lab (GraceTime 20 on `debug`), three 1-node jobs at once:

- time limit: verl's early save (the job's end minus the lead in Ray's environment) saves the
  last step before the stop, the head ends verl and requeues, run 1 resumes from that step and
  completes; `--follow` prints every step once;
- `hpcrl cancel`: the head waits for verl's next checkpoint, then the job is CANCELLED;
  `hpcrl submit --resume` continues from it and completes;
- preemption by the `high` partition within GraceTime: SIGTERM reaches every process, verl
  (SIGTERM blocked) saves its step, the head ends it and requeues: nothing is lost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_hpcrl
from tests.lab import FINISHED
from tests.lab.test_requeue import finished, logs

pytestmark = [pytest.mark.lab, pytest.mark.slow]
STANDIN = REPO / "tests" / "payloads" / "verl_standin"
# verl's actor lines come with Ray's `(TaskRunner pid=N) ` prefix
STEP_RE = re.compile(r"(?:^|\) )step:(\d+) ")
RESUMED_RE = re.compile(r"(?:^|\) )Resuming from .*/global_step_(\d+)$")


def write_site(sites: Path, run_root: Path) -> None:
    sites.mkdir(exist_ok=True)
    (sites / "lab-verl.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\n"
        "slurm:\n  nodes: 1\n  time: \"2\"\n  signal_lead_s: 40\n  max_requeues: 3\n"
        "ray:\n  num_cpus: 16\n  num_gpus: 1\n"  # Ray declares a GPU: verl's resource pool
        "container:\n  runtime: none\n"
        f"env:\n  PYTHONPATH: \"{REPO}:{STANDIN}\"\n  STANDIN_STEP_S: \"2\"\n"
        "  OMP_NUM_THREADS: \"1\"\n")


def verl_line(steps: int, save_freq: int) -> list[str]:
    """What a verl user types (the stand-in reads only the trainer keys)."""
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=8",
            f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
            "trainer.project_name=lab", "trainer.experiment_name=standin"]


def payload_log(run_dir: Path, restart: int) -> list[str]:
    """The payload's lines, without Ray's colours."""
    path = run_dir / str(restart) / "logs" / "payload.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()


def steps_logged(run_dir: Path, restart: int) -> list[int]:
    """The steps verl's file logger wrote in run `restart` (the console lines of the actor reach
    the payload log through Ray's log forwarding, which a kill may cut short)."""
    path = run_dir / str(restart) / "verl-metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln)["step"] for ln in lines if ln.endswith("}")]


def steps_run(run_dir: Path, restart: int) -> list[int]:
    return [int(m.group(1)) for ln in payload_log(run_dir, restart) if (m := STEP_RE.search(ln))]


def resumed_from(run_dir: Path, restart: int) -> int | None:
    found = [int(m.group(1)) for ln in payload_log(run_dir, restart)
             if (m := RESUMED_RE.search(ln))]
    return found[0] if found else None


def summary(run_dir: Path, restart: int) -> str:
    path = run_dir / str(restart) / "summary.txt"
    return path.read_text() if path.exists() else ""


def restart_runs(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit())


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def submit(lab, env: dict[str, str], run_dir: Path, args: list[str]) -> int:
    proc = run_hpcrl(["submit", "--site", "lab-verl", "--via", "sbatch", "--run-dir",
                      str(run_dir), *args], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.split("job id: ")[1].split()[0])


def wait_for_step(lab, job: int, run_dir: Path, restart: int, step: int,
                  timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while max(steps_run(run_dir, restart), default=0) < step:
        state = lab.state(job)
        assert state not in FINISHED and time.monotonic() < deadline, (
            f"step {step} of run {restart} not reached (job {state})\n{logs(run_dir)}")
        time.sleep(0.2)


def test_verl_time_limit_cancel_resume_and_preemption(lab_manager, tmp_path):
    lab = lab_manager.get(grace_time=20)
    sites, runs = tmp_path / "sites", tmp_path / "runs"
    write_site(sites, runs)
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    began = time.monotonic()
    timed, cancelled, preempted = runs / "time", runs / "cancel", runs / "preempt"
    follow = subprocess.Popen(  # time limit: 2 min, 40 steps of 2 s need two runs
        [sys.executable, "-m", "hpcrl", "submit", "--site", "lab-verl", "--via", "sbatch",
         "--run-dir", str(timed), "--follow", "--verl", "--", *verl_line(40, 10)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env, "PYTHONPATH": str(REPO)})
    c_job = submit(lab, env, cancelled, ["--time", "10", "--verl", "--", *verl_line(15, 3)])
    p_job = submit(lab, env, preempted, ["--time", "10", "--verl", "--", *verl_line(20, 1)])

    # preemption within GraceTime: verl saves its step in the grace time, the head requeues
    wait_for_step(lab, p_job, preempted, 0, 3)
    node = lab.job(p_job)["NodeList"]
    high = lab.sbatch("#!/bin/bash\nsleep 8\n", "-p", "high", "-N", "1", "-c", "2", "-w", node,
                      "-o", "/dev/null")
    # `hpcrl cancel`: the head waits for verl's next checkpoint (save_freq 3), then cancels
    wait_for_step(lab, c_job, cancelled, 0, 4)
    cancel = run_hpcrl(["cancel", str(cancelled)], env)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    rec = finished(lab, c_job, cancelled)
    c_secs = time.monotonic() - began
    assert rec["JobState"] == "CANCELLED", (rec, logs(cancelled))
    stopped = max(steps_logged(cancelled, 0))
    agent = "\n".join(p.read_text() for p in (cancelled / "0" / "logs").glob("agent-0-*.log"))
    saved = re.search(r"verl saved global_step_(\d+) after the stop; nothing is redone", agent)
    assert saved and int(saved.group(1)) % 3 == 0, logs(cancelled)
    c_saved = int(saved.group(1))
    assert stopped == c_saved, logs(cancelled)  # its metrics logged before verl was ended
    again = submit(lab, env, cancelled, ["--time", "10", "--resume"])  # the job's own verl line
    rec = finished(lab, again, cancelled)
    assert rec["JobState"] == "COMPLETED" and resumed_from(cancelled, 1) == c_saved, \
        logs(cancelled)
    assert metrics_steps(cancelled) == list(range(1, 16))

    assert lab.wait_done(high, timeout=120)["JobState"] == "COMPLETED"
    rec = finished(lab, p_job, preempted)
    p_secs = time.monotonic() - began
    assert rec["JobState"] == "COMPLETED" and int(rec["Restarts"]) >= 1, (rec, logs(preempted))
    assert "preempted within the partition's grace time" in summary(preempted, 0), logs(preempted)
    assert resumed_from(preempted, 1) == max(steps_logged(preempted, 0)), logs(preempted)  # none lost
    assert metrics_steps(preempted) == list(range(1, 21))

    out, _ = follow.communicate(timeout=420)
    t_secs = time.monotonic() - began
    assert follow.returncode == 0, out + logs(timed)
    agent0 = "\n".join(p.read_text() for p in (timed / "0" / "logs").glob("agent-0-*.log"))
    assert "early-save hook saved global_step_" in agent0, logs(timed)
    last0 = max(steps_logged(timed, 0))
    assert any("Force saving checkpoint: ESI instance expiration approaching." in ln
               for ln in payload_log(timed, 0))
    assert resumed_from(timed, 1) == last0 < 40, logs(timed)
    assert "verl_launch: verl " in payload_log(timed, 0)[0]
    shown = [int(m.group(1)) for m in re.finditer(r"^step (\d+)", out, re.M)]
    assert shown == list(range(1, 41)), out
    done_runs = restart_runs(timed)  # Slurm's warning may come up to a minute early: 2 runs or 3
    assert "requeued: run 1 of the job starts" in out, out
    assert f"finished ({len(done_runs)} runs: {len(done_runs) - 1} restart" in out, out
    assert metrics_steps(timed) == list(range(1, 41))
    status = run_hpcrl(["status", str(timed)], env)
    assert "last checkpointed step: 40" in status.stdout, status.stdout + status.stderr
    print(f"\nverl lab: time limit run 0 to step {last0}, run 1 resumed from global_step_"
          f"{resumed_from(timed, 1)}, {len(done_runs)} runs, completed at {t_secs:.0f} s; cancel "
          f"after step {stopped}, "
          f"CANCELLED at {c_secs:.0f} s, --resume resumed from global_step_{c_saved} and completed; "
          f"preempted at step {max(steps_logged(preempted, 0))}, run 1 resumed from global_step_"
          f"{resumed_from(preempted, 1)}, completed at {p_secs:.0f} s")


VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
REQUIRE_VERL = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
                and os.environ.get("HPCRL_REQUIRE_VERL") == "1")


def real_verl_site(sites: Path, name: str, run_root: Path, cpus: int) -> None:
    sites.mkdir(exist_ok=True)
    (sites / f"{name}.yaml").write_text(
        f"extends: slurmlab\nrun_root: {run_root}\npython: {VERL_PYTHON}\n"
        "slurm:\n  nodes: 1\n  time: \"5\"\n"
        f"ray:\n  num_cpus: {cpus}\n  num_gpus: 1\n"
        "container:\n  runtime: none\n"
        f"env:\n  PYTHONPATH: \"{REPO}\"\n  OMP_NUM_THREADS: \"1\"\n")


def test_real_verl_connects_names_its_version_and_stops_where_it_needs_a_gpu(lab, tmp_path):
    """verl 0.9.1 itself (`.venv-verl`, `make verl-venv`) under `hpcrl submit --verl`: Hydra
    takes the overrides hpcrl adds, verl connects to the job's Ray, its TaskRunner and workers
    start on the CPUs hpcrl checked, and on this CPU-only lab it ends where it needs a GPU
    (NCCL). With too few Ray CPUs the head refuses to start verl, naming both numbers."""
    if not VERL_PYTHON.exists():
        reason = f"{VERL_PYTHON} is missing (`make verl-venv` builds it)"
        if REQUIRE_VERL:
            pytest.fail(reason + ", but CI=true and HPCRL_REQUIRE_VERL=1 require it")
        pytest.skip(reason)
    from trainer.tiny import save_tiny

    assets = tmp_path / "assets"
    save_tiny(assets / "model", seed=0)
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "toy_digits", "--output",
                    str(assets / "data"), "--train-size", "16", "--val-size", "4"], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    sites, runs = tmp_path / "sites", tmp_path / "runs"
    real_verl_site(sites, "lab-verl-real", runs, 16)
    real_verl_site(sites, "lab-verl-small", runs, 4)
    env = {**lab.env, "HPCRL_SITE_PATH": str(sites)}
    line = [f"data.train_files={assets / 'data' / 'train.parquet'}",
            f"data.val_files={assets / 'data' / 'test.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=16", "data.max_response_length=8",
            f"actor_rollout_ref.model.path={assets / 'model'}", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "trainer.logger=['console']", "trainer.val_before_train=False",
            "trainer.total_training_steps=2", "trainer.save_freq=1"]
    small = runs / "small"
    proc = run_hpcrl(["submit", "--site", "lab-verl-small", "--via", "sbatch", "--run-dir",
                      str(small), "--verl", "--", *line], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    real = runs / "real"
    proc = run_hpcrl(["submit", "--site", "lab-verl-real", "--via", "sbatch", "--run-dir",
                      str(real), "--verl", "--", *line], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = int(proc.stdout.split("job id: ")[1].split()[0])
    small_job = int((small / "submission.json").read_text().split('"job_id": "')[1].split('"')[0])
    assert finished(lab, small_job, small, timeout=180)["JobState"] == "FAILED"
    assert ("verl needs 13 Ray CPUs (10 for its TaskRunner, TransferQueue controller and 8 "
            "storage units, 3 per GPU for 1 GPUs); the job's Ray cluster has 4") in summary(small, 0)
    assert not payload_log(small, 0), "verl was started"
    rec = finished(lab, job, real, timeout=400)
    text = "\n".join(payload_log(real, 0))
    assert payload_log(real, 0)[0].startswith("verl_launch: verl 0.9.1 "), text[:2000]
    assert "Connected to Ray cluster" in text and "TaskRunner" in text, text[-3000:]
    assert "Distributed package doesn't have NCCL built in" in text, text[-3000:]
    assert rec["JobState"] == "FAILED", (rec, logs(real))
