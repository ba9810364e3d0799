"""verl as the payload (`hpcrl.payloads.verl`): the overrides hpcrl fills and refuses, Ray's
environment, the stop's wait for verl's checkpoint, and verl's metrics and checkpoints read by
`hpcrl status`. The CLI runs in a fresh process; the stop's one faked seam is the payload
process (what it is sent)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.jobspec import JobSpec
from hpcrl.payloads import verl
from hpcrl.rundir import RunPaths
from hpcrl.runreport import latest_checkpoint, run_report
from tests.conftest import REPO, run_hpcrl
from tests.trainer.test_config import SEEDS, seed_command_lines

RUN = Path("/runs/r1")
LINE = ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", "trainer.save_freq=5"]


def test_fills_checkpoints_resume_nodes_gpus_and_file_logger() -> None:
    out = verl.verl_overrides(LINE, RUN, nodes=2, gpus=4, node_range=None)
    assert out == [*LINE, "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                   "trainer.resume_mode=auto", "trainer.default_local_dir=/runs/r1/checkpoints",
                   "trainer.logger=[console,wandb,file]"]


def test_given_values_that_agree_are_kept_and_relative_dirs_go_under_the_run() -> None:
    out = verl.verl_overrides([*LINE, "trainer.nnodes=2", "trainer.logger=['console','file']",
                               "trainer.default_local_dir=ckpt/gsm8k"], RUN, 2, 1, None)
    assert "trainer.nnodes=2" in out and "trainer.logger=['console','file']" in out
    assert out[-1] == "trainer.default_local_dir=/runs/r1/ckpt/gsm8k"
    assert "trainer.default_local_dir=ckpt/gsm8k" not in out


@pytest.mark.parametrize("extra, words", [
    (["trainer.save_freq=-1"], "`trainer.save_freq` is -1"),
    (["trainer.save_freq=0"], "add `trainer.save_freq=N`"),
    (["+ray_kwargs.ray_init.num_cpus=32"], "refuse to connect to the job's Ray cluster"),
    (["ray_kwargs.ray_init.num_gpus=8"], "`ray_kwargs.ray_init.num_gpus`"),
    (["trainer.nnodes=4"], "`trainer.nnodes=4` disagrees with the allocation (2"),
    (["trainer.n_gpus_per_node=8"], "GPUs per node"),
    (["trainer.nnodes="], "expanded to nothing where the line was typed"),
    (["trainer.resume_mode=disable"], "must resume from the newest checkpoint"),
    (["actor_rollout_ref.actor.checkpoint.async_save=True"], "no `latest_checkpointed_iteration"),
    (["trainer.default_local_dir=/scratch/x"], "outside the run directory"),
])
def test_refusals_name_the_problem_and_the_fix(extra: list[str], words: str) -> None:
    with pytest.raises(verl.VerlError, match="Fix:") as err:
        verl.verl_overrides([*LINE, *extra], RUN, 2, 4, None)
    assert words in str(err.value)


def test_without_save_freq_and_with_a_node_range_or_no_gpu_it_is_refused() -> None:
    with pytest.raises(verl.VerlError, match="saves no checkpoint"):
        verl.verl_overrides(["data.train_batch_size=8"], RUN, 1, 1, None)
    with pytest.raises(verl.VerlError, match="tied to the world size"):
        verl.verl_overrides(LINE, RUN, 4, 1, "3-4")
    with pytest.raises(verl.VerlError, match="no CPU path"):
        verl.verl_overrides(LINE, RUN, 1, 0, None)


def test_ray_cpus_checked_against_verls_need() -> None:
    argv = verl.payload("python3", verl.verl_overrides(LINE, RUN, 2, 4, None))
    assert verl.cpus_needed(2, 4) == 34
    assert verl.check_cpus(34, argv) is None
    text = verl.check_cpus(32, argv)
    assert text and "verl needs 34 Ray CPUs" in text and "has 32" in text


def test_ray_env_has_the_early_save_deadline_and_a_logger_per_run(tmp_path: Path) -> None:
    env = verl.ray_env(RunPaths(tmp_path, 3), 10_000.0, 40)
    assert env == {verl.ESI_ENV: "9960", verl.LOGGER_ENV: str(tmp_path / "3" / verl.LOGGER_FILE)}
    assert verl.ESI_ENV not in verl.ray_env(RunPaths(tmp_path, 0), None, 40)


def site(tmp_path: Path, gpus: int = 1) -> dict[str, str]:
    sites = tmp_path / "sites"
    sites.mkdir(exist_ok=True)
    (sites / "gpu.yaml").write_text(f"extends: slurmlab\nslurm:\n  gpus_per_node: {gpus}\n")
    return {"HPCRL_SITE_PATH": str(sites)}


def test_render_verl_writes_the_verl_line(tmp_path: Path, clean_env: dict[str, str]) -> None:
    run_dir = tmp_path / "v"
    proc = run_hpcrl(["render", "--site", "gpu", "--verl", "--run-dir", str(run_dir), "--",
                      *LINE], {**clean_env, **site(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    payload = JobSpec.from_json((run_dir / "job.json").read_text()).payload
    assert payload[1:3] == ("-m", "verl.trainer.main_ppo") and verl.is_verl(payload)
    assert f"trainer.default_local_dir={run_dir}/checkpoints" in payload


def test_submit_verl_refuses_before_creating_anything(tmp_path: Path,
                                                      clean_env: dict[str, str]) -> None:
    run_dir = tmp_path / "v"
    proc = run_hpcrl(["submit", "--site", "gpu", "--verl", "--run-dir", str(run_dir), "--",
                      "trainer.save_freq=-1"], {**clean_env, **site(tmp_path)})
    assert proc.returncode == 2 and "`--verl`: `trainer.save_freq` is -1" in proc.stderr
    assert not run_dir.exists()


def write_verl_log(run_dir: Path, restart: int, steps: range) -> None:
    path = RunPaths(run_dir, restart).root / verl.LOGGER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "data": {"critic/score/mean": s / 10,
                                                             "timing_s/step": 1.0}}) + "\n"
                            for s in steps) + '{"step": 99, "da')  # a line cut short


def save(root: Path, step: int) -> None:
    (root / f"global_step_{step}" / "actor").mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_status_reads_verls_logger_of_every_run_and_its_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_verl_log(run_dir, 0, range(1, 8))  # run 0 logged 1..7, saved 5
    write_verl_log(run_dir, 1, range(6, 10))  # run 1 resumed from 5, redid 6..7
    save(run_dir / "checkpoints", 5)
    save(run_dir / "checkpoints", 9)
    assert verl.merge_metrics(run_dir) == 9
    report = run_report(run_dir)
    assert [r["step"] for r in report.records] == list(range(1, 10))
    assert [r["training/restart"] for r in report.records] == [0] * 5 + [1] * 4
    assert latest_checkpoint(run_dir) == (9, run_dir / "checkpoints" / "global_step_9")
    assert "  last checkpointed step: 9" in "\n".join(report.lines())


class Payload:
    """The payload process seam: what it is sent."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, sig: int) -> None:
        self.sent.append(sig)


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, fmt: str, *args: object) -> None:
        self.lines.append(fmt % args)


def test_stop_waits_for_a_newer_checkpoint_then_ends_verl(tmp_path: Path) -> None:
    root, payload, log = tmp_path / "checkpoints", Payload(), Log()
    save(root, 4)
    write_verl_log(tmp_path, 0, range(1, 6))
    waiter = verl.VerlStop(tmp_path, root, log)
    waiter.begin(time.time() + 60, "SIGTERM")
    waiter.tick(payload, clock_stop=False)
    assert payload.sent == [] and waiter.status(143, 3) == 143  # still waiting
    save(root, 6)
    waiter.tick(payload, clock_stop=False)
    assert payload.sent == []  # step 6 saved, its metrics not logged yet
    write_verl_log(tmp_path, 0, range(1, 7))
    waiter.tick(payload, clock_stop=False)
    assert payload.sent == [signal.SIGKILL] and waiter.status(137, 3) == 3
    assert "verl saved global_step_6 after the stop; nothing is redone" in log.lines[-1]


def test_stop_past_its_bound_names_the_steps_a_resume_redoes(tmp_path: Path) -> None:
    root, payload, log = tmp_path / "checkpoints", Payload(), Log()
    save(root, 4)
    write_verl_log(tmp_path, 0, range(1, 8))
    waiter = verl.VerlStop(tmp_path, root, log)
    waiter.begin(time.time() - 1, "SIGTERM")
    waiter.tick(payload, clock_stop=False)
    assert payload.sent == [signal.SIGKILL]
    assert ("the next run resumes from global_step_4 and redoes steps 5 to 8 (step 8 was in "
            "progress)") in log.lines[-1]


def test_at_the_time_limit_the_early_save_of_the_last_step_is_enough(tmp_path: Path) -> None:
    root, payload, log = tmp_path / "checkpoints", Payload(), Log()
    save(root, 7)
    write_verl_log(tmp_path, 0, range(1, 8))
    waiter = verl.VerlStop(tmp_path, root, log)
    waiter.begin(time.time() + 60, "the time limit")
    waiter.tick(payload, clock_stop=True)
    assert payload.sent == [signal.SIGKILL] and "early-save hook saved global_step_7" in log.lines[-1]


def test_the_launcher_runs_verl_with_sigterm_blocked() -> None:
    helper = Path(verl.__file__).with_name(verl.LAUNCHER)
    probe = "import signal; print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    proc = subprocess.run([sys.executable, str(helper), "--", sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.startswith("verl_launch: verl ") and second == "True"


def seed_outcomes() -> list[str]:
    """What `--verl` makes of each seed line (tests/data/verl_seed_overrides.txt, shell
    variables as in the allocation) on 2 nodes of 8 GPUs, and of the AMD Slurm line also typed
    on a login node, where `$SLURM_NNODES` and `$SLURM_GPUS_PER_NODE` expand to nothing."""
    out = []
    for words in seed_command_lines():
        try:
            verl.verl_overrides(words, RUN, 2, 8, None)
            out.append("accepted")
        except verl.VerlError as exc:
            out.append(str(exc).split(":")[0])
    login = SEEDS.read_text().split("\n\n")[-1].replace("${SLURM_NNODES}", "") \
        .replace("${SLURM_GPUS_PER_NODE}", "").replace("trainer.save_freq=-1", "trainer.save_freq=10")
    words = [w for w in login.replace("\\\n", " ").split() if "=" in w]
    try:
        verl.verl_overrides(words, RUN, 2, 8, None)
    except verl.VerlError as exc:
        out.append(str(exc))
    return out


def test_the_seed_lines_as_typed() -> None:
    got = seed_outcomes()
    assert got[:6] == ["`trainer.save_freq` is -1", "`trainer.save_freq` is -1",
                       "`trainer.save_freq` is -1", "`trainer.n_gpus_per_node=1` disagrees with the "
                       "allocation (8", "`trainer.resume_mode=disable`", "`trainer.save_freq` is -1"]
    assert "`trainer.nnodes=` is not a whole number (empty: a shell variable such as " \
           "`$SLURM_NNODES` expanded to nothing" in got[6]
    fixed = verl.verl_overrides(["trainer.save_freq=10", *seed_command_lines()[0]], RUN, 2, 8,
                                None)
    assert "trainer.logger=[console,file]" in fixed and "trainer.nnodes=2" in fixed
    dstack = [w for w in seed_command_lines()[4] if w != "trainer.resume_mode=disable"]
    with pytest.raises(verl.VerlError, match="`trainer.default_local_dir=/checkpoints` is outside"):
        verl.verl_overrides(dstack, RUN, 2, 8, None)



def test_the_command_itself_after_dash_dash_is_refused(tmp_path: Path,
                                                       clean_env: dict[str, str]) -> None:
    proc = run_hpcrl(["render", "--site", "gpu", "--verl", "--run-dir", str(tmp_path / "v"),
                      "--", "python3", "-m", "verl.trainer.main_ppo", *LINE],
                     {**clean_env, **site(tmp_path)})
    assert proc.returncode == 2 and "not the command (found `python3`)" in proc.stderr


def test_a_lost_node_names_the_steps_the_next_run_redoes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    save(tmp_path / "checkpoints", 5)
    write_verl_log(tmp_path, 0, range(1, 9))
    log = Log()
    log.error = log.info  # type: ignore[method-assign]
    node = SimpleNamespace(run_dir=tmp_path, log=log, job=SimpleNamespace(
        payload=verl.payload("python3", verl.verl_overrides(LINE, tmp_path, 1, 1, None))))
    verl.VerlKind(node, stop=None).after_loss()
    assert log.lines == ["verl could not save: the next run resumes from global_step_5 and "
                         "redoes steps 6 to 9 (step 9 was in progress)"]
