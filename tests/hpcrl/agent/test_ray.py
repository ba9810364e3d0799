"""The node agent with real Ray on this machine: two local jobs at once."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "ray", reason="the agent tests start real Ray clusters (`pip install hpcrl[train]`)"
)

pytestmark = pytest.mark.slow

from hpcrl import runstate  # noqa: E402
from tests.hpcrl.agent.agent_helpers import leftovers, make_run, start_agent, wait_for_text  # noqa: E402


@pytest.fixture(scope="module")
def two_local_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two local jobs at once: A checks token refusal and exits 3; B (with the dashboard on)
    probes the dashboard and waits for SIGUSR1."""
    root = tmp_path_factory.mktemp("agents")
    run_a = make_run(root, f"ja{os.getpid()}", {"PAYLOAD_EXIT": "3", "PAYLOAD_CHECK_REFUSAL": "1"})
    run_b = make_run(
        root,
        f"jb{os.getpid()}",
        {"PAYLOAD_WAIT_USR1": "1", "PAYLOAD_PROBE_DASHBOARD": "1"},
        dashboard=True,
    )
    a = start_agent(run_a, {"HPCRL_JOB_ID": run_a.name})
    b = start_agent(run_b, {"HPCRL_JOB_ID": run_b.name})
    wait_for_text(run_b / "0" / "logs" / "payload.log", "waiting for SIGUSR1", 120)
    b.send_signal(signal.SIGUSR1)
    out_b, _ = b.communicate(timeout=60)
    out_a, _ = a.communicate(timeout=120)
    return {"a": (run_a, a.returncode, out_a), "b": (run_b, b.returncode, out_b)}


def test_exit_status_is_the_payloads(two_local_jobs: dict) -> None:
    run_a, code_a, out_a = two_local_jobs["a"]
    run_b, code_b, out_b = two_local_jobs["b"]
    assert code_a == 3, out_a
    assert code_b == 42, out_b  # the warning SIGUSR1 became the payload's stop request
    assert "asking the payload to checkpoint and stop (SIGUSR2)" in out_b


def test_payload_connected_with_explicit_address_and_ran_a_task(two_local_jobs: dict) -> None:
    for run, _, out in two_local_jobs.values():
        log = (run / "0" / "logs" / "payload.log").read_text()
        assert "payload: 1 alive nodes" in log and "one task ran on each of 1 nodes" in log
        info = json.loads((run / "0" / "rendezvous.json").read_text())
        env_line = [ln for ln in log.splitlines() if "MASTER_ADDR=" in ln][0]
        assert f"MASTER_ADDR={info['address']}" in env_line
        assert "1/1 nodes joined" in out


def test_driver_without_token_is_refused(two_local_jobs: dict) -> None:
    run, _, _ = two_local_jobs["a"]
    log = (run / "0" / "logs" / "payload.log").read_text()
    assert "driver without token: refused: ConnectionError" in log


def test_jobs_use_disjoint_ports(two_local_jobs: dict) -> None:
    blocks = []
    for run, _, _ in two_local_jobs.values():
        info = json.loads((run / "0" / "rendezvous.json").read_text())
        ports = info["ports"]
        blocks.append(
            set(ports.values()) | set(range(ports["min_worker_port"], ports["max_worker_port"] + 1))
        )
    assert not blocks[0] & blocks[1]


def test_token_is_private_and_never_logged(two_local_jobs: dict) -> None:
    for run, _, out in two_local_jobs.values():
        token_path = run / "0" / "token"
        token = token_path.read_text()
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert token not in out
        for f in run.rglob("*"):
            if f.is_file() and f != token_path:
                assert token not in f.read_text(errors="replace"), f


def test_nothing_left_behind_and_summary_written(two_local_jobs: dict) -> None:
    for run, code, _ in two_local_jobs.values():
        assert leftovers(run) == []
        summary = (run / "0" / "summary.txt").read_text().splitlines()
        assert summary[0].startswith(f"job {run.name} restart 0: payload exited with status {code}")
        assert summary[1].startswith("node ") and "(rank 0)" in summary[1]
        assert (run / "0" / "logs" / f"ray-0-{os.uname().nodename}" / "raylet.out").exists()


def test_state_file_tells_the_run_in_order(two_local_jobs: dict) -> None:
    """The head's state lines, in the order of the run's phases, give what `hpcrl status`
    shows: the nodes that joined, the payload's exit status and the summary's headline."""
    for run, code, _ in two_local_jobs.values():
        events = [r["event"] for r in runstate.read_state(run, 0)]
        phases = [runstate.AGENT_STARTED, runstate.NODES_JOINED, runstate.PAYLOAD_STARTED,
                  runstate.PAYLOAD_EXITED, runstate.RUN_ENDED, runstate.TEARDOWN_DONE]
        assert [e for e in events if e in phases and e != runstate.NODES_JOINED] == [
            p for p in phases if p != runstate.NODES_JOINED]
        assert events.index(runstate.NODES_JOINED) < events.index(runstate.PAYLOAD_STARTED)
        info = runstate.read_restart(run, 0)
        assert (info.nodes_joined, info.nodes_total, info.exit_code) == (1, 1, code)
        summary = (run / "0" / "summary.txt").read_text().splitlines()
        assert info.ended == summary[0]


def test_dashboard_only_on_loopback(two_local_jobs: dict) -> None:
    run, _, _ = two_local_jobs["b"]
    info = json.loads((run / "0" / "rendezvous.json").read_text())
    log = (run / "0" / "logs" / "payload.log").read_text()
    assert "dashboard on 127.0.0.1 open" in log
    assert f"dashboard on {info['address']} closed" in log


def test_sigterm_during_ray_startup_ends_cleanly(tmp_path: Path) -> None:
    """SIGTERM while `ray start` is still starting (when it ignores SIGTERM): the agent falls
    back to SIGKILL of the Ray process group and leaves nothing behind."""
    run = make_run(tmp_path, f"jt{os.getpid()}", {})
    agent = start_agent(run, {"HPCRL_JOB_ID": run.name})
    wait_for_text(
        run / "0" / "logs" / f"agent-0-{os.uname().nodename}.log", "starting Ray head", 60
    )
    time.sleep(1.0)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 143, out
    assert "SIGTERM before the payload started" in out
    assert not (run / "0" / "logs" / "payload.log").exists()
    assert leftovers(run) == []


def test_every_process_goes_through_the_container_seam(tmp_path: Path) -> None:
    """Runtime `podman` with an injected command builder that runs the command through
    `/usr/bin/env`: Ray, the GCS watch and the payload all go through it, with the run and temp
    directories bound, auth settings passed as container variables, and their own names."""
    from hpcrl.agent.core import Agent
    from hpcrl.slurm_env import job_context

    everywhere_expected = {"gcs", "node_manager", "object_manager", "dashboard_agent_grpc", "autoscaler_metric",
                           "dashboard_metric"}
    run = make_run(tmp_path, f"jc{os.getpid()}", {"PAYLOAD_EXIT": "5", "PAYLOAD_CHECK_JOB_TOKEN": "1", "PAYLOAD_LIST_LISTENERS": "1",
                                                  "PAYLOAD_LIST_LISTENERS_AWAIT": ",".join(sorted(everywhere_expected))})
    job = json.loads((run / "job.json").read_text())
    job["profile"]["container"] = {"runtime": "podman", "image": "img", "binary": "true"}
    (run / "job.json").write_text(json.dumps(job))
    calls: list[tuple] = []

    def wrap(job, argv, env, binds, workdir, name):
        calls.append((list(argv), dict(env), list(binds), workdir, name))
        return ["/usr/bin/env", *argv], {"ADDED_BY_RUNTIME": "1"}

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "HPCRL_"))}
    # a token inherited from the submitting environment: Ray would prefer it to the job's file
    base = tempfile.mkdtemp(prefix="hrt", dir="/tmp")  # the job's TMPDIR (short: Ray's sockets)
    env = {**clean, "HPCRL_JOB_ID": run.name, "RAY_AUTH_TOKEN": "0" * 32, "TMPDIR": base}
    agent = Agent(run, env=env, wrap=wrap, context=job_context(env))
    assert agent.run() == 5, (run / "0" / "logs" / "payload.log").read_text()
    names = [c[4] for c in calls]
    assert names == [
        f"hr-{run.name}-0-0-ray",
        f"hr-{run.name}-0-0-watch",
        f"hr-{run.name}-0-0-payload",
    ]
    tmp = calls[0][2][1]  # private: made by mkdtemp under TMPDIR, an unguessable name
    assert re.fullmatch(rf"{base}/hr-{run.name}-0-0-[A-Za-z0-9_]{{8}}", tmp), tmp
    assert not os.path.exists(tmp) and os.listdir(base) == []  # removed at the teardown
    os.rmdir(base)
    for _argv, cenv, binds, _workdir, _ in calls:
        assert binds == [str(run.resolve()), tmp]
        assert cenv["RAY_AUTH_MODE"] == "token"
        assert "RAY_AUTH_TOKEN" not in cenv
        assert cenv["RAY_AUTH_TOKEN_PATH"] == str(run.resolve() / "0" / "token")
    ray_argv, _, _, ray_workdir, _ = calls[0]
    assert "start" in ray_argv and ray_workdir == tmp
    payload_argv, payload_env, _, payload_workdir, _ = calls[2]
    assert payload_argv == job["payload"] and payload_workdir == str(run.resolve())
    assert payload_env["RAY_ADDRESS"].endswith(
        str(json.loads((run / "0" / "rendezvous.json").read_text())["ports"]["gcs"])
    )
    log = (run / "0" / "logs" / "payload.log").read_text()
    assert "one task ran on each of 1 nodes" in log
    assert "driver with the job's token file: accepted with the job token file (no " \
        "RAY_AUTH_TOKEN)" in log
    # The reach of the job's ports, as `hpcrl.agent.launch.NO_METRICS_ENV` states it.
    listeners = set(re.findall(r"payload: listener (\w+) (\S+):\d+", log))
    everywhere = {name for name, host in listeners if host in ("*", "0.0.0.0", "[::]")}
    assert everywhere == everywhere_expected, listeners
    assert "metrics_export" not in {name for name, _ in listeners}
    assert leftovers(run) == []
