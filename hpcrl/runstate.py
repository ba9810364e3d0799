"""The job's state file, `RUN/state.jsonl`: the events the node agents append (one JSON object a
line), how a line is written (whole, with one `O_APPEND` write, retried through a parallel file
system's transient errors), and what the lines say about each run of the job
(:class:`RestartInfo`: its nodes, whether the payload started, how it ended).

Where the file lives is :mod:`hpcrl.rundir`'s (:class:`~hpcrl.rundir.RunDir`). The state of a job
(`hpcrl status`, `--follow`, `cancel`, a local run's progress) is read from this file alone; the
agents' logs are for people and are never parsed. Reading stays light (no Slurm, no torch).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.rundir import RunDir, RunFileError, restart_indices
from trainer.exit_codes import ABORTED_EXIT_CODE, REQUEUE_EXIT_CODE

# ----------------------------------------------------------------------------- the state file

STATE_LINE_MAX = 4000
"""Bytes of one state line at most: below `PIPE_BUF`, so one `write` with `O_APPEND` lands whole
and lines from several writers never interleave inside a line."""
TEXT_MAX = 600
"""Characters kept of a free-text field (a cause, a message) in a state line."""

# The events, each line also carrying `time`, `restart`, `rank` and `host` of its writer:
AGENT_STARTED = "agent_started"
"""Every node, first: `pid` of the agent, `nodes` in the allocation, `job_id`."""
RAY_RESOURCES = "ray_resources"
"""Head, as its Ray starts: `allocation` (what `ray start` got on the head's node: `cpus`,
`gpus`, `gpu_ids`, `memory_bytes`, `object_store_bytes`, `heap_bytes`, `sources`; every node's
own is in its log and its `nodes/RANK.json`)."""
NODES_JOINED = "nodes_joined"
"""Head, at each change while it waits for the cluster: `joined` of `total` nodes in Ray."""
PAYLOAD_STARTED = "payload_started"
"""Head: the payload runs (`pid`, `nodes`)."""
STOP_REQUESTED = "stop_requested"
"""Head, once: why the payload was asked to checkpoint and stop (`reason`, `payload_started`,
`terminated_by`: the signal with which Slurm ended the job, if one did)."""
PAYLOAD_EXITED = "payload_exited"
"""Head: the payload's exit `status` (3: checkpointed, asks to be requeued) and `stop_reason`."""
REQUEUE_DECIDED = "requeue_decided"
"""Head: `action` (`hpcrl.agent.requeue`: requeue, no-slurm, ...), `message`, `deferred`
(the requeue waits for the teardown)."""
REQUEUE_DONE = "requeue_done"
"""Head: what `scontrol requeue` did (`target`, `message`)."""
RUN_ENDED = "run_ended"
"""Head, as the teardown begins: `summary` (the headline of `summary.txt`), `cause`,
`exit_code` of the job."""
TEARDOWN_DONE = "teardown_done"
"""Every node, last: its processes are stopped (`exit_code` of the node's part)."""


# ----------------------------------------------------------------------------- writing, with faults

TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.EIO, errno.EAGAIN,
                              errno.EINTR, errno.ETIMEDOUT, errno.ENOLCK})
"""Errors a parallel file system gives for a while and then no more (a full or over-quota
target being cleaned, a failing-over server, a stale handle): a write is tried again."""
DEFAULT_PATIENCE_S = 15.0
"""How long a write is retried when nobody said: the profile's default `heartbeat_timeout_s`
(past it the other nodes count this one as dead anyway)."""


def fs_write(fd: int, data: bytes, offset: int | None = None) -> None:
    """Hand all of `data` to the file system: the one place the run directory's writers (the
    state file, the rendezvous files, the heartbeats) write bytes, at `offset` or appended."""
    view = memoryview(data)
    while view:
        if offset is None:
            n = os.write(fd, view)
        else:
            n = os.pwrite(fd, view, offset)
            offset += n
        view = view[n:]


def _warn_stderr(message: str) -> None:
    print(f"hpcrl: {message}", file=sys.stderr)


@dataclass
class Retrying:
    """One writer's retries of a file write that failed with a transient error
    (:data:`TRANSIENT_ERRNOS`): again after 0.05, 0.1, 0.2 ... 2 s, for up to `patience_s`
    since the first failure, said once when it starts failing and once when it works again;
    past the patience, or at any other error, the error is raised."""

    patience_s: float = DEFAULT_PATIENCE_S
    warn: Callable[[str], None] = _warn_stderr
    clock: Callable[[], float] = time.monotonic
    failing_since: float | None = None
    next_try: float = 0.0
    delay: float = 0.0

    def due(self) -> bool:
        """Whether the backoff since the last failure is over."""
        return self.clock() >= self.next_try

    def attempt(self, write: Callable[[], None], what: str) -> bool:
        """Run `write` once: True when it worked, False after a transient error within the
        patience (try again once :meth:`due`)."""
        try:
            write()
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                raise
            self._failed(exc, what)
            return False
        if self.failing_since is not None:
            self.warn(f"writing {what} works again after "
                      f"{self.clock() - self.failing_since:.1f} s")
            self.failing_since = None
        return True

    def _failed(self, exc: OSError, what: str) -> None:
        now, name = self.clock(), errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if self.failing_since is None:
            self.failing_since, self.delay = now, 0.05
            self.warn(f"writing {what} failed ({name}: {exc.strerror}); trying again for up "
                      f"to {self.patience_s:g} s")
        elif now - self.failing_since > self.patience_s:
            raise OSError(exc.errno, f"{exc.strerror} (writing {what} failed for "
                          f"{now - self.failing_since:.1f} s, longer than the "
                          f"{self.patience_s:g} s the file system is given: "
                          "`heartbeat_timeout_s`)") from exc
        else:
            self.delay = min(2 * self.delay, 2.0)
        self.next_try = now + self.delay

    def run(self, write: Callable[[], None], what: str,
            sleep: Callable[[float], None] = time.sleep) -> None:
        """Run `write` until it works, waiting between tries (raises as :meth:`attempt`)."""
        while not self.attempt(write, what):
            sleep(max(0.0, self.next_try - self.clock()))


@dataclass(frozen=True)
class StateWriter:
    """One node's voice in the state file: every line it appends names its run and node. A
    transient file-system error is retried (`retry`) rather than ending the job."""

    run_dir: Path
    restart: int
    rank: int
    host: str
    retry: Retrying = field(default_factory=Retrying, compare=False)

    def append(self, event: str, **fields: Any) -> None:
        """Append one line `{"time", "event", "restart", "rank", "host", **fields}`."""
        record = {key: _short(value) for key, value in fields.items()}
        record.update(time=round(time.time(), 3), event=event, restart=self.restart,
                      rank=self.rank, host=self.host)
        path = RunDir(self.run_dir).state
        self.retry.run(lambda: append_line(path, record), f"`{path}`")


def _short(value: Any) -> Any:
    return value[:TEXT_MAX] if isinstance(value, str) else value


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append `record` as one line with a single `write` on an `O_APPEND` descriptor: never a
    rewrite, so a reader sees whole lines (and at worst a torn last one after a kill -9).

    Local file systems, Lustre and GPFS append atomically for every writer; NFS does so only
    for writers on one client, which is why the head writes nearly every line and a worker
    only its start and its end."""
    data = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    if len(data) > STATE_LINE_MAX:
        raise RunFileError(f"a state line of {len(data)} bytes for `{path}` (at most "
                           f"{STATE_LINE_MAX}, one atomic append); shorten its fields")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a writer was killed mid-line (or
            data = b"\n" + data  # is mid-copy): end that line first; readers skip empty lines
        fs_write(fd, data)
    finally:
        os.close(fd)


def read_state(run_dir: Path, restart: int | None = None) -> list[dict[str, Any]]:
    """The state file's records (of run `restart`, or all), oldest first. A last line without
    its newline (the writer was killed mid-write) and lines that are not JSON objects are
    skipped."""
    try:
        raw = RunDir(run_dir).state.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw[: raw.rfind(b"\n") + 1].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str) and (
                restart is None or record.get("restart") == restart):
            out.append(record)
    return out


# ----------------------------------------------------------------------------- one run of the job


@dataclass(frozen=True)
class RestartInfo:
    """One run of the job (`RUN/<index>/`), as its state lines tell it."""

    index: int = field(metadata={"help": "restart number (0 = first run)"})
    nodes_total: int | None = field(metadata={"help": "nodes in the allocation (head's view)"})
    nodes_joined: int = field(metadata={"help": "nodes in the Ray cluster"})
    payload_started: bool = field(metadata={"help": "the head started the payload"})
    node_states: dict[int, str] = field(metadata={"help": "rank -> the node's last event"})
    ended: str | None = field(metadata={"help": "the head's headline once the run ended"})
    exit_code: int | None = field(metadata={"help": "the payload's exit status, when known"})
    head_pid: int | None = field(metadata={"help": "process id of the head's agent"})
    head_host: str | None = field(metadata={"help": "host of the head's agent"})
    started: float | None = field(metadata={"help": "time the head's agent started"})
    head_start: str | None = field(default=None, metadata={
        "help": "the head agent's process start (`process_start`): tells it from a reused pid"})
    requeue: str | None = field(default=None, metadata={
        "help": "the head's requeue decision (or what the requeue did), when it made one"})
    requeue_why: str | None = field(default=None, metadata={
        "help": "the requeue decision's own message (why: the lost nodes), kept after what the requeue did"})
    requeue_action: str | None = field(default=None, metadata={
        "help": "the decision's kind (`hpcrl.agent.requeue`: requeue, no-slurm, ...)"})
    job_id: str | None = field(default=None, metadata={
        "help": "the job this run belongs to (its head's word), None before the head started"})


def restart_from_state(index: int, records: Sequence[dict[str, Any]]) -> RestartInfo:
    """Fold run `index`'s state lines into a :class:`RestartInfo`."""
    head: dict[str, Any] = {}
    total = joined = exit_code = None
    ended = requeue = why = action = None
    started = False
    states: dict[int, str] = {}
    for r in records:
        event, rank = r["event"], r.get("rank")
        if isinstance(rank, int):
            states[rank] = event
        if event == AGENT_STARTED and rank == 0:
            head, total = r, r.get("nodes", total)
        elif event == NODES_JOINED:
            joined, total = r.get("joined"), r.get("total", total)
        elif event == PAYLOAD_STARTED:
            started = True
        elif event == PAYLOAD_EXITED:
            exit_code = r.get("status")
        elif event == RUN_ENDED and ended is None:
            ended = str(r.get("summary"))
        elif event in (REQUEUE_DECIDED, REQUEUE_DONE):
            requeue = str(r.get("message"))
            why = requeue if event == REQUEUE_DECIDED else why
            action = r.get("action", action)
    return RestartInfo(
        index=index,
        nodes_total=total if isinstance(total, int) else None,
        nodes_joined=joined if isinstance(joined, int) else 0,
        payload_started=started,
        node_states=dict(sorted(states.items())),
        ended=ended,
        exit_code=exit_code if isinstance(exit_code, int) else None,
        head_pid=head.get("pid") if isinstance(head.get("pid"), int) else None,
        head_host=head.get("host") if isinstance(head.get("host"), str) else None,
        head_start=head.get("start") if isinstance(head.get("start"), str) else None,
        started=head.get("time") if isinstance(head.get("time"), int | float) else None,
        requeue=requeue,
        requeue_why=why,
        requeue_action=action if isinstance(action, str) else None,
        job_id=str(head["job_id"]) if head.get("job_id") is not None else None,
    )


def read_restart(run_dir: Path, index: int) -> RestartInfo:
    """Everything the state file says about run `index` of the job."""
    return restart_from_state(index, read_state(run_dir, index))


def process_start(pid: int) -> str | None:
    """`BOOT_ID:START_TICKS` of process `pid` on this machine (None: no such process): the same
    pid on another boot, or reused by a later process, gives another value."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return f"{boot}:{fields[19]}"  # field 22 of stat: start time after boot, in clock ticks


def same_process(pid: int, host: str | None, start: str | None) -> str | None:
    """Why `pid` (recorded on `host`, started at `start`) is not that process here; None when
    it is."""
    here = socket.gethostname()
    if host is not None and host != here:
        return f"it ran on `{host}`, this is `{here}`"
    now = process_start(pid)
    if now is None:
        return f"process {pid} is gone"
    if start is not None and now != start:
        return f"process {pid} is another process now (the pid was reused)"
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_restart(run_dir: Path) -> RestartInfo | None:
    """The latest run of the job while its head agent (a process on this machine) still runs."""
    found = restart_indices(run_dir)
    info = read_restart(run_dir, found[-1]) if found else None
    if info and info.ended is None and info.head_pid is not None and pid_alive(info.head_pid):
        return info
    return None


def restart_state(info: RestartInfo, alive: bool | None = None) -> str:
    """A one-word state: starting, running, finished, stopped (checkpointed, resumable),
    aborted (interrupted twice), failed, lost (the agent is gone without a summary), or requeued
    (no summary but a requeue decision: a worker's, after the head died with its node)."""
    if info.ended is None:
        if info.requeue is not None:
            return "requeued"
        if alive is False:
            return "lost"
        return "running" if info.payload_started else "starting"
    if info.exit_code == 0:
        return "finished"
    if info.exit_code == REQUEUE_EXIT_CODE:
        return "stopped"
    if info.exit_code == ABORTED_EXIT_CODE:
        return "aborted"
    return "failed"
