"""The embedded default end to end: `hpcrl submit --site local` runs the node agent, a one-node
Ray cluster and the trainer on this machine; Ctrl-C stops it with a checkpoint and `--resume`
continues without a gap or a duplicate step; the demo's short run learns."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.hpcrl.test_plotting import png_size

pytestmark = pytest.mark.slow


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path),
            "MPLCONFIGDIR": str(tmp_path / "mpl"), "HPCRL_RUN_ROOT": str(tmp_path / "runs")}


def steps_of(metrics: Path) -> list[tuple[int, int]]:
    from hpcrl.runreport import read_metrics

    return [(r["step"], r["training/restart"]) for r in read_metrics(metrics)]


def test_demo_short_run_shows_the_reward_rising(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpcrl.demo", "--steps", "4", "--dir",
                           str(tmp_path / "demo")], env=env_for(tmp_path), text=True,
                          capture_output=True, timeout=850)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    m = re.search(r"reward rose: ([0-9.]+) \(step 1\) -> ([0-9.]+) \(step 4\)", out)
    assert m, out
    assert float(m.group(2)) > float(m.group(1))
    assert "demo: finished: 4 GRPO steps" in out
    runs = list((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == 1
    assert f"checkpoint: {runs[0] / 'checkpoints' / 'global_step_4'}" in out
    assert f"plot: {runs[0] / 'metrics.png'}" in out and png_size(runs[0] / "metrics.png")
    # progress: the waiting states, then one line per step with an ETA until the last
    assert "1/1 nodes joined" in out
    assert re.search(r"step 1/4  reward [0-9.]+  kl \S+  entropy \S+  len \S+  \S+s/step  ETA ",
                     out), out


def overrides(model: Path, data: Path, run: Path, steps: int) -> list[str]:
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=8",
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=grpo",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
            "trainer.device=cpu", "trainer.logger=jsonl", f"trainer.run_dir={run}",
            f"trainer.default_local_dir={run / 'ckpt'}"]


def in_terminal(argv: list[str], env: dict[str, str], ctrl_c_after: bytes, timeout: float
                ) -> tuple[int, str]:
    """Run `argv` on a pseudo-terminal and type Ctrl-C once `ctrl_c_after` has been printed:
    the terminal sends SIGINT to its whole foreground process group, as for a user."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once, never return into pytest
        try:
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    out, typed, deadline = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the terminal closed: the command ended
                    break
                if not data:
                    break
                out += data
            if not typed and ctrl_c_after in out:
                os.write(fd, b"\x03")
                typed = True
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"still running after {timeout} s:\n{out.decode(errors='replace')}")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_ctrl_c_checkpoints_and_resume_continues(tiny_model_dir: Path, tmp_path: Path) -> None:
    from trainer.rewards.toy import write_toy_digits

    data, run = tmp_path / "data", tmp_path / "run"
    write_toy_digits(data, train_size=64, val_size=8, seed=0)
    # the first run's steps are slowed (0.03 s per row, 32 rows: about 1 s, changing no number)
    # so that Ctrl-C lands mid-run on a fast machine too; the resumed run is fast
    env = {**env_for(tmp_path), "SLOW_REWARD_S_PER_ROW": "0.03", "SLOW_REWARD_RUNS": "0"}
    total = 12
    slow = [f"custom_reward_function.path={REPO / 'tests' / 'payloads' / 'slow_reward.py'}",
            "custom_reward_function.name=compute_score"]
    submit = [sys.executable, "-m", "hpcrl", "submit", "--site", "local", "--run-dir", str(run)]
    code, out = in_terminal([*submit, "--", *overrides(tiny_model_dir, data, run, total), *slow],
                            env, ctrl_c_after=f"step 2/{total}".encode(), timeout=850)
    assert code == 3, out
    assert "\r\x1b[K" in out  # on a terminal the waiting state is rewritten in place
    assert "stopping: the trainer finishes its step and writes a checkpoint" in out, out
    assert f"continue with: hpcrl submit --site local --run-dir {run} --resume" in out
    stopped = steps_of(run / "metrics.jsonl")
    k = stopped[-1][0]
    assert 2 <= k < total and stopped == [(s, 0) for s in range(1, k + 1)]
    assert (run / "ckpt" / f"global_step_{k}" / "manifest.json").is_file()
    assert "stop requested (signal SIGINT)" in (run / "0" / "logs" / "payload.log").read_text()

    second = subprocess.run([*submit, "--resume"], env=env, text=True, capture_output=True,
                            timeout=850)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"hpcrl: run directory {run} (run 1," in second.stdout
    assert f"step {k + 1}/{total}" in second.stdout and f"step {k}/{total}" not in second.stdout
    assert steps_of(run / "metrics.jsonl") == (
        [(s, 0) for s in range(1, k + 1)] + [(s, 1) for s in range(k + 1, total + 1)])
    assert "finished (2 runs: 1 restart)" in second.stdout
    assert (run / "ckpt" / f"global_step_{total}").is_dir()


def test_gsm8k_demo_without_data_says_where_to_get_it(tmp_path: Path) -> None:
    """`--gsm8k` with a directory lacking verl's parquet files stops before anything is made."""
    proc = subprocess.run([sys.executable, "-m", "hpcrl.demo", "--gsm8k", "--gsm8k-data",
                           str(tmp_path / "nowhere"), "--dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"GSM8K data not found: {tmp_path / 'nowhere' / 'train.parquet'}" in proc.stderr
    assert "Fix: `--gsm8k-data DIR` with `train.parquet` and `test.parquet`" in proc.stderr
    assert not (tmp_path / "demo").exists()
