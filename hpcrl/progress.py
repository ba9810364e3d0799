"""Progress of a run that fits a terminal: what it waits for, then one line per training step.

:class:`RunWatcher` turns the run directory into events (pure reading of the state file the
node agents append to and of the trainer's metrics); :class:`Progress` prints them. On a
terminal the waiting state is one line rewritten in place and each step a line of its own; when
stdout is not a terminal only state changes and step lines are printed, plainly.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpcrl import rundir, runreport, runstate
from hpcrl.runreport import format_step


def eta_seconds(records: Sequence[dict[str, Any]], arrivals: Sequence[float]) -> float | None:
    """Remaining steps times the recent wall time per step (between arrivals of step lines),
    at least the trainer's own step time."""
    if not records:
        return None
    last = records[-1]
    total = last.get("training/total_steps")
    if not isinstance(total, int):
        return None
    remaining = total - int(last["step"])
    if remaining <= 0:
        return None
    found = runreport.pick(last, runreport.STEP_TIME)
    per_step = found[1] if found else 0.0
    if len(arrivals) >= 2:  # never below the trainer's own step time (lines read in a batch)
        recent = arrivals[-6:]
        per_step = max(per_step, (recent[-1] - recent[0]) / (len(recent) - 1))
    return remaining * per_step if per_step > 0 else None


def waiting_text(info: runstate.RestartInfo | None, queued: str | None = None) -> str:
    """What the run waits for, from its restart's files (or the scheduler's word)."""
    if queued:
        return queued
    if info is None:
        return "starting the node agent"
    total = info.nodes_total or "?"
    if info.payload_started:  # a trainer started with the head alone waits for the others
        return f"{info.nodes_joined}/{total} nodes joined; trainer loading the model and data"
    if info.nodes_total is None:
        return "node agent starting"
    return f"starting Ray: {info.nodes_joined}/{total} nodes joined"


@dataclass
class RunWatcher:
    """Follows one restart of a run: its waiting state and its new metric records."""

    run_dir: Path
    restart: int | None = None
    clock: Callable[[], float] = time.monotonic
    shown: set[int] = field(default_factory=set)
    records: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    _offset: int = 0
    _path: Path | None = None

    def current_restart(self) -> int | None:
        if self.restart is not None:
            return self.restart
        found = rundir.restart_indices(self.run_dir)
        return found[-1] if found else None

    def info(self) -> runstate.RestartInfo | None:
        r = self.current_restart()
        if r is None or not rundir.RunPaths(self.run_dir, r).root.is_dir():
            return None
        return runstate.read_restart(self.run_dir, r)

    def _read_new(self) -> list[dict[str, Any]]:
        if self._path is None:
            self._path = runreport.find_metrics(self.run_dir)
            if self._path is None:
                return []
        try:
            size = self._path.stat().st_size
            if size < self._offset:  # rewritten on resume: read it again, `shown` dedupes
                self._offset = 0
            with self._path.open("rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        return runreport.parse_metrics(complete.decode(errors="replace"))

    def new_steps(self) -> list[dict[str, Any]]:
        """Records of this restart not returned before (all restarts when none is set)."""
        out = []
        for rec in self._read_new():
            mark = rec.get("training/restart")
            if self.restart is not None and isinstance(mark, int) and mark != self.restart:
                continue
            if rec["step"] in self.shown:
                continue
            self.shown.add(rec["step"])
            self.records.append(rec)
            self.arrivals.append(self.clock())
            out.append(rec)
        return out

    def eta(self, record: dict[str, Any] | None = None) -> float | None:
        """ETA as of `record` (default: the newest)."""
        n = len(self.records)
        if record is not None:
            n = next(i for i, r in enumerate(self.records) if r is record) + 1
        return eta_seconds(self.records[:n], self.arrivals[:n])


class Progress:
    """Prints waiting states and step lines to `stream`."""

    def __init__(self, stream: TextIO, tty: bool | None = None, quiet: bool = False) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.quiet = quiet
        self._status = ""
        self._transient = False

    def _width(self) -> int:
        return max(20, shutil.get_terminal_size((100, 24)).columns - 1)

    def _clear(self) -> None:
        if self._transient:
            self.stream.write("\r\x1b[K")
            self._transient = False

    def status(self, text: str) -> None:
        """A waiting state: rewritten in place on a terminal, a line when it changes otherwise."""
        if self.quiet or text == self._status:
            return
        self._status = text
        if self.tty:
            self._clear()
            self.stream.write(text[: self._width()])
            self._transient = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        """A line that stays (a step, a note)."""
        if self.quiet:
            return
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty and self._status:
            self._status = ""

    def steps(self, watcher: RunWatcher) -> None:
        """A line for each step `watcher` has not returned before, with the ETA as of it."""
        for rec in watcher.new_steps():
            self.line(format_step(rec, watcher.eta(rec)))

    def close(self) -> None:
        if not self.quiet:
            self._clear()
            self.stream.flush()


def stdout_is_tty(stream: TextIO) -> bool:
    return stream.isatty() and os.environ.get("TERM") != "dumb"


JobState = Callable[[], "tuple[str, str] | None"]
"""() -> (state, reason) while the scheduler knows the job (`PENDING`, `Priority`), else None."""


NO_ANSWER = "NO_ANSWER"
"""The job state `follow` is given while the scheduler does not answer."""


def follow(run_dir: Path, job_state: JobState, progress: Progress, poll_s: float = 2.0,
           sleep: Callable[[float], None] = time.sleep, max_polls: int | None = None,
           earlier: Collection[int] = ()) -> None:
    """Print a submitted job's progress until the scheduler forgets it: queued, nodes joining,
    one line per step; a requeue starts following the next run (`RUN/<N>/`). `earlier`: the
    runs of earlier jobs (a `--resume`d run directory's), never followed."""
    watcher: RunWatcher | None = None
    polls = 0
    while max_polls is None or polls < max_polls:
        polls += 1
        state = job_state()
        found = [r for r in rundir.restart_indices(run_dir) if r not in earlier]
        if found and (watcher is None or watcher.restart != found[-1]):
            if watcher is not None:
                progress.steps(watcher)  # the last steps of the run that ended
                progress.line(f"requeued: run {found[-1]} of the job starts")
            watcher = RunWatcher(run_dir, restart=found[-1])
        if watcher is not None:
            progress.steps(watcher)
        if state is None:
            return
        if state[0] == NO_ANSWER:
            progress.status("Slurm does not answer; still following")
        elif state[0] in ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD"):
            progress.status(f"queued ({state[1]})" if state[1] else "queued")
        elif watcher is None or not watcher.records:
            progress.status(waiting_text(watcher.info() if watcher else None))
        sleep(poll_s)
