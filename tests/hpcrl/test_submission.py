"""Rendered batch scripts: golden files, `bash -n`, quoting of hostile values, signal forwarding,
and the MI300 environment against the reference AMD script."""

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

from hpcrl.agent.jobfile import parse_job
from hpcrl.jobspec import JobSpec, default_payload, prepare_run_dir
from hpcrl.profile_load import _sys_value, load_profile, replace_slurm
from hpcrl.profiles import ProfileError
from hpcrl.submission import (
    RequestError,
    build_request,
    dry_run_text,
    make_spec,
    submitit_script,
)
from tests.conftest import DATA, run_hpcrl, write_exe

GOLDEN = DATA / "golden"
CRITIC_MBS = "critic.ppo_micro_batch_size_per_gpu=4"
"""The default estimator (gae) trains a critic, which the preflight asks a micro-batch size of."""
SPLITS_OVER_2_AND_3 = ["data.train_batch_size=96", "actor_rollout_ref.actor.ppo_mini_batch_size=48"]
"""Mini-batches that split evenly over the 2 or 3 workers of `--nodes 2-3` (the preflight's rule)."""
FIXED_ENV = {"HOME": "/home/user", "XDG_CONFIG_HOME": "/nonexistent/config",
             "SLURM_CONF": "/etc/slurm/slurm.conf"}
PY = "/opt/hpcrl/venv/bin/python"
SITES = ["h100-cluster", "local", "mi300-cluster", "mi300-cluster-apptainer", "slurmlab",
         "slurmlab-apptainer"]
HOSTILE = ["two words", "it's", 'say "hi"', "$(touch /tmp/hpcrl-pwned)", "`touch pwned`",
           "$HOME ${PATH}", "new\nline", "back\\slash", "semi;colon && |", "*", "~", "!x",
           "--flag=1", ""]


@pytest.fixture(autouse=True)
def rootful_podman(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' podman preview as a rootful podman gives it (`--group-add=video`), whoever
    runs the tests (rootless: `keep-groups`, tests/hpcrl/test_containers.py)."""
    monkeypatch.setattr("hpcrl.runtimes.podman.rootless", lambda: False)


def request(site: str, via: str = "sbatch"):  # type: ignore[no-untyped-def]
    p = load_profile(site, FIXED_ENV).profile
    spec = make_spec(p, default_payload(p.container.python or PY,
                                        ["data.train_batch_size=8", "trainer.nnodes=2"]),
                     created=0.0)
    return build_request(p, spec, f"/scratch/runs/{site}-golden", PY, via=via)


def normalise(text: str) -> str:
    """Replace the machine-dependent paths (`${sys:...}`) by placeholders."""
    pairs = sorted([(_sys_value("source_root"), "<SOURCE_ROOT>"),
                    (_sys_value("prefix"), "<SYS_PREFIX>"),
                    (_sys_value("base_prefix"), "<SYS_BASE_PREFIX>")], key=lambda kv: -len(kv[0]))
    for real, placeholder in pairs:
        text = text.replace(real, placeholder)
    # the canary digests the resolved profile, which holds this checkout's paths
    return re.sub(r"HPCRL_CANARY=[0-9a-f]{32}", "HPCRL_CANARY=<CANARY>", text)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = normalise(text)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), (f"golden file {path} is missing; create it with "
                           "`UPDATE_GOLDEN=1 python -m pytest tests/hpcrl/test_submission.py`")
    assert text == path.read_text(), (
        f"rendered output differs from {path}; if the change is intended, regenerate with "
        "`UPDATE_GOLDEN=1 python -m pytest tests/hpcrl/test_submission.py` and review the diff")


def bash_n(text: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("site", SITES)
def test_golden_scripts_and_bash_n(site: str) -> None:
    req = request(site)
    bash_n(req.script)
    suffix = "sh" if site == "local" else "sbatch"
    check_golden(f"{site}.{suffix}", req.script)
    if site != "local":
        sub = submitit_script(request(site, via="submitit"))
        bash_n(sub)
        check_golden(f"{site}.submitit.sbatch", sub)


def test_script_has_fixed_shape() -> None:
    script = request("slurmlab").script
    for line in ["#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@30",
                 "#SBATCH --export=WANDB_API_KEY", "#SBATCH --partition=debug",
                 "#SBATCH --nodes=3", "#SBATCH --cpus-per-task=2", "trap hpcrl_warn USR1",
                 "export SLURM_EXPORT_ENV=ALL"]:
        assert line in script.splitlines(), line
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert srun.startswith('srun --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" '
                           "--kill-on-bad-exit=1 ")
    assert srun.endswith(f"{PY} -P -m hpcrl.agent /scratch/runs/slurmlab-golden &")
    assert "--gpus-per-node" not in script


def seed_names(path: Path) -> set[str]:
    text = path.read_text()
    return set(re.findall(r"^export ([A-Z_][A-Z0-9_]*)=", text, re.M)) | set(
        re.findall(r"-e ([A-Z_][A-Z0-9_]*)=", text))


def test_mi300_render_has_every_seed_variable_and_device_flag() -> None:
    req = request("mi300-cluster")
    script = req.script
    exported = set(re.findall(r"^export ([A-Z_][A-Z0-9_]*)=", script, re.M))
    names = seed_names(DATA / "seeds" / "amd_slurm_script.sh") | seed_names(
        DATA / "seeds" / "amd_rocm_env.sh")
    assert len(names) >= 25
    # the seeds pin every GPU of the node into every process and stop Ray from choosing: each
    # node exports the GPUs Slurm granted instead, and Ray gives each worker one (hpcrl.devices)
    replaced = {"HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"}
    assert replaced <= names and not replaced & exported and not req.spec.profile["ray"]["version_env"]
    # one cluster's NIC facts (`hpcrl sites new` proposes them for the HCAs it finds), a
    # setting for every communicator, an obsolete one and Megatron's (mi300-cluster.yaml says why)
    dropped = {"NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_MIN_NCHANNELS", "NCCL_CHECKS_DISABLE",
               "CUDA_DEVICE_MAX_CONNECTIONS"}
    assert dropped <= names and not dropped & exported
    missing = sorted(names - exported - replaced - dropped)
    assert not missing, f"mi300-cluster lacks {missing}"
    for exact in ["NCCL_CROSS_NIC=0", "NCCL_PROTO=Simple",
                  "RCCL_MSCCL_ENABLE=0", "HSA_NO_SCRATCH_RECLAIM=1", "GPU_MAX_HW_QUEUES=2",
                  "TORCH_NCCL_HIGH_PRIORITY=1", "HIP_FORCE_DEV_KERNARG=1",
                  "TOKENIZERS_PARALLELISM=false"]:
        assert f"\nexport {exact}\n" in script, exact
    seed = (DATA / "seeds" / "amd_slurm_script.sh").read_text()
    flags = re.findall(r"--(device|group-add|cap-add|security-opt|shm-size) (\S+)", seed)
    assert len(flags) == 7
    preview = next(ln for ln in script.splitlines() if ln.startswith("# podman run"))
    for flag, value in flags:
        assert f"--{flag}={value}" in preview, (flag, value)
    assert "--network=host" in preview and "--privileged" in seed
    assert "--privileged" not in preview  # the devices, groups and capabilities instead
    apptainer = request("mi300-cluster-apptainer").script
    assert re.search(r"^# \S*apptainer exec .*--bind /dev/kfd --bind /dev/dri", apptainer, re.M)
    assert "--rocm" not in apptainer


def hostile_site(tmp_path: Path) -> dict[str, str]:
    sites = tmp_path / "sites"
    sites.mkdir()
    env_lines = "\n".join(f"  HOSTILE_{i}: {json.dumps(v)}" for i, v in enumerate(HOSTILE))
    (sites / "hostile.yaml").write_text(
        "extends: slurmlab\n"
        "slurm:\n  job_name: \"we'ird $(job) `name`\"\n  partition: \"de-bug.2\"\n"
        f"env:\n{env_lines}\n")
    return {"HPCRL_SITE_PATH": str(sites), **FIXED_ENV}


FAKE_SRUN = """#!{python}
import json, os, sys
with open(os.environ["HPCRL_TEST_OUT"], "w") as fh:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, fh)
"""


def test_hostile_values_reach_the_step_verbatim(tmp_path: Path) -> None:
    p = load_profile("hostile", hostile_site(tmp_path)).profile
    bindir = tmp_path / "bin"
    write_exe(bindir / "srun", FAKE_SRUN.format(python=sys.executable))
    (bindir / "python").symlink_to(sys.executable)
    run_dir = tmp_path / "runs" / "a b 'c' \"d\" $(e) `f` ;g"
    payload = ["python", "-m", "trainer", *HOSTILE]
    spec = make_spec(p, payload)
    req = build_request(p, spec, str(run_dir), str(bindir / "python"), via="sbatch")
    bash_n(req.script)
    assert "#SBATCH --job-name='we'\"'\"'ird $(job) `name`-hostile'" in req.script
    prepare_run_dir(run_dir, spec)
    script = tmp_path / "job.sbatch"
    script.write_text(req.script)
    out = tmp_path / "srun.json"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                          env={"SLURM_JOB_NUM_NODES": "3", "HPCRL_TEST_OUT": str(out)},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    for i, value in enumerate(HOSTILE):
        assert seen["env"][f"HOSTILE_{i}"] == value
    assert seen["env"]["HPCRL_LAB_QUOTING"] == p.env["HPCRL_LAB_QUOTING"]
    assert seen["argv"][-5:] == [str(bindir / "python"), "-P", "-m", "hpcrl.agent", str(run_dir)]
    assert seen["argv"][:2] == ["--ntasks-per-node=1", "--nodes=3"]
    assert JobSpec.from_json((run_dir / "job.json").read_text()).payload == tuple(payload)
    assert not Path("/tmp/hpcrl-pwned").exists() and not (tmp_path / "pwned").exists()


def test_missing_job_json_stops_the_script(tmp_path: Path) -> None:
    p = load_profile("slurmlab", FIXED_ENV).profile
    req = build_request(p, make_spec(p, ["x"]), str(tmp_path / "never-prepared"), PY)
    proc = subprocess.run(["bash", "-c", req.script], capture_output=True, text=True,
                          env={"SLURM_JOB_NUM_NODES": "1"})
    assert proc.returncode == 2 and "job.json" in proc.stderr and "is missing" in proc.stderr


FAKE_SRUN_WAITS = """#!{python}
import os, sys, time
marker = os.environ["HPCRL_TEST_OUT"]
warning = sys.argv[-1] + "/" + os.environ["HPCRL_RESTART"] + "/warning"
open(marker + ".ready", "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(warning) and time.monotonic() < deadline:
    time.sleep(0.02)
open(marker, "w").write(open(warning).read() if os.path.exists(warning) else "none")
sys.exit(7)
"""


def test_warning_signal_is_noted_for_the_agents_not_sent_through_srun(tmp_path: Path) -> None:
    """The script claims the next free run directory `<run>/<N>/` (an earlier job's `0/` and
    `1/` are left alone, whatever `SLURM_RESTART_COUNT` says) and exports `HPCRL_RESTART=N` to the
    step; the trap writes `<run>/<N>/warning` (where the head's agent looks); the step is not
    signalled (srun would pass the signal to every process of the step, Ray's included)."""
    p = load_profile("slurmlab", FIXED_ENV).profile
    bindir = tmp_path / "bin"
    write_exe(bindir / "srun", FAKE_SRUN_WAITS.format(python=sys.executable))
    run_dir = tmp_path / "run"
    spec = make_spec(p, ["x"])
    prepare_run_dir(run_dir, spec)
    req = build_request(p, spec, str(run_dir), str(bindir / "python"))
    for earlier in ("0", "1"):  # an earlier job's runs, its stop request among them
        (run_dir / earlier).mkdir()
        (run_dir / earlier / "stop.json").write_text("{}")
    marker = tmp_path / "marker"
    env = {"SLURM_JOB_NUM_NODES": "1", "SLURM_RESTART_COUNT": "0", "HPCRL_TEST_OUT": str(marker)}
    batch = subprocess.Popen(["bash", "-c", req.script], text=True, env=env)
    deadline = time.monotonic() + 20
    while not Path(f"{marker}.ready").exists():
        assert time.monotonic() < deadline and batch.poll() is None, "fake srun did not start"
        time.sleep(0.02)
    batch.send_signal(signal.SIGUSR1)
    assert batch.wait(timeout=40) == 7  # the step's own exit status comes back
    assert marker.read_text() == "USR1\n"
    assert (run_dir / "2").stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in (run_dir / "2").iterdir()) == ["warning"]
    assert not (run_dir / "0" / "warning").exists() and not (run_dir / "1" / "warning").exists()


@pytest.mark.parametrize("field, value", [("--partition", "a\nb"), ("--time", "1\n2"),
                                          ("--run-dir", "/tmp/x%j")])
def test_values_that_would_break_the_script_are_refused(field: str, value: str,
                                                       clean_env: dict[str, str]) -> None:
    proc = run_hpcrl(["render", "--site", "slurmlab", "--no-prepare", field, value, "--", "a=1"],
                     clean_env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("hpcrl: error:") and proc.stderr.count("\n") == 1


def test_a_module_planted_in_the_working_directory_is_not_imported(tmp_path: Path) -> None:
    """The job's node agent command (`-P`), run from a directory holding a planted `yaml.py`
    (the submit directory, or a run directory others could write): the planted module is not
    imported. The same command without `-P` imports it, so the check can fail."""
    from hpcrl.submission import agent_argv

    (tmp_path / "yaml.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\n")
    run_dir = tmp_path / "run"  # no job.json: the agent stops after its imports
    argv = agent_argv(sys.executable, str(run_dir))
    assert argv[1] == "-P"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert not (tmp_path / "pwned").exists()
    subprocess.run([a for a in argv if a != "-P"], cwd=tmp_path, env=env, capture_output=True,
                   timeout=120)
    assert (tmp_path / "pwned").exists(), "without -P the planted module is imported"


@pytest.mark.parametrize("name", ["a:b", "x,y", "c:/etc:rw"])
def test_bind_separators_in_the_run_directory_are_refused(name: str, tmp_path: Path,
                                                          clean_env: dict[str, str]) -> None:
    """`:` and `,` in the run directory would add bind mounts; nothing is created."""
    run_dir = tmp_path / name
    proc = run_hpcrl(["render", "--site", "slurmlab", "--run-dir", str(run_dir), "--", "a=1"],
                     clean_env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert f"run directory {str(run_dir)!r} contains `" in proc.stderr
    assert "would add other bind mounts. Fix: choose a `--run-dir`" in proc.stderr
    assert not run_dir.exists() and not (tmp_path / name.split(":")[0]).exists()


def test_render_cli_prepares_run_dir_and_prints_script(tmp_path: Path,
                                                       clean_env: dict[str, str]) -> None:
    run_dir = tmp_path / "r"
    proc = run_hpcrl(["render", "--site", "slurmlab", "--nodes", "2", "--time", "5",
                      "--partition", "high", "--run-dir", str(run_dir), "--",
                      "trainer.total_epochs=1", CRITIC_MBS], clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --time=5" in proc.stdout
    assert "#SBATCH --partition=high" in proc.stdout
    bash_n(proc.stdout)
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    spec = JobSpec.from_json((run_dir / "job.json").read_text())
    assert spec.nodes == 2 and spec.payload[1:] == ("-m", "trainer", "trainer.total_epochs=1", CRITIC_MBS)
    assert spec.profile["slurm"]["partition"] == "high"
    again = run_hpcrl(["render", "--site", "slurmlab", "--run-dir", str(run_dir), "--", CRITIC_MBS], clean_env)
    assert again.returncode == 2 and "not empty" in again.stderr and "--resume" in again.stderr
    same = ["render", "--site", "slurmlab", "--nodes", "2", "--time", "5", "--partition", "high",
            "--run-dir", str(run_dir), "--resume"]
    resumed = run_hpcrl(same, clean_env)  # no overrides after `--`: the job's own
    assert resumed.returncode == 0, resumed.stderr
    assert JobSpec.from_json((run_dir / "job.json").read_text()) == spec
    bare = run_hpcrl(["render", "--site", "slurmlab", "--run-dir", str(run_dir), "--resume"], clean_env)
    assert bare.returncode == 0, bare.stderr  # no flags either: the job's own `--nodes`, `--time`, `--partition`
    assert "#SBATCH --nodes=2" in bare.stdout and "#SBATCH --time=5" in bare.stdout, bare.stdout
    assert JobSpec.from_json((run_dir / "job.json").read_text()) == spec
    assert ("hpcrl: note: `--resume` keeps the job's `slurm.nodes` 2, `slurm.min_nodes` 2, `slurm.time` 5, "
            "`slurm.partition` high, not the profile's") in bare.stderr, bare.stderr
    changed = run_hpcrl([*same[:3], "--time", "7", *same[7:], "--", "trainer.total_epochs=2", CRITIC_MBS],
                        clean_env)
    assert changed.returncode == 2 and changed.stdout == "", changed.stderr
    errors = [line for line in changed.stderr.splitlines() if line.startswith("hpcrl: error:")]
    assert len(errors) == 1 and "`profile.slurm.time` `\"5\"` -> `\"7\"`" in \
        changed.stderr and "`partition`" not in errors[0] and "`nodes`" not in errors[0], changed.stderr
    assert ("`payload` drops `trainer.total_epochs=1` and adds `trainer.total_epochs=2`"
            in changed.stderr and "--update-spec" in changed.stderr)
    assert JobSpec.from_json((run_dir / "job.json").read_text()) == spec  # kept
    updated = run_hpcrl([*same[:3], "--time", "7", *same[7:], "--update-spec", "--",
                         "trainer.total_epochs=2", CRITIC_MBS], clean_env)
    assert updated.returncode == 0, updated.stderr
    now = JobSpec.from_json((run_dir / "job.json").read_text())
    assert now.profile["slurm"]["time"] == "7" and now.payload[-2:] == ("trainer.total_epochs=2", CRITIC_MBS)


def test_a_node_range_lets_the_trainer_run_on_the_nodes_granted(tmp_path: Path,
                                                                clean_env: dict[str, str]) -> None:
    """`--nodes MIN-MAX`: sbatch asks for MAX (Slurm would grant MIN for a range), the agent
    knows MIN, the trainer takes its node count from the allocation; a fixed `trainer.nnodes`,
    a reversed range or a word is refused, nothing made."""
    run_dir = tmp_path / "r"
    proc = run_hpcrl(["render", "--site", "slurmlab", "--nodes", "2-3", "--run-dir", str(run_dir),
                      "--", "trainer.total_epochs=1", CRITIC_MBS, *SPLITS_OVER_2_AND_3], clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=3\n" in proc.stdout
    spec = JobSpec.from_json((run_dir / "job.json").read_text())
    assert spec.nodes == 3 and spec.profile["slurm"]["min_nodes"] == 2
    assert spec.payload[-1] == "trainer.nnodes=${oc.env:HPCRL_NUM_NODES}"
    # the launcher reads it as the agent will give it (the nodes asked for), leaving no trace
    from hpcrl.runreport import payload_overrides

    assert payload_overrides(run_dir)["trainer.nnodes"] == 3
    assert "HPCRL_NUM_NODES" not in os.environ
    assert spec.payload_start == "head-alive"
    assert parse_job(json.loads((run_dir / "job.json").read_text())).min_nodes == 2
    p = load_profile("slurmlab", FIXED_ENV).profile
    for args, error in (
            (["--nodes", "2-3", "--", "trainer.nnodes=3"],
             "`trainer.nnodes=3` fixes the trainer's nodes, but the job may resume on 2-3 nodes"),
            (["--nodes", "3-2"], "`--nodes 3-2`: a job needs at least 1 node (and MIN at most MAX)"),
            (["--nodes", "two"], "`--nodes two` is not a node count; use `N` or `MIN-MAX`")):
        bad = run_hpcrl(["render", "--site", "slurmlab", "--run-dir", str(tmp_path / "bad"),
                         *args], clean_env)
        assert bad.returncode == 2 and error in bad.stderr, bad.stderr
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ProfileError, match=r"slurm.min_nodes.*between 1 and `slurm.nodes` \(2\)"):
        replace_slurm(p, nodes=2, min_nodes=3)


def test_local_site_renders_and_dry_runs() -> None:
    req = request("local")
    assert req.via == "local" and "#SBATCH" not in req.script and "srun" not in req.script
    assert f"{PY} -P -m hpcrl.agent /scratch/runs/local-golden" in req.script
    assert "# via: local" in dry_run_text(req)


def test_template_rejects_undefined_values() -> None:
    import jinja2

    from hpcrl.templates import render_template

    with pytest.raises(jinja2.UndefinedError):
        render_template("job.sbatch.j2", site="x")


def test_request_rejects_relative_python_and_bad_via() -> None:
    p = load_profile("slurmlab", FIXED_ENV).profile
    spec = make_spec(p, ["x"])
    with pytest.raises(RequestError, match="absolute"):
        build_request(p, spec, "/r", "python3")
    with pytest.raises(RequestError, match="valid: submitit, sbatch"):
        build_request(p, spec, "/r", PY, via="qsub")


FAKE_SRUN_SH = """#!/bin/bash
printf '%s' "$ANY_VALUE" > "$HPCRL_TEST_OUT"
"""


def test_any_value_survives_the_script(tmp_path: Path) -> None:
    """Property: whatever text a profile variable holds, the step receives exactly that."""
    import dataclasses
    import types

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = load_profile("slurmlab", FIXED_ENV).profile
    bindir = tmp_path / "bin"
    write_exe(bindir / "srun", FAKE_SRUN_SH)
    run_dir = tmp_path / "run"
    spec = make_spec(base, ["x"])
    prepare_run_dir(run_dir, spec)
    out = tmp_path / "value"

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                          blacklist_characters="\x00"), max_size=40))
    def check(value: str) -> None:
        p = dataclasses.replace(base, env=types.MappingProxyType({"ANY_VALUE": value}))
        req = build_request(p, spec, str(run_dir), str(bindir / "python"))
        proc = subprocess.run(["bash", "-c", req.script], capture_output=True,
                              env={"SLURM_JOB_NUM_NODES": "1", "HPCRL_TEST_OUT": str(out),
                                   "LANG": "C.UTF-8"})
        assert proc.returncode == 0, proc.stderr
        assert out.read_bytes().decode("utf-8", "surrogateescape") == value

    check()
