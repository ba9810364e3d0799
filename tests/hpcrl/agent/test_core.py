"""Agent behaviour that needs no Ray: entry point, early failures, the container seam."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpcrl import rundir, runstate
from hpcrl.agent import core, node
from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.jobfile import parse_job

REPO = Path(__file__).resolve().parents[3]


def run_agent(run: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "HPCRL_"))}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.agent", str(run)],
        cwd=REPO,
        env={**clean, "HPCRL_JOB_ID": "t-core", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hpcrl.agent"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and "usage: python -m hpcrl.agent RUN_DIR" in result.stderr


def test_missing_job_file_fails_fast_and_tells_the_others(tmp_path: Path) -> None:
    result = run_agent(tmp_path)
    assert result.returncode == 1
    assert "cannot read" in result.stderr and "job.json" in result.stderr
    stop = json.loads((tmp_path / "0" / "stop.json").read_text())
    assert stop["rank"] == 0 and "JobFileError" in stop["reason"]
    assert "exit 1" in (tmp_path / "0" / "summary.txt").read_text()
    events = [(r["event"], r["rank"]) for r in runstate.read_state(tmp_path, 0)]
    assert events == [("agent_started", 0), ("run_ended", 0), ("teardown_done", 0)]
    info = runstate.read_restart(tmp_path, 0)
    assert "JobFileError" in str(info.ended) and runstate.restart_state(info) == "failed"


def test_run_dir_missing_on_this_node(tmp_path: Path) -> None:
    result = run_agent(tmp_path / "elsewhere")
    assert result.returncode == 1 and "does not exist on node" in result.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_an_earlier_jobs_run_is_left_alone(tmp_path: Path) -> None:
    """The issue of a `--resume` after `scancel`: the new job's agent, given the run index of an
    earlier job's run (here by hand: `HPCRL_RESTART=0`), refuses before it writes anything
    there; it never reads that job's stop request as its own."""
    earlier = rundir.RunPaths(tmp_path, 0)
    rdv.create_run_dirs(earlier, "node1")
    runstate.StateWriter(tmp_path, 0, 0, "node1").append(runstate.AGENT_STARTED, pid=1, nodes=1,
                                                        job_id="41")
    rdv.request_stop(earlier, 0, "node1", "payload exited with status 3 after the stop request")
    before = sorted(p.name for p in earlier.root.rglob("*"))
    state = rundir.RunDir(tmp_path).state.read_text()
    result = run_agent(tmp_path, {"HPCRL_RESTART": "0"})
    assert result.returncode == 1, result.stderr
    assert "holds the run of job 41, not of this job t-core" in result.stderr
    assert sorted(p.name for p in earlier.root.rglob("*")) == before
    assert rundir.RunDir(tmp_path).state.read_text() == state


def test_canary_mismatch_stops_before_ray(tmp_path: Path) -> None:
    rdv.write_canary(tmp_path)
    (tmp_path / "job.json").write_text(json.dumps({"payload": ["true"]}))
    result = run_agent(tmp_path, {rdv.CANARY_ENV: "f" * 32})
    assert result.returncode == 1 and "sees a different" in result.stderr
    assert "starting Ray" not in result.stderr


def test_bad_profile_key_is_named(tmp_path: Path) -> None:
    job = {"payload": ["true"], "profile": {"agent": {"grace": 1}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    result = run_agent(tmp_path)
    assert result.returncode == 1 and "`grace`" in result.stderr and "grace_s" in result.stderr
    assert "starting Ray" not in result.stderr


def test_runtime_none_runs_argv_as_is() -> None:
    job = parse_job({"payload": ["x"]})
    assert core.container_wrap(job, ["ray", "start"], {"A": "1"}, [], "/w", "n") == (
        ["ray", "start"],
        {"A": "1"},
    )


def test_other_runtimes_go_through_hpcrl_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def container_command(container, argv, env, *, passthrough, binds, workdir, name):
        calls.append((container, list(argv), dict(env), passthrough, list(binds), workdir, name))
        return types.SimpleNamespace(argv=("podman", "run", "img", *argv), env={"X": "1"})

    monkeypatch.setattr(node, "container_command", container_command)
    monkeypatch.setattr(node, "profile_from_dict", lambda d: types.SimpleNamespace(container=d["container"]))
    job = parse_job(
        {
            "payload": ["x"],
            "secrets": ["WANDB_API_KEY"],
            "profile": {"container": {"runtime": "podman", "image": "img"}},
        }
    )
    argv, env = core.container_wrap(job, ["python3", "x.py"], {"A": "1"}, ["/run"], "/w", "hr-1")
    assert argv == ["podman", "run", "img", "python3", "x.py"] and env == {"X": "1"}
    assert calls == [
        (
            {"runtime": "podman", "image": "img"},
            ["python3", "x.py"],
            {"A": "1"},
            ("WANDB_API_KEY",),
            ["/run"],
            "/w",
            "hr-1",
        )
    ]


def test_import_stays_light() -> None:
    code = "import sys, hpcrl.agent.core, hpcrl.agent.__main__; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_node_temp_dirs_are_private_and_unguessable(tmp_path: Path) -> None:
    """`mkdtemp` under the job's `TMPDIR` (mode 0700, a random name: another user can neither
    guess nor create it first); `/tmp` when `TMPDIR` is unset, relative, missing, or too long
    for Ray's socket paths."""
    from hpcrl.slurm_env import job_context

    ctx = job_context({"HPCRL_JOB_ID": "77"})
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="hrt", dir="/tmp"))  # short, as Ray's sockets need
    try:
        first = node.make_node_tmp(ctx, {"TMPDIR": str(base)})
        second = node.make_node_tmp(ctx, {"TMPDIR": str(base)})
        assert first != second and first.parent == base == second.parent
        assert first.name.startswith("hr-77-0-0-") and len(first.name) == len("hr-77-0-0-") + 8
        assert first.stat().st_mode & 0o777 == 0o700 and first.stat().st_uid == os.getuid()
    finally:
        shutil.rmtree(base)
    long = tmp_path / ("x" * node.TMP_BASE_MAX)
    long.mkdir()
    for environ in ({}, {"TMPDIR": "rel"}, {"TMPDIR": str(tmp_path / "gone")}, {"TMPDIR": str(long)}):
        assert node.temp_base(environ) == Path("/tmp")
