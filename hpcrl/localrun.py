"""`hpcrl submit --site local`: run the job script in the foreground and follow it.

The job script (``job.sh``) starts the node agent, which brings up a one-node Ray cluster and
runs the trainer: the same pipeline as on a Slurm allocation. Each run is one restart of the
job (``RUN/<N>/``); `--resume` continues a run directory where its last checkpoint left it.

Signals: the script runs in its own session, so the terminal's Ctrl-C reaches only this
process, which forwards it once per press: the first asks the trainer to finish its step, write a
checkpoint and exit (status 3); the second aborts the step. SIGTERM is forwarded as SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpcrl import rundir, runreport
from hpcrl.progress import Progress, RunWatcher, waiting_text
from trainer.exit_codes import REQUEUE_EXIT_CODE

POLL_S = 0.5


def next_restart(run_dir: Path) -> int:
    """The index of the next run of the job in `run_dir` (0 for a new one)."""
    found = rundir.restart_indices(run_dir)
    return found[-1] + 1 if found else 0


def local_job_id(run_dir: Path) -> str:
    """The job id of an earlier run of `run_dir` (resume), or a new `local-<hex>`."""
    previous = rundir.submitted_job_id(run_dir) or ""
    if previous.startswith("local-"):
        return previous
    return f"local-{secrets.token_hex(4)}"


@dataclass
class _Interrupts:
    """Signals received by the launcher, to forward from the main loop."""

    pending: list[int] = field(default_factory=list)
    ints: int = 0


def _install(flags: _Interrupts) -> dict[int, Any]:
    def note(signum: int, _frame: object) -> None:
        flags.pending.append(signum)

    return {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}


def _forward(proc: subprocess.Popen[bytes], flags: _Interrupts, progress: Progress,
             payload_started: bool) -> None:
    while flags.pending:
        sig = flags.pending.pop(0)
        if sig == signal.SIGINT:
            flags.ints += 1
            if not payload_started:
                progress.line("hpcrl: interrupted before training started; shutting down "
                              "(nothing to checkpoint)")
            elif flags.ints == 1:
                progress.line("hpcrl: stopping: the trainer finishes its step and writes a "
                              "checkpoint (Ctrl-C again to abort without one)")
            else:
                progress.line("hpcrl: aborting the current step; the run resumes from its last "
                              "checkpoint")
        else:
            progress.line(f"hpcrl: got {signal.Signals(sig).name}; stopping with a checkpoint")
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def run_foreground(argv: list[str], run_dir: Path, resume_hint: str,
                   stream: TextIO | None = None, quiet: bool = False,
                   environ: Mapping[str, str] | None = None) -> int:
    """Run the job script `argv` for `run_dir`, print progress and a summary; the exit status
    is the job's (0 done, 3 stopped with a checkpoint, 2 bad input, 130 aborted)."""
    stream = stream or sys.stdout
    restart = next_restart(run_dir)
    job_id = local_job_id(run_dir)
    env = {**(os.environ if environ is None else environ), "HPCRL_JOB_ID": job_id,
           "HPCRL_RESTART": str(restart)}
    _record_submission(run_dir, job_id)
    progress = Progress(stream, quiet=quiet)
    progress.line(f"hpcrl: run directory {run_dir} (run {restart}, job {job_id}); "
                  f"logs: hpcrl logs {run_dir}")
    watcher = RunWatcher(run_dir, restart=restart)
    flags = _Interrupts()
    previous = _install(flags)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        code = _follow(proc, watcher, progress, flags)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    progress.close()
    report = runreport.run_report(run_dir, alive=False)
    for line in end_lines(report, code, run_dir, resume_hint):
        print(line, file=stream)
    return code


def _follow(proc: subprocess.Popen[bytes], watcher: RunWatcher, progress: Progress,
            flags: _Interrupts) -> int:
    while True:
        info = watcher.info()
        started = bool(info and info.payload_started)
        _forward(proc, flags, progress, started)
        progress.steps(watcher)
        code = proc.poll()
        if code is not None:
            progress.steps(watcher)
            return code if code >= 0 else 128 - code
        if not watcher.records:
            progress.status(waiting_text(info))
        time.sleep(POLL_S)


def _record_submission(run_dir: Path, job_id: str) -> None:
    try:
        data = rundir.read_submission(run_dir)
    except rundir.RunFileError:
        data = {"via": "local", "run_dir": str(run_dir),
                "logs": {"node": rundir.log_patterns(str(run_dir))["local_node"]}}
    data["job_id"] = job_id
    data.pop("exit_status", None)
    rundir.write_submission(run_dir, data)


def trainer_errors(run_dir: Path, restart: int) -> list[str]:
    """The trainer's own error lines (`python -m trainer: error: ...`) of one run."""
    try:
        text = rundir.RunPaths(run_dir, restart).payload_log.read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.startswith("python -m trainer: error:")]


def log_tail(path: Path, lines: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def end_lines(report: runreport.RunReport, code: int, run_dir: Path, resume_hint: str) -> list[str]:
    """What the terminal shows when the job script ends."""
    restart = report.restarts[-1].index if report.restarts else 0
    out = report.lines()
    if code == 0:
        out.append(f"  plot: hpcrl plot {run_dir}")
    elif code == REQUEUE_EXIT_CODE:
        out.append(f"stopped with a checkpoint; continue with: {resume_hint}")
    elif code == 128 + signal.SIGINT:
        where = "the last checkpoint" if report.checkpoint else "step 1 (no checkpoint yet)"
        out.append(f"aborted; continue from {where} with: {resume_hint}")
    else:
        errors = trainer_errors(run_dir, restart)
        if errors:
            out += ["the trainer refused its input:", *("  " + e.removeprefix(
                "python -m trainer: error: ") for e in errors)]
        else:
            paths = rundir.RunPaths(run_dir, restart)
            payload, agent = paths.payload_log, paths.agent_logs(0)
            tail_of = payload if payload.exists() else (agent[0] if agent else payload)
            out += [f"the job failed (exit status {code}); last lines of {tail_of}:",
                    *("  " + ln for ln in log_tail(tail_of))]
        out.append(f"full logs: hpcrl logs {run_dir}")
    return out
