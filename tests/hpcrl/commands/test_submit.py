"""`hpcrl submit` through sbatch and submitit, dry runs, bad profiles, status/logs/cancel.

The one faked seam is Slurm's client executables: `sbatch`, `squeue`, `scontrol` and `scancel`
are small scripts first on PATH that record their arguments and print real Slurm output kept in
`tests/data/slurm/` (submitit's own tests fake the same `sbatch` seam). Everything else runs for
real: the CLI in a fresh process, submitit's executor, the run directory, `job.json`.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from hpcrl.jobspec import JobSpec
from tests.conftest import DATA, run_hpcrl, write_exe

#: The critic's micro-batch, which the trainer (as verl) requires of its default estimator, gae.
CRITIC = "critic.ppo_micro_batch_size_per_gpu=4"
SECRET = "wandb-s3cr3t-$(value)"

FAKE_SLURM = """#!{python}
import json, os, shutil, sys
log = os.environ["FAKE_SLURM_LOG"]
name = os.path.basename(sys.argv[0])
record = {{"tool": name, "argv": sys.argv[1:]}}
if name == "sbatch":
    script = sys.argv[-1]
    record["script"] = open(script).read()
    record["secret_in_env"] = os.environ.get("WANDB_API_KEY")
with open(log, "a") as fh:
    fh.write(json.dumps(record) + "\\n")
# FAKE_<TOOL>_SILENT=N: the first N calls fail as against a dead controller (text on stderr)
silent = int(os.environ.get("FAKE_" + name.upper() + "_SILENT", "0"))
if silent:
    with open(log) as fh:
        earlier = sum(json.loads(line)["tool"] == name for line in fh) - 1
    if earlier < silent:
        sys.stderr.write(open(os.environ["FAKE_SILENT_TEXT"]).read())
        sys.exit(1)
fixture = os.environ.get("FAKE_" + name.upper())
if fixture:
    sys.stdout.write(open(fixture).read())
sys.exit(int(os.environ.get("FAKE_" + name.upper() + "_RC", "0")))
"""


@pytest.fixture
def slurm(tmp_path: Path, clean_env: dict[str, str]) -> dict[str, str]:
    """`clean_env` with fake Slurm tools first on PATH; their calls go to FAKE_SLURM_LOG."""
    bindir = tmp_path / "fakebin"
    for tool in ("sbatch", "srun", "squeue", "scontrol", "scancel"):
        write_exe(bindir / tool, FAKE_SLURM.format(python=sys.executable))
    env = dict(clean_env)
    env["PATH"] = f"{bindir}:{env['PATH']}"
    env["FAKE_SLURM_LOG"] = str(tmp_path / "slurm-calls.jsonl")
    env["FAKE_SBATCH"] = str(DATA / "slurm" / "sbatch_output.txt")
    env["WANDB_API_KEY"] = SECRET
    return env


def calls(env: dict[str, str], tool: str | None = None) -> list[dict]:  # type: ignore[type-arg]
    log = Path(env["FAKE_SLURM_LOG"])
    if not log.exists():
        return []
    rows = [json.loads(ln) for ln in log.read_text().splitlines()]
    return [r for r in rows if tool is None or r["tool"] == tool]


def all_text_under(path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in path.rglob("*")
                     if p.is_file() and p.suffix != ".pkl")


def test_submit_via_sbatch(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "runs" / "one"
    proc = run_hpcrl(["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir",
                      str(run_dir), "--", CRITIC, "trainer.total_epochs=1"], slurm)
    assert proc.returncode == 0, proc.stderr
    assert "job id: 4" in proc.stdout and f"run directory: {run_dir}" in proc.stdout
    assert f"log (batch): {run_dir}/logs/slurm-4.out" in proc.stdout
    assert f"log (node N): {run_dir}/logs/4-nodeN.out" in proc.stdout
    (call,) = calls(slurm, "sbatch")
    assert call["argv"] == ["--export=WANDB_API_KEY", f"{run_dir}/job.sbatch"]
    assert call["secret_in_env"] == SECRET  # reaches sbatch through its environment only
    assert call["script"] == (run_dir / "job.sbatch").read_text()
    spec = JobSpec.from_json((run_dir / "job.json").read_text())
    assert spec.secrets == ("WANDB_API_KEY",) and spec.nodes == 3
    assert spec.payload[-1] == "trainer.total_epochs=1"
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    assert ((run_dir / "job.json").stat().st_mode & 0o777) == 0o600
    assert SECRET not in all_text_under(run_dir) and SECRET not in proc.stdout + proc.stderr
    sub = json.loads((run_dir / "submission.json").read_text())
    assert sub["job_id"] == "4" and sub["via"] == "sbatch"


def test_submit_via_submitit_submits_what_dry_run_prints(tmp_path: Path,
                                                        slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "runs" / "two"
    args = ["submit", "--site", "slurmlab-apptainer", "--nodes", "2", "--run-dir", str(run_dir),
            "--", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", CRITIC]
    dry = run_hpcrl(["submit", "--dry-run", *args[1:]], slurm)
    assert dry.returncode == 0, dry.stderr
    assert not run_dir.exists() and calls(slurm) == []  # a dry run creates and submits nothing
    proc = run_hpcrl(args, slurm)
    assert proc.returncode == 0, proc.stderr
    assert "job id: 4" in proc.stdout
    assert f"log (node N): {run_dir}/submitit/4_N_log.out" in proc.stdout
    (call,) = calls(slurm, "sbatch")
    printed = dry.stdout.split("# ---- batch script ----\n", 1)[1]
    assert call["script"] == printed  # exactly what the dry run printed
    assert "#SBATCH --nodes=2" in printed and "#SBATCH --requeue" in printed
    assert "#SBATCH --signal=B:USR1@30" in printed and "trap '' USR1" in printed and "#SBATCH --export=WANDB_API_KEY" in printed
    pickled = next((run_dir / "submitit").glob("*_submitted.pkl"))
    with pickled.open("rb") as fh:
        delayed = pickle.load(fh)
    import hpcrl

    assert delayed.function is hpcrl.agent_entry and delayed.args == (str(run_dir),)
    assert SECRET not in all_text_under(run_dir)


def test_dry_run_via_sbatch_prints_script_and_command(tmp_path: Path,
                                                      slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "r"
    proc = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "mi300-cluster",
                      "--run-dir", str(run_dir), "--", CRITIC, "trainer.total_epochs=1"], slurm)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"# command: sbatch --export=WANDB_API_KEY,HF_TOKEN {run_dir}/job.sbatch" in out
    assert '"payload": [' in out and "#SBATCH --gpus-per-node=8" in out
    assert not run_dir.exists() and calls(slurm) == []


@pytest.mark.parametrize("body, needle", [
    ("extends: slurmlab\nslurm: {partitionn: x}\n", "unknown key `slurm.partitionn`"),
    ("extends: slurmlab\nslurm: {nodes: '3'}\n", "`slurm.nodes` must be a integer"),
    ("extends: slurmlab\ncontainer: {image: null}\n", "`container.image` is missing"),
])
def test_bad_profile_submits_nothing(tmp_path: Path, slurm: dict[str, str], body: str,
                                     needle: str) -> None:
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "broken.yaml").write_text(body)
    env = {**slurm, "HPCRL_SITE_PATH": str(sites)}
    for via in ("sbatch", "submitit"):
        proc = run_hpcrl(["submit", "--site", "broken", "--via", via, "--", "x=1"], env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
        assert str(sites / "broken.yaml") in proc.stderr
    assert calls(slurm) == []
    assert not Path(slurm["HPCRL_LAB_RUN_ROOT"]).exists()


def test_existing_run_dir_refused_then_resumed(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "precious.txt").write_text("keep me")
    args = ["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir", str(run_dir)]
    proc = run_hpcrl([*args, "--", CRITIC], slurm)
    assert proc.returncode == 2 and "not empty" in proc.stderr and calls(slurm) == []
    assert (run_dir / "precious.txt").read_text() == "keep me"
    assert run_hpcrl([*args, "--resume", "--", CRITIC], slurm).returncode == 0
    assert len(calls(slurm, "sbatch")) == 1 and (run_dir / "precious.txt").exists()


def test_resume_of_a_missing_run_dir_is_refused_naming_the_nearby_ones(
        tmp_path: Path, slurm: dict[str, str]) -> None:
    """A mistyped `--resume --run-dir` must not start a new run from step 0 in a new directory."""
    runs = tmp_path / "runs"
    for name in ("try1", "try2"):
        (runs / name).mkdir(parents=True)
        (runs / name / "job.json").write_text("{}")
    (runs / "notarun").mkdir()
    typo = runs / "tyr2"
    proc = run_hpcrl(["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir", str(typo),
                      "--resume"], slurm)
    assert proc.returncode == 2, proc.stderr
    assert f"run directory `{typo}` does not exist" in proc.stderr
    assert f"run directories in `{runs}`: try" in proc.stderr and "notarun" not in proc.stderr
    assert "try1" in proc.stderr and "try2" in proc.stderr
    assert not typo.exists() and calls(slurm) == []
    elsewhere = tmp_path / "nowhere" / "run"
    proc = run_hpcrl(["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir",
                      str(elsewhere), "--resume"], slurm)
    assert proc.returncode == 2 and "does not exist either" in proc.stderr, proc.stderr
    assert not elsewhere.parent.exists()


def test_sbatch_failure_is_reported_and_leaves_no_job_to_resume(tmp_path: Path,
                                                                 slurm: dict[str, str]) -> None:
    """A submission sbatch refuses leaves no `job.json` that a later `--resume` would run: a
    new run directory is removed, a resumed one gets its `job.json` back."""
    failing = {**slurm, "FAKE_SBATCH_RC": "1"}
    run_dir = tmp_path / "r"
    for via in ("sbatch", "submitit"):
        proc = run_hpcrl(["submit", "--site", "slurmlab", "--via", via, "--run-dir",
                          str(run_dir), "--", CRITIC, "trainer.total_epochs=1"], failing)
        assert proc.returncode == 2 and "hpcrl: error:" in proc.stderr, proc.stderr
        assert not run_dir.exists()
    args = ["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir", str(run_dir)]
    assert run_hpcrl([*args, "--", CRITIC, "trainer.total_epochs=1"], slurm).returncode == 0
    job = (run_dir / "job.json").read_text()
    proc = run_hpcrl([*args, "--resume", "--update-spec", "--", CRITIC, "trainer.total_epochs=2"],
                     failing)
    assert proc.returncode == 2 and "failed with status 1" in proc.stderr, proc.stderr
    assert (run_dir / "job.json").read_text() == job


def test_resume_is_one_job_per_run_directory_and_keeps_the_jobs_spec(
        tmp_path: Path, slurm: dict[str, str]) -> None:
    """`--resume` is refused while the run's job is queued or running (`squeue`), naming it;
    once Slurm no longer lists it, a new job is submitted with the job's own overrides (none
    given after `--`); other overrides are refused, naming the change, unless `--update-spec`."""
    run_dir = tmp_path / "run"
    args = ["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir", str(run_dir)]
    assert run_hpcrl([*args, "--", CRITIC, "trainer.total_epochs=1"], slurm).returncode == 0
    job = (run_dir / "job.json").read_text()
    for fixture, state in (("squeue_running.txt", "RUNNING"), ("squeue_pending.txt", "PENDING")):
        queued = {**slurm, "FAKE_SQUEUE": str(DATA / "slurm" / fixture)}
        proc = run_hpcrl([*args, "--resume"], queued)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert f"job 4 of `{run_dir}` is still {state} (`squeue`)" in proc.stderr
        assert "hpcrl cancel 4" in proc.stderr and proc.stderr.count("\n") == 1
    assert len(calls(slurm, "sbatch")) == 1 and (run_dir / "job.json").read_text() == job
    assert calls(slurm, "squeue")[0]["argv"][:3] == ["-h", "-j", "4"]
    gone = {**slurm, "FAKE_SQUEUE": str(DATA / "slurm" / "scontrol_unknown.txt"),
            "FAKE_SQUEUE_RC": "1"}
    changed = run_hpcrl([*args, "--resume", "--", CRITIC, "trainer.total_epochs=5"], gone)
    assert changed.returncode == 2 and len(calls(slurm, "sbatch")) == 1, changed.stderr
    assert ("`payload` drops `trainer.total_epochs=1` and adds `trainer.total_epochs=5`"
            in changed.stderr and "`--update-spec`" in changed.stderr)
    resumed = run_hpcrl([*args, "--resume"], gone)
    assert resumed.returncode == 0, resumed.stderr
    assert (run_dir / "job.json").read_text() == job
    script = calls(slurm, "sbatch")[-1]["script"]
    assert "until mkdir -m 700 " in script and "export HPCRL_RESTART" in script
    updated = run_hpcrl([*args, "--resume", "--update-spec", "--", CRITIC, "trainer.total_epochs=5"],
                        gone)
    assert updated.returncode == 0, updated.stderr
    assert JobSpec.from_json((run_dir / "job.json").read_text()).payload[-1] == \
        "trainer.total_epochs=5"


def test_default_run_dir_is_new_under_run_root(slurm: dict[str, str]) -> None:
    proc = run_hpcrl(["submit", "--site", "slurmlab", "--via", "sbatch", "--", CRITIC], slurm)
    assert proc.returncode == 0, proc.stderr
    (made,) = Path(slurm["HPCRL_LAB_RUN_ROOT"]).iterdir()
    assert made.name.startswith("slurmlab-") and (made / "job.json").is_file()


def test_command_payload(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "cmd"
    proc = run_hpcrl(["render", "--site", "slurmlab", "--command", "--run-dir", str(run_dir),
                      "--", "env", "-0"], slurm)
    assert proc.returncode == 0, proc.stderr
    assert JobSpec.from_json((run_dir / "job.json").read_text()).payload == ("env", "-0")


def test_local_site_dry_run(tmp_path: Path, slurm: dict[str, str], tiny_model_dir: Path) -> None:
    inputs = [f"actor_rollout_ref.model.path={tiny_model_dir}",
              f"data.train_files={DATA / 'gsm8k_train_sample.parquet'}",
              f"data.val_files={DATA / 'gsm8k_test_sample.parquet'}"]
    proc = run_hpcrl(["submit", "--dry-run", "--run-dir", str(tmp_path / "l"), "--",
                      CRITIC, "trainer.total_epochs=1", *inputs], slurm)
    assert proc.returncode == 0, proc.stderr
    assert "# via: local" in proc.stdout and "-m hpcrl.agent" in proc.stdout
    assert "hpcrl: preflight passed" in proc.stderr
    assert calls(slurm) == []


@pytest.mark.parametrize("how", [["submit", "--dry-run"], ["submit"], ["render"]])
def test_submit_its_dry_run_and_render_give_one_verdict(tmp_path: Path, slurm: dict[str, str], how: list[str]) -> None:
    """The same preflight everywhere: a local job whose model is not there, and a local job of
    2 nodes, are refused by the dry run and by render as by the submission itself, before
    anything is created."""
    run_dir = tmp_path / "v"
    missing = run_hpcrl([*how, "--run-dir", str(run_dir), "--", CRITIC], slurm)
    assert missing.returncode == 2 and "`actor_rollout_ref.model.path` (its default" in missing.stderr, missing.stderr
    two = run_hpcrl([*how, "--nodes", "2", "--run-dir", str(run_dir), "--", CRITIC], slurm)
    assert two.returncode == 2 and "`--nodes 2` on site `local`" in two.stderr, two.stderr
    assert not run_dir.exists() and calls(slurm) == []


def test_a_dry_run_refuses_what_the_submission_would(tmp_path: Path,
                                                   slurm: dict[str, str]) -> None:
    """A dry run says whether the trainer would take the job: an override it refuses fails the
    dry run as it fails the submission (nothing printed as if it would run, nothing created);
    a data file this host does not have is a warning, since it may exist on the cluster."""
    run_dir = tmp_path / "r"
    base = ["submit", "--dry-run", "--site", "slurmlab", "--nodes", "3", "--run-dir",
            str(run_dir), "--", CRITIC]
    refused = run_hpcrl([*base, "actor_rollout_ref.rollout.name=sglang"], slurm)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("hpcrl: error:") and "SGLang rollout" in refused.stderr
    uneven = run_hpcrl([*base, "trainer.nnodes=3",
                        "data.train_batch_size=96", "actor_rollout_ref.actor.ppo_mini_batch_size=48",
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], slurm)
    assert uneven.returncode == 2 and "must divide the 3 ranks" in uneven.stderr, uneven.stderr
    elsewhere = run_hpcrl([*base, "data.train_files=/cluster/only/train.parquet"], slurm)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "#SBATCH --nodes=3" in elsewhere.stdout
    assert "hpcrl: warning: unchecked:" in elsewhere.stderr and "/cluster/only/train.parquet" in elsewhere.stderr
    assert not run_dir.exists() and calls(slurm) == []


def submitted_run(tmp_path: Path, slurm: dict[str, str]) -> Path:
    run_dir = tmp_path / "followed"
    assert run_hpcrl(["submit", "--site", "slurmlab", "--via", "sbatch", "--run-dir",
                      str(run_dir), "--", CRITIC], slurm).returncode == 0
    (run_dir / "logs" / "slurm-4.out").write_text("batch line\n")
    (run_dir / "logs" / "4-node0.out").write_text("head line\n")
    (run_dir / "logs" / "4-node1.out").write_text("worker line\n")
    return run_dir


def scontrol_fixture(tmp_path: Path, run_dir: Path) -> str:
    """The real `scontrol show job` output, pointed at `run_dir`."""
    text = (DATA / "slurm" / "scontrol_show_job_running.txt").read_text()
    text = text.replace("/tmp/hpcrl-minival/runs/sig", str(run_dir)).replace("JobId=2", "JobId=4")
    path = tmp_path / "scontrol.txt"
    path.write_text(text)
    return str(path)


def test_status_logs_cancel_by_job_id(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = submitted_run(tmp_path, slurm)
    env = {**slurm, "FAKE_SCONTROL": scontrol_fixture(tmp_path, run_dir),
           "FAKE_SQUEUE": str(DATA / "slurm" / "squeue_running.txt")}
    status = run_hpcrl(["status", "4"], env)
    assert status.returncode == 0, status.stderr
    assert "JobState: RUNNING" in status.stdout and "RUNNING elapsed 0:03 of 2:00" in status.stdout
    logs = run_hpcrl(["logs", "4"], env)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.index("batch line") < logs.stdout.index("head line") < logs.stdout.index(
        "worker line")
    one = run_hpcrl(["logs", "4", "--node", "1"], env)
    assert one.stdout == "worker line\n"
    by_dir = run_hpcrl(["logs", str(run_dir), "--node", "0"], slurm)
    assert by_dir.stdout == "head line\n"
    cancel = run_hpcrl(["cancel", "4"], env)  # running: a checkpoint first, through its agent
    assert cancel.returncode == 0 and "asked job 4 to checkpoint and stop" in cancel.stdout
    assert json.loads((run_dir / "cancel.json").read_text())["job_id"] == "4"
    assert calls(slurm, "scancel") == []
    assert ["show", "job", "4"] in [c["argv"] for c in calls(slurm, "scontrol")]
    now = run_hpcrl(["cancel", "--now", "4"], env)
    assert now.returncode == 0 and "cancelled job 4" in now.stdout
    assert calls(slurm, "scancel")[-1]["argv"] == ["4"]


def test_unknown_job_and_bad_job_id(tmp_path: Path, slurm: dict[str, str]) -> None:
    env = {**slurm, "FAKE_SCONTROL": str(DATA / "slurm" / "scontrol_unknown.txt"),
           "FAKE_SCONTROL_RC": "1"}
    proc = run_hpcrl(["logs", "999"], env)
    assert proc.returncode == 2 and "does not know job 999" in proc.stderr
    bad = run_hpcrl(["cancel", "4;rm"], env)
    assert bad.returncode == 2 and "is not a Slurm job id" in bad.stderr
    assert calls(slurm, "scancel") == []


def test_slurm_not_answering_is_not_a_finished_job(tmp_path: Path, slurm: dict[str, str]) -> None:
    """`status`, `cancel` and `logs` tell "Slurm did not answer" (real messages of a dead and a
    hung slurmctld) from "the job is gone", and retry with back-off before saying so."""
    run_dir = submitted_run(tmp_path, slurm)
    down = {**slurm, "FAKE_SQUEUE_SILENT": "99", "FAKE_SCONTROL_SILENT": "99",
            "FAKE_SILENT_TEXT": str(DATA / "slurm" / "scontrol_controller_down.txt"),
            "HPCRL_SLURM_PATIENCE_S": "0"}
    status = run_hpcrl(["status", str(run_dir)], down)
    assert status.returncode == 0, status.stderr
    assert "Slurm did not answer `squeue -h -j 4" in status.stdout
    assert "Unable to contact slurm controller" in status.stdout
    assert "no longer known" not in status.stdout and "followed: not started" in status.stdout
    for argv in (["cancel", "4"], ["logs", "4"]):
        proc = run_hpcrl(argv, down)
        assert proc.returncode == 2 and "Slurm did not answer" in proc.stderr, proc.stderr
        assert "does not know job" not in proc.stderr
    assert calls(slurm, "scancel") == []
    unknown = str(DATA / "slurm" / "scontrol_unknown.txt")  # what both print for a gone job
    gone = {**slurm, "FAKE_SCONTROL": unknown, "FAKE_SCONTROL_RC": "1",
            "FAKE_SQUEUE": unknown, "FAKE_SQUEUE_RC": "1"}
    assert "job 4 is no longer known" in run_hpcrl(["status", str(run_dir)], gone).stdout


def test_slurm_queries_retry_with_back_off(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = submitted_run(tmp_path, slurm)
    hung = {**slurm, "FAKE_SCONTROL": scontrol_fixture(tmp_path, run_dir),
            "FAKE_SQUEUE": str(DATA / "slurm" / "squeue_running.txt"),
            "FAKE_SQUEUE_SILENT": "2",
            "FAKE_SILENT_TEXT": str(DATA / "slurm" / "squeue_controller_timeout.txt"),
            "HPCRL_SLURM_PATIENCE_S": "10"}
    status = run_hpcrl(["status", "4"], hung)
    assert status.returncode == 0, status.stderr
    assert "RUNNING elapsed 0:03 of 2:00" in status.stdout  # the third try was answered
    assert len(calls(slurm, "squeue")) == 3


@pytest.mark.parametrize(("flags", "message"), [
    (["--run-dir", "/proc/hpcrl-cannot-exist/run"], "cannot create the run directory"),
    (["--run-dir", ""], "`--run-dir` is empty"),
    (["--partition", "debug; rm -rf ~"], "key `slurm.partition` must be Slurm names"),
    (["--nodes", "0"], "a job needs at least 1 node"),
    (["--time", "soon"], "is not a Slurm time"),
])
def test_wrong_but_plausible_flags_are_refused_creating_nothing(
        tmp_path: Path, slurm: dict[str, str], flags: list[str], message: str) -> None:
    for command in (["submit", "--via", "sbatch"], ["render"]):
        proc = run_hpcrl([*command, "--site", "slurmlab", *flags, "--", CRITIC], slurm)
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]  # after the preflight's warnings, if any
        assert last.startswith("hpcrl: error: ") and message in last, proc.stderr
        assert "Traceback" not in proc.stderr
    assert calls(slurm) == [] and not Path(slurm["HPCRL_LAB_RUN_ROOT"]).exists()


def test_a_damaged_submission_file_is_named(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = submitted_run(tmp_path, slurm)
    (run_dir / "submission.json").write_text("{}")
    for command in ("logs", "cancel"):
        proc = run_hpcrl([command, str(run_dir)], slurm)
        assert proc.returncode == 2 and "submission.json` is damaged" in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", [["submit", "--dry-run"], ["submit"], ["render"]])
def test_resume_needs_an_existing_run_dir_everywhere(tmp_path: Path, slurm: dict[str, str], how: list[str]) -> None:
    bare = run_hpcrl([*how, "--site", "slurmlab", "--resume"], slurm)
    assert bare.returncode == 2 and "`--resume` needs `--run-dir RUN`" in bare.stderr, bare.stderr
    gone = run_hpcrl([*how, "--site", "slurmlab", "--resume", "--run-dir", str(tmp_path / "nowhere")], slurm)
    assert gone.returncode == 2 and "does not exist, so there is nothing to resume" in gone.stderr, gone.stderr
    assert not (tmp_path / "nowhere").exists() and calls(slurm) == []
