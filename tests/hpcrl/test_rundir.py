"""Reading a run directory (restarts, node states, metrics, checkpoints) and printing progress
from it: the files are written here exactly as the node agent and the trainer write them."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from hpcrl import rundir, runreport, runstate
from hpcrl.progress import Progress, RunWatcher, eta_seconds, waiting_text
from hpcrl.runreport import format_duration, format_step
from tests.conftest import DATA, run_hpcrl

HOST = socket.gethostname()


def record(step: int, restart: int = 0, total: int = 6, reward: float = 0.1) -> dict:
    return {"step": step, "critic/score/mean": reward, "actor/kl_loss": 0.01 * step,
            "actor/entropy": 3.9 - 0.1 * step, "response_length/mean": 7.5,
            "timing_s/step": 2.0, "training/total_steps": total, "training/restart": restart}


def write_metrics(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def make_restart(run: Path, index: int, *, joined: int = 1, total: int = 1, payload: bool = True,
                 exit_code: int | None = 0, pid: int | None = None, job: str = "local-1",
                 host: str = HOST, start: str | None = None) -> None:
    """`RUN/<index>/` and the state lines of that run as the head's agent leaves them (written
    with the agent's own writer); the agent's log is for people and read by no command."""
    paths = rundir.RunPaths(run, index)
    paths.nodes.mkdir(parents=True)
    paths.logs.mkdir()
    head = runstate.StateWriter(run, index, 0, host)
    head.append(runstate.AGENT_STARTED, pid=pid or os.getpid(), nodes=total, job_id=job,
                **({"start": start} if start else {}))
    for n in range(joined + 1):
        head.append(runstate.NODES_JOINED, joined=n, total=total)
    log = [f"2026-01-01 00:00:00,000 hpcrl-agent[{HOST} rank 0] {n}/{total} nodes joined"
           for n in range(joined + 1)]
    if payload:
        head.append(runstate.PAYLOAD_STARTED, pid=1, nodes=total)
        log.append(f"2026-01-01 00:00:01,000 hpcrl-agent[{HOST} rank 0] all {total} nodes joined; "
                   "starting the payload: python -m trainer")
    paths.agent_log(0, HOST).write_text("\n".join(log) + "\n")
    if exit_code is not None:
        head.append(runstate.PAYLOAD_EXITED, status=exit_code)
        head.append(runstate.RUN_ENDED, exit_code=exit_code, summary=(
            f"job {job} restart {index}: payload exited with status {exit_code} "
            f"(exit {exit_code})"))
        head.append(runstate.TEARDOWN_DONE, exit_code=exit_code)


def make_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    d = root / f"global_step_{step}"
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"w" * 16)
    if complete:
        (d / "manifest.json").write_text(json.dumps({"step": step, "files": {"model.pt": 16}}))
    return d


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"payload": [
        "/usr/bin/python3", "-m", "trainer", f"trainer.run_dir={run}",
        "trainer.default_local_dir=checkpoints"]}))
    return run


def test_restart_read_from_agent_files(run: Path) -> None:
    make_restart(run, 0, exit_code=3)
    make_restart(run, 1, joined=2, total=3, payload=False, exit_code=None)
    assert rundir.restart_indices(run) == [0, 1]
    first, second = runstate.read_restart(run, 0), runstate.read_restart(run, 1)
    assert first.exit_code == 3 and first.payload_started and first.ended.startswith("job local-1")
    assert runstate.restart_state(first) == "stopped"
    assert (second.nodes_joined, second.nodes_total, second.payload_started) == (2, 3, False)
    assert runstate.restart_state(second) == "starting"
    assert runstate.restart_state(second, alive=False) == "lost"
    assert waiting_text(second) == "starting Ray: 2/3 nodes joined"
    assert waiting_text(first) == "1/1 nodes joined; trainer loading the model and data"
    assert waiting_text(None) == "starting the node agent"
    assert waiting_text(second, queued="queued (Priority)") == "queued (Priority)"


def test_states_from_exit_codes(run: Path) -> None:
    for index, code in enumerate((0, 2, 130)):
        make_restart(run, index, exit_code=code)
    assert [runstate.restart_state(runstate.read_restart(run, i)) for i in (0, 1, 2)] == [
        "finished", "failed", "aborted"]


def test_trainer_dirs_follow_overrides_and_defaults(run: Path) -> None:
    assert runreport.trainer_dirs(run) == (run, run / "checkpoints")
    # launched by hpcrl, the trainer defaults both into the run directory (trainer.config)
    assert runreport.trainer_dirs(run, {}) == (run, run / "checkpoints")
    assert runreport.trainer_dirs(run, {"trainer.default_local_dir": "/ck"}) == (run, Path("/ck"))
    assert runreport.trainer_dirs(run, {"trainer.default_local_dir": "null",
                                     "trainer.run_dir": "m"}) == (run / "m", run / "checkpoints")


def test_trainer_defaults_agree_with_trainer_config(tmp_path: Path) -> None:
    from trainer.config import load_config

    cfg = load_config([], env={"HPCRL_RUN_DIR": str(tmp_path)})
    assert runreport.trainer_dirs(tmp_path, {}) == (Path(cfg.trainer.run_dir),
                                                 Path(cfg.trainer.default_local_dir))


def test_completeness_agrees_with_the_trainer(tmp_path: Path) -> None:
    from trainer.checkpoint import full_state as ckpt

    def save(step: int) -> Path:
        return ckpt.save_checkpoint(tmp_path, step, {"trainer_state": {"global_step": step}},
                                    files={"config.yaml": "x: 1\n"})

    good, cut, bare, moved = save(2), save(3), save(4), save(5)
    (cut / "config.yaml").write_text("x")  # size no longer matches the manifest
    (bare / "manifest.json").unlink()  # killed before the manifest
    renamed = moved.rename(tmp_path / "global_step_9")  # manifest names another step
    # what `hpcrl status` lists is what the trainer would resume from: the complete one only
    assert [p for _, p in runreport.checkpoints(tmp_path)] == ckpt.list_checkpoints(tmp_path) == [good]
    assert [s for s, _ in runreport.checkpoints(tmp_path)] == [2]
    assert not any(ckpt.is_complete(p) for p in (cut, bare, renamed, tmp_path / "global_step_77"))


def test_metrics_found_and_partial_lines_skipped(run: Path) -> None:
    assert runreport.find_metrics(run) is None
    nested = run / "checkpoints" / "hpcrl" / "run" / "metrics.jsonl"
    write_metrics(nested, [record(1)])
    assert runreport.find_metrics(run) == nested  # found by search when overrides point elsewhere
    write_metrics(run / "metrics.jsonl", [record(1), record(2)])
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "critic/sc')  # cut short by a kill
    assert [r["step"] for r in runreport.read_metrics(runreport.find_metrics(run))] == [1, 2]


def test_latest_complete_checkpoint(run: Path) -> None:
    make_checkpoint(run / "checkpoints", 2)
    make_checkpoint(run / "checkpoints", 10)
    make_checkpoint(run / "checkpoints", 12, complete=False)
    cut = make_checkpoint(run / "checkpoints", 14)
    (cut / "model.pt").write_bytes(b"w")  # killed while writing, manifest from a reused name
    step, path = runreport.latest_checkpoint(run)
    assert (step, path.name) == (10, "global_step_10")



def test_latest_checkpoint_is_the_runs_own_newest_commit(run: Path) -> None:
    from trainer.checkpoint import full_state as ckpt

    me, other = ckpt.run_identity(run), ckpt.run_identity(run.parent / "other")
    root = run / "checkpoints"
    ckpt.save_checkpoint(root, 20, {"s": 20}, run=other)
    ckpt.save_checkpoint(root, 8, {"s": 8}, run=me)
    ckpt.save_checkpoint(root, 6, {"s": 6}, run=me)  # resumed from an earlier step
    step, path = runreport.latest_checkpoint(run)
    assert (step, path) == (6, root / "global_step_6")


def test_restart_starts_from_markers() -> None:
    records = [record(s, 0) for s in (1, 2, 3)] + [record(s, 1) for s in (4, 5)] + [record(6, 2)]
    assert runreport.restart_starts(records) == [(1, 4), (2, 6)]
    assert runreport.restart_starts([{"step": 1}, {"step": 2}]) == []


def test_report_and_status_command(run: Path) -> None:
    make_restart(run, 0, exit_code=3)
    make_restart(run, 1, exit_code=0)
    write_metrics(run / "metrics.jsonl", [record(1, 0, reward=0.1), record(2, 0, reward=0.2),
                                          record(3, 1, reward=0.5)])
    make_checkpoint(run / "checkpoints", 3)
    report = runreport.run_report(run)
    assert report.state == "finished" and report.reward_change() == (0.1, 0.5)
    text = "\n".join(report.lines())
    assert "finished (2 runs: 1 restart)" in text and "  restarts: 1\n" in text
    assert "reward: 0.100 (step 1) -> 0.500 (step 3)" in text
    assert (f"last checkpointed step: 3 ({run / 'checkpoints' / 'global_step_3'})"
            in text)
    (run / "submission.json").write_text(json.dumps({"job_id": "local-1"}))
    proc = run_hpcrl(["status", str(run)], {"PATH": "/usr/bin:/bin", "HOME": str(run)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("job local-1\n") and "steps: 3 of 6" in proc.stdout


def test_status_shows_the_trainer_s_diagnoses_beside_its_metrics(run: Path) -> None:
    """A diagnosis the trainer wrote (:mod:`hpcrl.diagnosis`) is in `hpcrl status`, newest three,
    read from the directory of the metrics; a line cut short is skipped."""
    from hpcrl.diagnosis import DIAGNOSIS_FILE, write_diagnosis

    make_restart(run, 0, exit_code=1)
    write_metrics(run / "metrics.jsonl", [record(1, 0, reward=0.1)])
    for n in range(4):
        write_diagnosis(run, "hang", f"rank {n} stopped in update_actor", rank=n)
    with (run / DIAGNOSIS_FILE).open("a") as f:
        f.write('{"kind": "oom", "summ')
    proc = run_hpcrl(["status", str(run)], {"PATH": "/usr/bin:/bin", "HOME": str(run)})
    assert proc.returncode == 0, proc.stderr
    shown = [ln for ln in proc.stdout.splitlines() if "diagnosis (hang," in ln]
    assert [ln.split(": ", 1)[1] for ln in shown] == [f"rank {n} stopped in update_actor" for n in (1, 2, 3)]


def test_a_resumed_jobs_state_is_its_own_not_the_earlier_jobs(run: Path) -> None:
    """After `--resume`, the run directory's state is the new job's: before its first run
    starts it is not the cancelled job's end, and each run names its job."""
    make_restart(run, 0, exit_code=3, job="12")
    assert runreport.run_report(run, alive=False).state == "stopped"
    waiting = runreport.run_report(run, alive=True, job_id="13")
    assert waiting.state == "job 13 not started yet (queued); run 0 was job 12's"
    assert "  run 0: job 12 restart 0: payload exited with status 3" in "\n".join(waiting.lines())
    make_restart(run, 1, exit_code=None, job="13")
    started = runreport.run_report(run, alive=True, job_id="13")
    assert started.state == "running" and started.restarts[-1].job_id == "13"


def test_a_run_whose_head_died_shows_the_workers_requeue_naming_the_node(run: Path) -> None:
    """The head died with its node (no headline, no end); the lowest live worker requeued the
    job: the run is `requeued`, its line the worker's message naming the dead node, not `running`."""
    make_restart(run, 0, total=2, joined=2, exit_code=None)
    worker = runstate.StateWriter(run, 0, 1, "node2")
    message = "node `node1` died; requeueing job local-1 (restart 1 of at most 2), excluding `node1`"
    worker.append(runstate.REQUEUE_DECIDED, action="requeue", lost_nodes=["node1"], message=message)
    worker.append(runstate.REQUEUE_DONE, message="requeued job local-1 with `scontrol requeue`; set `ExcNodeList=node1`")
    make_restart(run, 1, total=2, joined=2, exit_code=None)
    report = runreport.run_report(run, alive=True)
    assert runstate.restart_state(report.restarts[0]) == "requeued" and report.state == "running"
    assert f"  run 0: requeued: {message}" in report.lines()


def test_report_sees_a_dead_agent(run: Path, tmp_path: Path) -> None:
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    make_restart(run, 0, exit_code=None, pid=gone.pid)
    assert runreport.run_report(run).state == "lost"


def test_logs_of_one_restart(run: Path) -> None:
    make_restart(run, 0, exit_code=3)
    make_restart(run, 1, exit_code=0)
    (run / "1" / "logs" / "payload.log").write_text("trainer said hello\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(run)}
    payload = run_hpcrl(["logs", str(run), "--payload"], env)
    assert payload.returncode == 0 and payload.stdout == "trainer said hello\n"
    agent = run_hpcrl(["logs", str(run), "--restart", "0"], env)
    assert f"agent-0-{HOST}.log <==" in agent.stdout and "starting the payload" in agent.stdout
    bad = run_hpcrl(["logs", str(run), "--restart", "7"], env)
    assert bad.returncode == 2 and "has runs 0, 1" in bad.stderr
    absent = run_hpcrl(["logs", str(run), "--restart", "0", "--node", "3"], env)
    assert absent.returncode == 2 and "the agents of run 0 were nodes 0 (the state file)" in \
        absent.stderr, absent.stderr



def test_logs_of_a_submission_without_log_patterns_is_a_clear_error(run: Path) -> None:
    (run / "submission.json").write_text(json.dumps({"job_id": "17", "via": "sbatch"}))
    out = run_hpcrl(["logs", str(run)], {"PATH": "/usr/bin:/bin", "HOME": str(run)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"`{run}/submission.json` has no `logs` mapping of log patterns (received `logs`: " \
        f"None)" in out.stderr and f"Fix: read one run's logs with `hpcrl logs {run} --restart " \
        "last`" in out.stderr


# ----------------------------------------------------------------------------- progress


def test_format_step_and_eta() -> None:
    line = format_step(record(3, total=15), eta_s=125)
    assert line == ("step 3/15  reward 0.100  kl 0.03  entropy 3.6  len 7.5  2.0s/step  "
                    "ETA 2m05s")
    assert format_step({"step": 1}) == "step 1"
    # an asynchronous loop's step: the samples' lag, the sync, the two sides' idle shares
    fully = {"step": 2, "timing_s/step": 1.5, "fully_async/lag/max": 1, "timing_s/param_sync": 0.42,
             "fully_async/trainer/idle_ratio": 0.125, "fully_async/rollouter/idle_ratio": 0.3}
    assert format_step(fully) == "step 2  1.5s/step  lag 1  sync 0.4s  trainer idle 0.12  rollouter idle 0.30"
    assert format_step({"step": 3, "one_step_off/lag": 1, "timing_s/sync_rollout_weights": 0.2}) == "step 3  lag 1  sync 0.2s"
    assert [format_duration(s) for s in (5, 65, 7300)] == ["5s", "1m05s", "2h01m"]
    recs = [record(s, total=10) for s in (1, 2, 3)]
    assert eta_seconds(recs[:1], [0.0]) == pytest.approx(9 * 2.0)  # trainer's own step time
    assert eta_seconds(recs, [0.0, 4.0, 8.0]) == pytest.approx(7 * 4.0)  # wall time per step
    assert eta_seconds(recs, [0.0, 0.1, 0.2]) == pytest.approx(7 * 2.0)  # a backlog read at once
    assert eta_seconds([record(10, total=10)], [0.0]) is None


def test_watcher_follows_one_restart_through_a_rewrite(run: Path) -> None:
    clock = iter(range(100)).__next__
    path = run / "metrics.jsonl"
    write_metrics(path, [record(1, 0), record(2, 0), record(3, 0)])
    watcher = RunWatcher(run, restart=1, clock=lambda: float(clock()))
    assert watcher.new_steps() == []  # steps of the earlier run are not this run's
    # the resumed trainer drops steps after its checkpoint (2) and goes on
    write_metrics(path, [record(1, 0), record(2, 0)])
    assert watcher.new_steps() == []
    with path.open("a") as fh:
        fh.write(json.dumps(record(3, 1)) + "\n" + '{"step": 4, "crit')
    assert [r["step"] for r in watcher.new_steps()] == [3]
    with path.open("a") as fh:
        fh.write('ic/score/mean": 0.3, "training/restart": 1}\n')
    assert [r["step"] for r in watcher.new_steps()] == [4]
    assert watcher.new_steps() == []


def test_progress_on_a_terminal_and_in_a_file() -> None:
    tty = io.StringIO()
    p = Progress(tty, tty=True)
    p.status("starting Ray: 0/1 nodes joined")
    p.status("starting Ray: 0/1 nodes joined")
    p.status("1/1 nodes joined")
    p.line("step 1")
    p.close()
    assert tty.getvalue() == ("starting Ray: 0/1 nodes joined\r\x1b[K1/1 nodes joined\r\x1b[K"
                              "step 1\n")
    plain = io.StringIO()
    p = Progress(plain, tty=False)
    for text in ("a", "a", "b"):
        p.status(text)
    p.line("step 1")
    assert plain.getvalue() == "a\nb\nstep 1\n"
    quiet = io.StringIO()
    Progress(quiet, tty=False, quiet=True).line("x")
    assert quiet.getvalue() == ""


# ----------------------------------------------------------------------------- trainer side


def test_trainer_takes_sigint_as_stop_under_hpcrl_and_aborts_on_the_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.stop import STOP_SIGNALS, StopRequest, stop_signals

    assert stop_signals({}) == STOP_SIGNALS
    assert signal.SIGINT in stop_signals({"HPCRL_RUN_DIR": str(tmp_path)})
    monkeypatch.setenv("HPCRL_RUN_DIR", str(tmp_path))
    stop = StopRequest(tmp_path)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.reason() == "signal SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()


def test_trainer_restart_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.driver import launcher_restart

    monkeypatch.delenv("HPCRL_RESTART", raising=False)
    assert launcher_restart() == 0
    monkeypatch.setenv("HPCRL_RESTART", "2")
    assert launcher_restart() == 2


def test_follow_a_slurm_job_from_queue_to_requeue(run: Path) -> None:
    """The scheduler's answers and the run directory's files change between polls (the `sleep`
    seam writes what the agents and the trainer would have written by then)."""
    from hpcrl.progress import follow

    states = iter([("PENDING", "Priority"), ("PENDING", "Resources"), ("RUNNING", "node[1-3]"),
                   ("RUNNING", ""), ("RUNNING", ""), ("PENDING", "BeginTime"), ("RUNNING", ""),
                   None])
    metrics = run / "metrics.jsonl"

    def world(poll: int) -> None:
        if poll == 2:
            make_restart(run, 0, joined=2, total=3, payload=False, exit_code=None)
        elif poll == 3:
            write_metrics(metrics, [record(1, 0), record(2, 0)])
        elif poll == 4:
            write_metrics(metrics, [record(1, 0), record(2, 0), record(3, 0)])
        elif poll == 6:
            make_restart(run, 1, exit_code=None)
            write_metrics(metrics, [record(1, 0), record(2, 0), record(3, 1)])

    polls = iter(range(100))
    out = io.StringIO()
    follow(run, lambda: next(states), Progress(out, tty=False),
           sleep=lambda _: world(next(polls)))
    assert out.getvalue().splitlines() == [
        "queued (Priority)", "queued (Resources)", "starting the node agent",
        "starting Ray: 2/3 nodes joined",
        "step 1/6  reward 0.100  kl 0.01  entropy 3.8  len 7.5  2.0s/step  ETA 10s",
        "step 2/6  reward 0.100  kl 0.02  entropy 3.7  len 7.5  2.0s/step  ETA 8s",
        "step 3/6  reward 0.100  kl 0.03  entropy 3.6  len 7.5  2.0s/step  ETA 6s",
        "queued (BeginTime)",
        "requeued: run 1 of the job starts",
        "step 3/6  reward 0.100  kl 0.03  entropy 3.6  len 7.5  2.0s/step  ETA 6s",
    ]


def test_follow_a_resumed_job_shows_its_own_runs_only(run: Path) -> None:
    """`submit --resume --follow`: the earlier job's run (`RUN/0/`, its steps) is not this
    job's; its first run is `RUN/1/`, not a requeue."""
    from hpcrl.progress import follow

    make_restart(run, 0, exit_code=3, job="12")
    write_metrics(run / "metrics.jsonl", [record(1, 0), record(2, 0)])
    states = iter([("PENDING", "Priority"), ("RUNNING", ""), ("RUNNING", ""), None])

    def world(poll: int) -> None:
        if poll == 0:
            make_restart(run, 1, exit_code=None, job="13")
            write_metrics(run / "metrics.jsonl", [record(1, 0), record(2, 0), record(3, 1)])

    polls = iter(range(100))
    out = io.StringIO()
    follow(run, lambda: next(states), Progress(out, tty=False),
           sleep=lambda _: world(next(polls)), earlier=[0])
    assert out.getvalue().splitlines() == [
        "queued (Priority)",
        "step 3/6  reward 0.100  kl 0.03  entropy 3.6  len 7.5  2.0s/step  ETA 6s",
    ]


def test_follow_goes_on_while_slurm_does_not_answer(run: Path) -> None:
    from hpcrl.progress import NO_ANSWER, follow

    states = iter([("PENDING", "Priority"), (NO_ANSWER, "Slurm did not answer"),
                   (NO_ANSWER, "Slurm did not answer"), ("PENDING", "Resources"), None])
    out = io.StringIO()
    follow(run, lambda: next(states), Progress(out, tty=False), sleep=lambda _: None)
    assert out.getvalue().splitlines() == [
        "queued (Priority)", "Slurm does not answer; still following", "queued (Resources)"]


def test_cancel_a_local_run_stops_its_agent(run: Path) -> None:
    import subprocess

    agent = subprocess.Popen(["sleep", "60"])  # stands in for the head's agent process
    try:
        make_restart(run, 0, exit_code=None, pid=agent.pid, host=socket.gethostname(),
                     start=runstate.process_start(agent.pid))
        (run / "submission.json").write_text(json.dumps({"job_id": "local-1", "logs": {}}))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(run)}
        proc = run_hpcrl(["cancel", str(run)], env)
        assert proc.returncode == 0, proc.stderr
        assert f"agent pid {agent.pid}" in proc.stdout
        assert agent.wait(timeout=10) == -signal.SIGTERM
        again = run_hpcrl(["cancel", str(run)], env)
        assert again.returncode == 2 and "is not running" in again.stderr
    finally:
        agent.kill()


@pytest.mark.parametrize("case", ["other host", "reused pid"])
def test_cancel_never_signals_a_pid_that_is_not_the_agent(run: Path, case: str) -> None:
    """The recorded pid is signalled only on the agent's host and while it names the process
    that started then: a pid from another machine, or one reused by a later process, is not."""
    import subprocess

    stranger = subprocess.Popen(["sleep", "60"])  # alive, with the recorded pid
    try:
        start = runstate.process_start(stranger.pid)
        if case == "other host":
            make_restart(run, 0, exit_code=None, pid=stranger.pid, host="elsewhere", start=start)
        else:
            make_restart(run, 0, exit_code=None, pid=stranger.pid, host=socket.gethostname(),
                         start="another-boot:1")
        (run / "submission.json").write_text(json.dumps({"job_id": "local-1", "logs": {}}))
        proc = run_hpcrl(["cancel", str(run)], {"PATH": "/usr/bin:/bin", "HOME": str(run)})
        assert proc.returncode == 2, proc.stdout + proc.stderr
        said = "it ran on `elsewhere`" if case == "other host" else "the pid was reused"
        assert said in proc.stderr and "not signalling it" in proc.stderr, proc.stderr
        time.sleep(0.3)
        assert stranger.poll() is None  # untouched
    finally:
        stranger.kill()


def test_resume_refused_while_the_run_is_alive(run: Path) -> None:
    from hpcrl.submission import RequestError, refuse_if_running

    make_restart(run, 0, exit_code=None)  # this test process stands in for its live agent
    with pytest.raises(RequestError, match="is still running .* `hpcrl cancel "):
        refuse_if_running(run)
    make_restart(run, 1, exit_code=3)
    refuse_if_running(run)


def test_a_local_resume_refused_while_the_run_is_alive_changes_nothing(tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    """`--resume --update-spec` of a local run whose agent still runs is refused before its
    `job.json` is touched."""
    run = tmp_path / "local-run"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    made = run_hpcrl(["render", "--site", "local", "--run-dir", str(run), "--", "trainer.total_epochs=1",
                      "critic.ppo_micro_batch_size_per_gpu=4", f"actor_rollout_ref.model.path={tiny_model_dir}",
                      f"data.train_files={DATA / 'gsm8k_train_sample.parquet'}",
                      f"data.val_files={DATA / 'gsm8k_test_sample.parquet'}"], env)
    assert made.returncode == 0, made.stderr
    job = (run / "job.json").read_text()
    make_restart(run, 0, exit_code=None)  # this test process stands in for its live agent
    proc = run_hpcrl(["submit", "--site", "local", "--run-dir", str(run), "--resume",
                      "--update-spec", "--", "trainer.total_epochs=2"], env)
    assert proc.returncode == 2 and "is still running" in proc.stderr, proc.stderr
    assert (run / "job.json").read_text() == job


# ----------------------------------------------------------------------------- the state file

APPENDER = """
import sys
from pathlib import Path
from hpcrl import rundir, runstate
from hpcrl import runreport
run, rank, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
writer = runstate.StateWriter(run, 0, rank, "node%d" % rank)
for i in range(count):
    writer.append(runstate.NODES_JOINED, seq=i, a=str(rank) * 600, b="b" * 600, c="c" * 600,
                  d="d" * 600, e="e" * 600)
"""


def test_appends_from_two_processes_interleave_whole_lines(tmp_path: Path) -> None:
    """Two agents append 3 KB lines at once: every line of the file is one whole record, and
    each writer's lines keep their order."""
    import subprocess
    import sys

    from tests.conftest import REPO

    count = 400
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(tmp_path), str(rank),
                               str(count)], env=env) for rank in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    text = (tmp_path / rundir.STATE_FILE).read_bytes()
    assert text.endswith(b"\n")
    # an empty line may appear: a writer that saw the other's line half-copied ends it first
    records = [json.loads(line) for line in text.split(b"\n") if line]
    assert len(records) == 2 * count
    for rank in (1, 2):
        mine = [r for r in records if r["rank"] == rank]
        assert [r["seq"] for r in mine] == list(range(count))
        assert all(r["a"] == str(rank) * 600 and r["e"] == "e" * 600 for r in mine)
    assert runstate.read_state(tmp_path) == records


def test_a_torn_last_line_is_skipped_and_ended_by_the_next_writer(tmp_path: Path) -> None:
    """kill -9 mid-write leaves half a line: readers skip it without an error, and the next
    append (a requeued run's agent) ends it first, so its own line stays whole."""
    head = runstate.StateWriter(tmp_path, 0, 0, HOST)
    head.append(runstate.AGENT_STARTED, pid=7, nodes=2)
    head.append(runstate.PAYLOAD_STARTED, pid=8, nodes=2)
    with open(tmp_path / rundir.STATE_FILE, "ab") as fh:
        fh.write(b'{"event":"payload_exited","restart":0,"sta')
    assert [r["event"] for r in runstate.read_state(tmp_path)] == ["agent_started",
                                                                 "payload_started"]
    info = runstate.read_restart(tmp_path, 0)
    assert info.payload_started and info.exit_code is None and info.head_pid == 7
    runstate.StateWriter(tmp_path, 1, 0, HOST).append(runstate.AGENT_STARTED, pid=9, nodes=2)
    assert [(r["event"], r["restart"]) for r in runstate.read_state(tmp_path)] == [
        ("agent_started", 0), ("payload_started", 0), ("agent_started", 1)]
    assert runstate.read_restart(tmp_path, 1).head_pid == 9


def test_a_state_line_stays_small(tmp_path: Path) -> None:
    """Free text is cut to `TEXT_MAX`; a line that would still not fit one atomic append is
    refused, naming its size and the limit."""
    writer = runstate.StateWriter(tmp_path, 0, 0, HOST)
    writer.append(runstate.RUN_ENDED, summary="x" * 10_000)
    assert runstate.read_state(tmp_path)[0]["summary"] == "x" * runstate.TEXT_MAX
    with pytest.raises(rundir.RunFileError, match=r"at most 4000, one atomic append"):
        writer.append(runstate.RUN_ENDED, **{f"f{i}": "y" * 500 for i in range(10)})
    assert len(runstate.read_state(tmp_path)) == 1
