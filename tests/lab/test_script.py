"""The rendered script under real Slurm (the test lab): every profile variable, quoted values and
passed-through secrets reach the node-agent step on every node, the warning signal is noted in the
run directory for the agents (and not sent through srun).

The node agent is replaced by an executable standing in for the agent's Python (`python:` of a
profile extending `slurmlab`) that records its argv and environment per node; the rest is real:
`hpcrl submit --via sbatch`, sbatch, slurmctld, slurmd, srun, on the test lab (3 nodes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.profile_load import load_profile
from tests.conftest import run_hpcrl, wait_until, write_exe

pytestmark = pytest.mark.lab

RECORDER = """#!{python}
import json, os, signal, sys, time
run_dir = sys.argv[-1]
node = os.environ.get("SLURM_NODEID", "x")
def stop(signum, frame):
    open(os.path.join(run_dir, "signal-" + node), "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
with open(os.path.join(run_dir, "agent-" + node + ".json"), "w") as fh:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, fh)
if os.path.exists(os.path.join(run_dir, "wait-for-signal")):
    time.sleep(60)
"""

HOSTILE = "a 'b' \"c\" $(echo d) `echo e` $HOME\\nline2 ;|&"


@pytest.fixture
def lab_env(lab, tmp_path: Path) -> dict[str, str]:
    """Environment of a submitting user of the running lab, with two test profiles."""
    sites = tmp_path / "sites"
    sites.mkdir()
    recorder = write_exe(tmp_path / "bin" / "python", RECORDER.format(python=sys.executable))
    nodes = lab.cfg.nodes
    for name, secrets in (("labcheck", "[WANDB_API_KEY, UNSET_SECRET]"), ("labnosecret", "[]")):
        (sites / f"{name}.yaml").write_text(
            f"extends: slurmlab\nrun_root: {tmp_path}/runs\npython: {recorder}\n"
            f"slurm: {{nodes: {nodes}, time: '00:02:00', cpus_per_task: 1}}\n"
            f"env: {{HOSTILE: {json.dumps(HOSTILE)}}}\nsecrets: {secrets}\n")
    env = {k: v for k, v in lab.env.items() if k not in ("WANDB_API_KEY", "UNSET_SECRET")}
    return {**env, "HPCRL_SITE_PATH": str(sites), "WANDB_API_KEY": "lab-$(secret)"}


#: The trainer's overrides the preflight checks (its default estimator, gae, needs a critic
#: micro-batch size, as verl's); the recorder stands in for the trainer and runs nothing.
CRITIC = "critic.ppo_micro_batch_size_per_gpu=4"


def wait_for(path_glob: tuple[Path, str], count: int, timeout: float = 60) -> list[Path]:
    directory, pattern = path_glob
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"only {sorted(directory.glob(pattern))} after {timeout} s")


@pytest.mark.parametrize("site", ["labcheck", "labnosecret"])
def test_every_variable_reaches_every_node(site: str, lab, lab_env: dict[str, str],
                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / f"{site} 'quoted' $(x)"
    proc = run_hpcrl(["submit", "--site", site, "--via", "sbatch", "--run-dir", str(run_dir), "--",
                      CRITIC], lab_env)
    assert proc.returncode == 0, proc.stderr
    nodes = lab.cfg.nodes
    records = wait_for((run_dir, "agent-*.json"), nodes)
    profile = load_profile(site, lab_env).profile
    for rec in records:
        data = json.loads(rec.read_text())
        assert data["argv"][-3:] == ["-m", "hpcrl.agent", str(run_dir)]
        for key, value in profile.env.items():
            assert data["env"].get(key) == value, (rec.name, key)
        assert data["env"]["HOSTILE"] == HOSTILE
        assert data["env"]["HOME"] and data["env"]["PATH"].startswith(str(tmp_path / "bin"))
        if site == "labcheck":
            assert data["env"]["WANDB_API_KEY"] == "lab-$(secret)"
        else:
            assert "WANDB_API_KEY" not in data["env"]
        assert "UNSET_SECRET" not in data["env"]
    assert "lab-$(secret)" not in (run_dir / "job.sbatch").read_text()


def test_warning_signal_is_noted_for_the_agents(lab, lab_env: dict[str, str], tmp_path: Path) -> None:
    """Slurm's warning reaches the batch shell only (`B:`); its trap writes `<run>/0/warning`,
    where the head's agent looks, and sends nothing through srun (Slurm would signal every
    process of the step, Ray's included, and kill them)."""
    run_dir = tmp_path / "runs" / "signal"
    run_dir.mkdir(parents=True)
    (run_dir / "wait-for-signal").write_text("")
    proc = run_hpcrl(["submit", "--site", "labcheck", "--via", "sbatch", "--resume",
                      "--run-dir", str(run_dir), "--", CRITIC], lab_env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split("job id: ")[1].split()[0]
    wait_for((run_dir, "agent-*.json"), lab.cfg.nodes)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, env=lab_env)
    (warning,) = wait_for((run_dir / "0", "warning"), 1, timeout=30)
    # the trap's `echo` makes the file before it writes the line (the agent needs only the file)
    wait_until(lambda: warning.read_text() != "", "the warning's line written", timeout_s=30)
    assert warning.read_text() == "USR1\n"
    time.sleep(2)
    assert list(run_dir.glob("signal-*")) == []  # no task was signalled
    subprocess.run(["scancel", job], check=True, env=lab_env)
    lab.wait_out_of_queue(int(job))  # its Ray ports and processes gone before the next test
