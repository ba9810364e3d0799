"""The head agent's stop and requeue path: the batch script's warning note, the agent's own clock
and SIGTERM become a stop request to the payload; its requeue status makes the agent requeue the
job from the host (`scontrol requeue`, the one seam faked here), bounded by `max_requeues`.

The pure decisions are tested alone; the end-to-end cases run the real agent with real Ray on
this machine, in a Slurm environment whose only fake is the `scontrol` executable."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from hpcrl import runstate
from hpcrl.agent import requeue as rq
from hpcrl.agent.jobfile import JobFileError, load_job, parse_job
from hpcrl.agent.requeuer import Requeuer
from hpcrl.agent.stop import Deadline, SignalInbox, StopControl
from hpcrl.rundir import RunPaths
from hpcrl.slurm import SlurmError, parse_scontrol_show_job, parse_slurm_time
from hpcrl.slurm_env import job_context
from tests.conftest import DATA, write_exe
from tests.hpcrl.agent.agent_helpers import leftovers, start_agent, wait_for_text

PAYLOAD = Path(__file__).resolve().parents[2] / "payloads" / "stop_payload.py"
HOST = socket.gethostname()

FAKE_SCONTROL = """#!{python}
import json, os, sys, time
with open(os.environ["FAKE_SCONTROL_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "job"]:
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(float(os.environ["FAKE_END_TIME"])))
    print(f"JobId={{sys.argv[3]}} JobName=t\\n   JobState=RUNNING Reason=None Dependency=(null)\\n"
          f"   StartTime=2026-01-01T00:00:00 EndTime={{end}} Deadline=N/A")
elif sys.argv[1] == "requeue" and os.environ.get("FAKE_REQUEUE_ERROR"):
    print(os.environ["FAKE_REQUEUE_ERROR"], file=sys.stderr)
    sys.exit(1)
"""


def slurm_env(job_id: str, restart: int = 0, **extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": HOST, "SLURM_NODEID": "0",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_RESTART_COUNT": str(restart), **extra}
    return env if restart else {k: v for k, v in env.items() if k != "SLURM_RESTART_COUNT"}


# ------------------------------------------------------------------------------ pure parts


def test_requeue_target_names_the_array_task() -> None:
    plain = job_context(slurm_env("41"), hostname=lambda: HOST)
    array = job_context(slurm_env("57", SLURM_ARRAY_JOB_ID="50", SLURM_ARRAY_TASK_ID="7"),
                        hostname=lambda: HOST)
    assert rq.requeue_target(plain) == "41"
    assert rq.requeue_target(array) == "50_7"


def test_decide_requeue() -> None:
    first = job_context(slurm_env("41"), hostname=lambda: HOST)
    last = job_context(slurm_env("41", restart=2), hostname=lambda: HOST)
    local = job_context({"HPCRL_JOB_ID": "x"}, hostname=lambda: HOST)
    assert rq.decide_requeue(first, 2, "/r").action == rq.REQUEUE
    assert "restart 1 of at most 2" in rq.decide_requeue(first, 2, "/r").message
    done = rq.decide_requeue(last, 2, "/r")
    assert done.action == rq.MAX_REACHED
    assert "max_requeues reached" in done.message and "checkpoint is intact" in done.message
    assert "--resume --run-dir /r" in done.message
    assert rq.decide_requeue(first, 0, "/r").action == rq.MAX_REACHED
    assert rq.decide_requeue(first, 2, "/r", terminated_by="SIGTERM").action == rq.ENDED_BY_SLURM
    assert rq.decide_requeue(local, 2, "/r").action == rq.NO_SLURM


def test_preemption_within_grace_time_is_recognised() -> None:
    """Real `scontrol show job` records: a task's view during a GraceTime preemption (still
    RUNNING, PreemptTime set: Slurm will not requeue a job that ends now) and right after an
    external `scontrol requeue` (COMPLETING)."""
    grace = parse_scontrol_show_job(
        (DATA / "slurm" / "scontrol_show_job_preempted_grace.txt").read_text())
    requeued = parse_scontrol_show_job(
        (DATA / "slurm" / "scontrol_show_job_requeued.txt").read_text())
    running = parse_scontrol_show_job(
        (DATA / "slurm" / "scontrol_show_job_running.txt").read_text())
    assert rq.preempted_in_grace(grace)
    assert not rq.preempted_in_grace(requeued) and not rq.preempted_in_grace(running)
    ctx = job_context(slurm_env("3", restart=5), hostname=lambda: HOST)
    decision = rq.decide_requeue(ctx, 2, "/r", terminated_by="SIGTERM", preempted=True)
    assert decision.action == rq.REQUEUE and "grace time" in decision.message


def test_already_requeued_is_recognised() -> None:
    # what `scontrol requeue` prints for a job Slurm is already requeueing (preemption)
    assert rq.already_requeued("Job is pending execution for job 9")
    assert not rq.already_requeued("Invalid job id specified")


def test_caught_signals_from_proc_status() -> None:
    """A real `/proc/<pid>/status` of a Python process handling SIGUSR2 and SIGTERM."""
    caught = rq.caught_signals((DATA / "proc_status_trainer.txt").read_text())
    assert {signal.SIGUSR2, signal.SIGTERM} <= caught and signal.SIGUSR1 not in caught
    assert rq.caught_signals("Name: x\n") == set()


def test_end_time_from_scontrol_and_the_warning_clock() -> None:
    info = parse_scontrol_show_job((DATA / "slurm" / "scontrol_show_job_running.txt").read_text())
    end = parse_slurm_time(info["EndTime"])
    start = parse_slurm_time(info["StartTime"])
    assert end is not None and start is not None and end - start == 120  # TimeLimit=00:02:00
    assert parse_slurm_time("Unknown") is None and parse_slurm_time("N/A") is None
    grace = rq.CLOCK_GRACE_S
    assert not rq.warning_due(end, 30, end - 30 + grace - 0.5) and rq.warning_due(end, 30, end - 30 + grace)
    assert not rq.warning_due(None, 30, end)
    assert rq.end_time_from_env({rq.END_TIME_ENV: "123.5"}) == 123.5
    assert rq.end_time_from_env({rq.END_TIME_ENV: "soon"}) is None


def test_job_file_reads_requeue_settings() -> None:
    job = parse_job({"payload": ["x"], "max_requeues": 4,
                     "profile": {"slurm": {"signal": "sigusr1", "signal_lead_s": 45},
                                 "agent": {"stop_signal": "TERM"}}})
    assert (job.max_requeues, job.warning_signal, job.signal_lead_s, job.stop_signal) == (
        4, "USR1", 45.0, "TERM")
    with pytest.raises(JobFileError, match="`max_requeues` is -1"):
        parse_job({"payload": ["x"], "max_requeues": -1})
    with pytest.raises(JobFileError, match="not a signal name"):
        parse_job({"payload": ["x"], "profile": {"agent": {"stop_signal": "NOPE"}}})


def _requeuer(tmp_path: Path, restart: int, max_requeues: int, nodes: int = 1,
              min_nodes: int | None = None) -> Requeuer:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({"payload": ["x"], "max_requeues": max_requeues,
                                              "nodes": nodes,
                                              "profile": {"slurm": {"min_nodes": min_nodes}}}))
    env = slurm_env("77", restart=restart, SLURM_JOB_NUM_NODES=str(nodes),
                    SLURM_JOB_NODELIST=",".join([HOST] * nodes))
    ctx = job_context(env, hostname=lambda: HOST)
    job = load_job(run)
    log = logging.getLogger("test-requeue")
    inbox, deadline = SignalInbox(), Deadline(None)
    stop = StopControl(job, RunPaths(run, restart), inbox, deadline, log)
    return Requeuer(ctx, job, run, inbox, log, stop, deadline)


def test_requeue_seam_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision names the target; the requeue runs once (after the teardown, or at once
    near the end); Slurm already requeueing the job is no error; another failure is reported;
    with `max_requeues` reached the seam is never called."""
    requeuer = _requeuer(tmp_path, restart=0, max_requeues=1)
    calls: list[str] = []

    def pending(target: str) -> None:
        calls.append(target)
        raise SlurmError("`scontrol requeue 77` failed with status 1: Job is pending execution")

    monkeypatch.setattr(requeuer, "requeue", pending)
    out = requeuer.after_request("payload exited with status 3", 3)
    assert calls == [] and "requeueing job 77 (restart 1 of at most 1)" in out.cause
    assert out.then is not None  # deferred until after the teardown
    assert out.then() == "Slurm is already requeueing job 77" and calls == ["77"]
    requeuer.deadline.end_time = time.time() + 5  # too near the end to wait for the teardown
    out = requeuer.after_request("payload exited with status 3", 3)
    assert calls == ["77", "77"] and "Slurm is already requeueing job 77" in out.cause
    assert out.then is None  # done already: the teardown does not requeue again
    monkeypatch.setattr(requeuer, "requeue",
                        lambda t: (_ for _ in ()).throw(SlurmError("refused")))
    assert "could not requeue job 77: refused" in requeuer.after_request("x", 3).cause
    done = _requeuer(tmp_path / "b", restart=1, max_requeues=1)
    monkeypatch.setattr(done, "requeue", lambda t: calls.append(t))
    out = done.after_request("payload exited with status 3", 3)
    assert out.then is None and "max_requeues reached" in out.cause
    assert out.exit_code == 3 and calls == ["77", "77"]


def test_exclusions_keep_the_users_and_add_the_lost_nodes() -> None:
    assert rq.merged_exclusions("(null)", ["node3"]) == "node3"
    assert rq.merged_exclusions("", ["node3", "node3"]) == "node3"
    assert rq.merged_exclusions("gpu[01-04],login2", ["gpu07", "gpu09"]) == "gpu[01-04],login2,gpu07,gpu09"


def test_lost_nodes_requeue_the_job_then_exclude_them_once_pending(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision reads the job's exclusions while it runs; after the teardown the job is
    requeued first and then excluded (Slurm refuses `ExcNodeList` for a running job); a failed
    exclusion says how to do it by hand; with `max_requeues` reached nothing is called."""
    import hpcrl.agent.requeuer as requeuer_mod

    requeuer = _requeuer(tmp_path, restart=0, max_requeues=2)
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(requeuer_mod, "show_job", lambda job: {"ExcNodeList": "node[7-8]"})
    monkeypatch.setattr(requeuer, "requeue", lambda t: calls.append(("requeue", t)))
    monkeypatch.setattr(rq, "scontrol_exclude",
                        lambda t, n, c=None: calls.append(("exclude", t, n)))
    out = requeuer.after_node_loss(["node2"], "payload exited with status 1")
    assert "node `node2` died" in out.cause and "`ExcNodeList=node[7-8],node2`" in out.cause
    assert out.then is None  # at once: Slurm would requeue it without the exclusion otherwise
    assert out.cause.endswith("set `ExcNodeList=node[7-8],node2`")
    assert calls == [("requeue", "77"), ("exclude", "77", "node[7-8],node2")]
    decided = [r for r in runstate.read_state(tmp_path / "run") if r["event"] == runstate.REQUEUE_DECIDED]
    assert decided[-1]["lost_nodes"] == ["node2"] and decided[-1]["exclude"] == "node[7-8],node2"

    def refused(target: str, nodes: str, count: int | None = None) -> None:
        raise SlurmError("Job is no longer pending execution")

    monkeypatch.setattr(rq, "scontrol_exclude", refused)
    done = requeuer.after_node_loss(["node2"], "x").cause
    assert "could not exclude node[7-8],node2" in done
    assert "`scontrol update JobId=77 ExcNodeList=node[7-8],node2` while it is pending" in done
    spent = _requeuer(tmp_path / "b", restart=2, max_requeues=2)
    monkeypatch.setattr(spent, "requeue", lambda t: calls.append(("requeue", t)))
    out = spent.after_node_loss(["node2"], "x")
    assert out.then is None and "max_requeues reached" in out.cause and len(calls) == 3


def test_the_node_loss_message_says_what_happened_to_each_node() -> None:
    """A node the trainer's watchdog blamed, or one cut off, is not called dead; one without a
    word is."""
    decision = rq.RequeueDecision(rq.REQUEUE, "requeueing job 77 (restart 1 of at most 3)")
    text = rq.node_loss_message(["node2", "node3"], decision, "node2,node3",
                                why={"node2": "holds a stuck rank"})
    assert text.startswith("node `node2` holds a stuck rank; node `node3` died; requeueing job 77 "
                           "(restart 1 of at most 3), excluding `node2`, `node3` (`ExcNodeList=node2,node3`)"), text
    assert rq.node_loss_message(["node2"], decision, "node2").startswith("node `node2` died; requeueing")


# ------------------------------------------------------------------------------ real agent


def make_job(root: Path, name: str, env: dict[str, str], max_requeues: int = 2,
             lead_s: int = 30) -> Path:
    run = root / name
    run.mkdir(parents=True)
    job = {"version": 1, "site": "t", "nodes": 1, "max_requeues": max_requeues,
           "profile": {"network": {"interface": None, "family": "auto"},
                       "container": {"runtime": "none"}, "env": env,
                       "slurm": {"signal": "USR1", "signal_lead_s": lead_s, "max_requeues": 9}},
           "payload": [sys.executable, str(PAYLOAD)]}
    (run / "job.json").write_text(json.dumps(job))
    return run


def fake_slurm(tmp_path: Path, end_time: float, **extra: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    write_exe(bindir / "scontrol", FAKE_SCONTROL.format(python=sys.executable))
    return {"PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_SCONTROL_LOG": str(tmp_path / "calls"),
            "FAKE_END_TIME": str(end_time), **extra}


def calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_warning_note_stops_the_payload_and_the_agent_requeues(tmp_path: Path) -> None:
    """The batch script's note -> SIGUSR2 to the payload -> status 3 -> `scontrol requeue ID`."""
    end = float(int(time.time()) + 600)  # Slurm prints whole seconds
    run = make_job(tmp_path, f"w{os.getpid()}", {})
    agent = start_agent(run, {**slurm_env(f"9{os.getpid()}"), **fake_slurm(tmp_path, end)})
    wait_for_text(run / "0" / "logs" / "payload.log", "payload: end time", 120)
    (run / "0" / "warning").write_text("USR1\n")  # what the batch script's trap writes
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 3, out
    assert json.loads((run / "stopped.json").read_text()) == {
        "signals": ["SIGUSR2"], "end_time": f"{end:.0f}"}
    assert ["requeue", f"9{os.getpid()}"] in calls(tmp_path)
    assert calls(tmp_path)[0][:2] == ["show", "job"]  # end time read from Slurm first
    summary = (run / "0" / "summary.txt").read_text()
    assert "Slurm's time-limit warning reached the batch script" in summary
    assert f"requeued job 9{os.getpid()} with `scontrol requeue` (restart 1 of at most 2)" in summary
    state = {r["event"]: r for r in runstate.read_state(run, 0)}
    assert state["stop_requested"]["reason"] == "Slurm's time-limit warning reached the batch script"
    assert state["payload_exited"]["status"] == 3
    assert state["requeue_decided"]["action"] == "requeue" and state["requeue_decided"]["deferred"]
    assert state["requeue_done"]["message"].startswith(f"requeued job 9{os.getpid()} with")
    assert runstate.read_restart(run, 0).requeue == state["requeue_done"]["message"]
    assert leftovers(run) == []


@pytest.mark.slow
def test_agent_clock_stops_an_array_task_without_any_signal(tmp_path: Path) -> None:
    """No warning arrives (submitit's case): the end time minus the lead does it; the array task
    is requeued by `<array job>_<task>`."""
    run = make_job(tmp_path, f"c{os.getpid()}", {}, lead_s=5)
    env = slurm_env(f"8{os.getpid()}", SLURM_ARRAY_JOB_ID="600", SLURM_ARRAY_TASK_ID="3")
    agent = start_agent(run, {**env, **fake_slurm(tmp_path, time.time() + 30)})
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 3, out
    assert ["requeue", "600_3"] in calls(tmp_path)
    assert "(the warning is due 5 s before)" in out and "SIGUSR2" in out
    assert (run / "stopped.json").exists()


@pytest.mark.slow
def test_sigterm_stops_the_payload_but_slurm_decides_the_requeue(tmp_path: Path) -> None:
    """SIGTERM (preemption, `scontrol requeue`, `scancel`): the payload checkpoints, and the agent
    does not requeue (a cancelled job must stay cancelled; Slurm requeues preempted jobs)."""
    run = make_job(tmp_path, f"t{os.getpid()}", {})
    agent = start_agent(run, {**slurm_env(f"7{os.getpid()}"),
                              **fake_slurm(tmp_path, time.time() + 600)})
    wait_for_text(run / "0" / "logs" / "payload.log", "payload: end time", 120)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 3, out
    assert json.loads((run / "stopped.json").read_text())["signals"] == ["SIGTERM"]
    assert not [c for c in calls(tmp_path) if c[0] == "requeue"]
    assert "Slurm ended the job" in (run / "0" / "summary.txt").read_text()
    assert leftovers(run) == []


def test_a_requeue_without_a_spare_node_shrinks_the_job_as_far_as_min_nodes_allows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slurm.min_nodes`: the job keeps its node count when idle nodes make up for the lost
    ones, and asks for fewer (never below the minimum) when they do not; the idle nodes are
    Slurm's (`sinfo`, the one faked seam) less the job's exclusions."""
    assert rq.shrunk_nodes(3, lost=1, spares=1, min_nodes=2) is None
    assert rq.shrunk_nodes(3, lost=1, spares=0, min_nodes=2) == 2
    assert rq.shrunk_nodes(4, lost=3, spares=0, min_nodes=2) == 2
    assert rq.shrunk_nodes(3, lost=1, spares=0, min_nodes=None) is None
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    write_exe(bin_dir / "sinfo", f"#!/bin/sh\necho \"$*\" >> {log}\nprintf 'node4\\nnode5\\n'\n")
    write_exe(bin_dir / "scontrol", f"#!/bin/sh\necho \"$*\" >> {log}\n"
              "[ \"$1 $2\" = 'show hostnames' ] && printf 'node2\\nnode5\\n'\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert rq.idle_spares("debug", "node[2,5]") == 1  # node4
    assert log.read_text().splitlines() == ["-h -N -t idle -p debug -o %N",
                                            "show hostnames node[2,5]"]
    import hpcrl.agent.requeuer as requeuer_mod

    monkeypatch.setattr(requeuer_mod, "show_job",
                        lambda job: {"ExcNodeList": "node5", "Partition": "debug",
                                     "NumCPUs": "6"})
    write_exe(bin_dir / "sinfo", "#!/bin/sh\nprintf 'node5\\n'\n")  # the excluded one only
    requeuer = _requeuer(tmp_path / "a", restart=0, max_requeues=2, nodes=3, min_nodes=2)
    calls: list[tuple] = []
    monkeypatch.setattr(requeuer, "requeue", lambda t: calls.append(("requeue", t)))
    monkeypatch.setattr(rq, "scontrol_exclude", lambda *a: calls.append(("exclude", *a)))
    out = requeuer.after_node_loss(["node2"], "x")
    assert "on 2 nodes instead of 3 (no spare node was free" in out.cause
    # tasks and CPUs shrink with the nodes, else Slurm calls the job never runnable
    resize = ["NumNodes=2-2", "NumTasks=2", "NumCPUs=4"]
    assert out.cause.endswith(f"set `ExcNodeList=node5,node2` and `{' '.join(resize)}`")
    assert calls == [("requeue", "77"), ("exclude", "77", "node5,node2", resize)]
    write_exe(bin_dir / "sinfo", "#!/bin/sh\nprintf 'node4\\nnode5\\n'\n")  # node4 is spare
    out = requeuer.after_node_loss(["node2"], "x")
    assert "on the nodes Slurm gives it next" in out.cause
    assert calls[-1] == ("exclude", "77", "node5,node2", ())
    requeuer.inbox.noted.append(signal.SIGTERM)  # Slurm requeued it itself (a node marked down)
    out = requeuer.after_node_loss(["node2"], "x")
    assert "not requeueing job 77: SIGTERM arrived meanwhile" in out.cause
    assert calls[-1] == ("exclude", "77", "node5,node2", ()) and len(calls) == 5


def test_the_sigterm_note_says_the_grace_and_what_a_kill_would_redo(tmp_path: Path) -> None:
    """At SIGTERM the head says how long Slurm leaves (`KillWait`) and, should the save not
    make it, where the next run resumes and how many steps it redoes."""
    from hpcrl.agent.stop import sigterm_note

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "global_step_5"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 5, "files": {}}))
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 9)))
    note = sigterm_note(run, 30)
    assert "Slurm kills every process left KillWait (30 s) later" in note
    assert "after its current step (step 9)" in note
    assert "resumes from the newest checkpoint, step 5, and redoes 4 step(s)" in note
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    note = sigterm_note(fresh, None)
    assert "Slurm's KillWait" in note and "no checkpoint yet: the start, and redoes 1 step(s)" in note


def test_a_cancel_request_counts_only_for_the_job_it_names(tmp_path: Path) -> None:
    """`RUN/cancel.json` written by `hpcrl cancel` for job 77: job 77's head acts on it, the
    next job of the run directory (`--resume`: another id) does not; a damaged file is none."""
    from hpcrl.agent.stop import cancel_request

    paths = RunPaths(tmp_path, 0)
    assert cancel_request(paths, "77") is None
    paths.cancel.write_text(json.dumps({"job_id": "77", "by": "ann@login1"}))
    assert cancel_request(paths, "77") == "`hpcrl cancel` by ann@login1"
    assert cancel_request(paths, "78") is None
    paths.cancel.write_text("{not json")
    assert cancel_request(paths, "77") is None
