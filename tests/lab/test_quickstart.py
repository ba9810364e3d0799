"""`docs/quickstart-cluster.md` followed as a new user follows it, on the lab.

The login node's environment is `pip install hpcrl` of this checkout into a virtualenv of its
own, and nothing else (no torch, Ray or vLLM): every `hpcrl` command runs from it, by name, as
the page writes it. The page's commands are read from the page (:mod:`tests.quickstart_page`),
the page's names replaced by the lab's, and run in the page's order: `sites new`, `doctor`,
`submit --dry-run`, `submit --follow`, and, while that one follows the run, from a second
terminal `status`, `logs -f`, `plot` and `cancel`; then the memory plan and `submit --resume`.
One step is the user's own, between `sites new` and `doctor`, as on a cluster: the nodes'
Python environment (on a cluster the image's `hpcrl[train]`; on the lab this checkout's venv,
bound into the lab's image) is set in the written profile as `container.python`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.lab import FINISHED
from tests.quickstart_page import NOT_RUN_HERE, page_commands
from tests.quickstart_page import on_the_lab as lab_argv

pytestmark = [pytest.mark.lab, pytest.mark.containers, pytest.mark.slow]
SLOW_REWARD = REPO / "tests" / "payloads" / "slow_reward.py"
STEPS = 8


@pytest.fixture(scope="module")
def login_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A login node's environment: `pip install hpcrl` (this checkout), nothing more."""
    venv = tmp_path_factory.mktemp("login") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)  # type: ignore[attr-defined]
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(REPO)], capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stdout + done.stderr
    heavy = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; "
                            "print([m for m in ('torch', 'ray', 'vllm') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True)
    assert heavy.stdout.strip() == "[]", heavy.stdout  # the light install
    return venv


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and the toy task, where the nodes (and containers) see them."""
    from trainer.tiny import save_tiny

    root = tmp_path_factory.mktemp("qs-assets")
    save_tiny(root / "model", seed=0)
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "toy_digits", "--output", str(root / "data"),
                    "--train-size", "64", "--val-size", "8"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return root


def tiny(assets: Path) -> list[str]:
    """The lab's scale, appended to the page's overrides (a slow reward in the first run, so that
    the second terminal's commands find it running)."""
    return [f"data.val_files={assets / 'data' / 'test.parquet'}", "data.max_prompt_length=16",
            "data.max_response_length=4", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
            "trainer.device=cpu", "trainer.logger=['console','jsonl']", f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=2", f"custom_reward_function.path={SLOW_REWARD}",
            "custom_reward_function.name=compute_score", "trainer.seed=5"]


class Page:
    """The page's commands, run on the lab from the login venv; each one run is kept."""

    def __init__(self, env: dict[str, str], paths: dict[str, str], cwd: Path) -> None:
        self.commands, self.env, self.paths, self.cwd = page_commands(), env, paths, cwd
        self.ran: list[str] = []

    def argv(self, prefix: str, *extra: str) -> list[str]:
        (command,) = [c for c in self.commands if c.startswith(prefix)]
        self.ran.append(command)
        return [*lab_argv(command, self.paths), *extra]

    def run(self, prefix: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(prefix, *extra), env=self.env, cwd=self.cwd, text=True, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)

    def start(self, prefix: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(prefix, *extra), env=self.env, cwd=self.cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def test_the_quickstart_page_on_the_lab(lab, lab_images, login_venv: Path, assets: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    env = {k: v for k, v in lab.env.items() if k not in ("PYTHONPATH", "HPCRL_SITE_PATH")}
    env.update({"PATH": f"{login_venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
                "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_STATE_HOME": str(tmp_path / "state"),
                "HPCRL_LAB_RUN_ROOT": str(runs)})
    page = Page(env, {"/models/m": str(assets / "model"), "/data/train.parquet": str(assets / "data" / "train.parquet"),
                      "run.png": str(tmp_path / "run.png")}, tmp_path)

    # 2. the site profile, from what the lab's Slurm and nodes say (no terminal: defaults and notes)
    new = page.run("hpcrl sites new")
    assert new.returncode == 0, new.stdout + new.stderr
    written_path = tmp_path / "cfg" / "hpcrl" / "sites" / "labnew.yaml"
    written = written_path.read_text()
    for line in ['  partition: "debug"  # scontrol show partition: PartitionName=debug Default=YES',
                 "  cpus_per_task: 2  # scontrol show node: CPUTot=2", '  mem: "4000M"',
                 "  gpus_per_node: 0  # scontrol show node: Gres=(null)", '  runtime: "podman"  # on PATH: ']:
        assert line in written, written
    assert "hpcrl doctor --site labnew" in new.stdout
    # the user's own step: the nodes' Python environment (on the lab, this checkout's venv) and
    # the folders the job reads (the model and the data) bound into the container
    profile = yaml.safe_load(written)
    container = profile.setdefault("container", {})
    container["python"] = sys.executable
    container["binds"] = [sys.prefix, sys.base_prefix, str(REPO), str(login_venv), str(assets)]
    profile["env"] = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SLOW_REWARD_S_PER_ROW": "0.4",
                      "SLOW_REWARD_RUNS": "0"}
    written_path.write_text(yaml.safe_dump(profile, sort_keys=False))

    # is the cluster ready?
    t0 = time.monotonic()
    doctor = page.run("hpcrl doctor", timeout=420)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    table = doctor.stdout[doctor.stdout.index("PASS  Ray"):]
    for check in ["PASS  Ray: every node joined", "PASS  container starts on every node",
                  "PASS  all-reduce across nodes: result", "PASS  all-reduce across nodes: bus bandwidth",
                  "SKIP  vLLM loads and generates on one GPU",
                  "PASS  the payload's interpreter: one on every node, Python >= 3.11",
                  "PASS  run directory shared by every node"]:
        assert check in table, table
    assert "FAIL" not in table and "0 x none (0 GiB) via CPU, granted 0" in table, table
    print(f"hpcrl doctor from the login venv: {time.monotonic() - t0:.1f} s\n{table}")

    # 3. submit: the dry run's verdict, then the job, followed
    dry = page.run("hpcrl submit --site mi300-cluster --dry-run", *tiny(assets))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "never passed" not in dry.stderr, dry.stderr  # the doctor's pass is recorded
    follow = page.start("hpcrl submit --site mi300-cluster --nodes 2 --follow", *tiny(assets))
    assert follow.stdout is not None
    head = [follow.stdout.readline() for _ in range(2)]
    assert head[0].startswith("job id: ") and head[1].startswith("run directory: "), head
    job, run_dir = int(head[0].split()[2]), Path(head[1].split(": ", 1)[1].strip())
    assert run_dir.parent == runs, run_dir
    page.paths["~/hpcrl-runs/RUN"] = str(run_dir)
    deadline = time.monotonic() + 420
    while max(steps_logged(run_dir), default=0) < 2:
        assert lab.state(job) not in FINISHED and time.monotonic() < deadline, lab.state(job)
        time.sleep(0.5)

    # 4. follow it, from a second terminal
    status = page.run("hpcrl status")
    assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr
    logs = page.start("hpcrl logs")  # `-f` follows until stopped: stopped at its first step line, or after 120 s
    assert logs.stdout is not None
    stop = threading.Timer(120, logs.kill)
    stop.start()
    seen = []
    for line in logs.stdout:
        seen.append(line)
        if "step:" in line:
            break
    stop.cancel()
    logs.kill()
    logs.wait(timeout=30)
    assert "step:" in seen[-1], "".join(seen)
    plot = page.run("hpcrl plot")  # the light install has no matplotlib: it says what to install
    assert plot.returncode == 2 and "pip install 'hpcrl[plot]'" in plot.stderr, plot.stdout + plot.stderr
    assert not (tmp_path / "run.png").exists()
    cancel = page.run("hpcrl cancel", timeout=300)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    out, _ = follow.communicate(timeout=300)
    assert lab.wait_done(job, timeout=120)["JobState"] == "CANCELLED", out
    stopped = max(steps_logged(run_dir))
    status = page.run("hpcrl status")  # checkpointed at the stop
    assert stopped < STEPS and f"last checkpointed step: {stopped}" in status.stdout, out + status.stdout

    # will it fit? (the plan needs torch: the nodes' environment, not the login node's)
    plan = subprocess.run([sys.executable, *page.argv("python -m trainer --plan-memory")[1:]],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, text=True, capture_output=True,
                          timeout=300)
    assert plan.returncode == 0 and "rollout" in plan.stdout, plan.stdout + plan.stderr

    # 5. resume
    resume = page.run("hpcrl submit --site mi300-cluster --run-dir")
    assert resume.returncode == 0, resume.stdout + resume.stderr
    second = int(resume.stdout.split("job id: ")[1].split()[0])
    assert lab.wait_done(second, timeout=600)["JobState"] == "COMPLETED"
    assert steps_logged(run_dir) == list(range(1, STEPS + 1))
    status = page.run("hpcrl status")
    assert "finished" in status.stdout and f"last checkpointed step: {STEPS}" in status.stdout, status.stdout

    # every command of the page was run here, or is named with where it is tested
    assert sorted(set(page.ran) | set(NOT_RUN_HERE)) == sorted(set(page.commands)), (page.ran, page.commands)
