"""Rendezvous of a job's node agents through the run directory on the shared filesystem.

The files of one run (restart `R`), named by :class:`hpcrl.rundir.RunPaths`: the canary
(`RUN/canary`, checked by every node), the Ray token, the head's publication, `head-alive`, one
file per node (arrival, state, heartbeat, final summary), the stop request (first writer wins)
and the batch script's `warning`.

Every file is written to a temporary name, flushed to disk and renamed, so a reader sees either
nothing or a complete file.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.rundir import AGENT_STARTED, RunDir, RunPaths, read_state

RENDEZVOUS_VERSION = 2  # 2: workers start Ray once `head-alive` appears
POLL_S = 0.1
CANARY_ENV = "HPCRL_CANARY"


class RendezvousError(RuntimeError):
    """Nodes could not meet through the run directory."""


def atomic_write_text(path: Path, text: str, mode: int = 0o600) -> None:
    """Write `text` to `path` through a temporary file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data: Mapping[str, Any], mode: int = 0o600) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None while it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise RendezvousError(f"`{path}` holds {type(data).__name__}, expected a JSON object")
    return data


def create_run_dirs(paths: RunPaths, host: str) -> None:
    """Make this run's directories inside the existing run directory (made at submission,
    never here: a node that lacks it does not share the filesystem), closed to others."""
    if not paths.run_dir.is_dir():
        raise RendezvousError(
            f"run directory `{paths.run_dir}` does not exist on node `{host}`; it must be on "
            "a filesystem shared by the submitting host and every node (set `run_dir` in "
            "the site profile to a shared path)"
        )
    secure_dir(paths.run_dir)
    for d in (paths.root, paths.nodes, paths.logs):
        d.mkdir(mode=0o700, exist_ok=True)


def check_new_run(paths: RunPaths, job_id: str) -> None:
    """Refuse to run in `RUN/<N>/` when it holds another job's run (its agents' state lines or
    its head's publication): its stop request, warning and rendezvous are not this job's. The
    job script claims a new `<N>/` for every run, so this meets only an agent started otherwise
    (by hand, or with `HPCRL_RESTART` set to a used N)."""
    others = {str(r["job_id"]) for r in read_state(paths.run_dir, paths.restart)
              if r["event"] == AGENT_STARTED and r.get("job_id") not in (None, job_id)}
    try:
        published = read_json(paths.rendezvous)
    except (ValueError, RendezvousError):
        published = {"job_id": "unknown (a damaged publication)"}
    if published is not None and published.get("job_id") != job_id:
        others.add(str(published.get("job_id")))
    if others:
        raise RendezvousError(
            f"`{paths.root}` holds the run of job {', '.join(sorted(others))}, not of this job "
            f"{job_id}; each run of a job needs a new `<N>/`. Submit with `hpcrl submit --resume` "
            "(its job script claims the next free one), or set `HPCRL_RESTART` to an unused N")


def secure_dir(path: Path) -> None:
    """Give `path` mode 0700 when it is ours; refuse to go on when others can read it."""
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)
    elif st.st_mode & 0o077:
        raise RendezvousError(
            f"run directory `{path}` has mode {oct(st.st_mode & 0o777)} and belongs to another "
            "user; the Ray token in it would be readable by others. Use a run directory you own"
        )


def write_token(paths: RunPaths) -> Path:
    """Create the run's Ray auth token (mode 0600); returns its path. Never logged."""
    atomic_write_text(paths.token, secrets.token_hex(32), mode=0o600)
    return paths.token


# --- canary: does this node see the same run directory as the submitter? ---------------------


def write_canary(run_dir: Path) -> str:
    """Called at submission: write a fresh nonce into the run directory; pass it to the job in
    the environment variable `HPCRL_CANARY` so that every node can check what it sees."""
    nonce = secrets.token_hex(16)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RunDir(run_dir).canary, nonce, mode=0o600)
    return nonce


def verify_canary(run_dir: Path, expected: str, host: str) -> None:
    """Fail fast when this node cannot see the submitter's run directory."""
    canary = RunDir(run_dir).canary
    try:
        seen = canary.read_text().strip()
    except OSError as exc:
        raise RendezvousError(
            f"node `{host}` cannot read `{canary}` ({exc.strerror}); the run directory must be "
            "on a filesystem shared by the submitting host and every node (set `run_dir` in the "
            "site profile to a shared path)"
        ) from None
    if seen != expected:
        raise RendezvousError(
            f"node `{host}` sees a different `{canary}` than the submitter wrote; this node has "
            "its own copy of the run directory, not the shared one. Use a shared `run_dir`"
        )


# --- the head's publication ------------------------------------------------------------------


def publish(paths: RunPaths, info: Mapping[str, Any]) -> None:
    """Head: announce address, ports and token path to the other nodes."""
    atomic_write_json(paths.rendezvous, {"version": RENDEZVOUS_VERSION, **info}, mode=0o600)


def wait_for_publication(
    paths: RunPaths,
    head: str,
    timeout_s: float,
    keep_waiting: Callable[[], str | None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    job_id: str | None = None,
) -> dict[str, Any]:
    """Worker: wait for the head's rendezvous file, polling every 100 ms.

    `keep_waiting()` returns a reason to give up early (a stop request, a signal) or None;
    a publication of another job than `job_id` is refused (never joined).
    """
    deadline = clock() + timeout_s
    while True:
        data = read_json(paths.rendezvous)
        if data is not None:
            if data.get("version") != RENDEZVOUS_VERSION:
                raise RendezvousError(
                    f"`{paths.rendezvous}` has version {data.get('version')}, this agent reads "
                    f"{RENDEZVOUS_VERSION}; run the same hpcrl version on every node"
                )
            if job_id is not None and data.get("job_id") != job_id:
                raise RendezvousError(
                    f"`{paths.rendezvous}` was published by job {data.get('job_id')}, not by "
                    f"this job {job_id}; each run of a job needs a new `<N>/` (`hpcrl submit "
                    "--resume` claims one)")
            return data
        reason = keep_waiting()
        if reason:
            raise RendezvousError(f"gave up waiting for the head: {reason}")
        if clock() >= deadline:
            raise RendezvousError(
                f"the head node `{head}` did not publish `{paths.rendezvous}` within "
                f"{timeout_s:.0f} s; see its agent log in `{paths.logs}`"
            )
        sleep(POLL_S)


# --- node files: arrival, heartbeat, state, summary ------------------------------------------


def write_node(paths: RunPaths, rank: int, state: Mapping[str, Any]) -> None:
    data = {"rank": rank, "time": time.time(), "pid": os.getpid(), **state}
    atomic_write_json(paths.node_file(rank), data, mode=0o600)


def read_nodes(paths: RunPaths) -> dict[int, dict[str, Any]]:
    """Every node file present, by rank; half-written files never show (atomic rename)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        entries = list(paths.nodes.iterdir())
    except FileNotFoundError:
        return out
    for entry in entries:
        if entry.suffix == ".json" and entry.stem.isdigit():
            data = read_json(entry)
            if data is not None:
                out[int(entry.stem)] = data
    return out


def missing_nodes(
    nodes: Sequence[str], arrived: Mapping[int, Mapping[str, Any]], joined: set[int]
) -> list[str]:
    """Human-readable list of nodes that have not joined: absent, or present but not in Ray."""
    out = []
    for rank, host in enumerate(nodes):
        if rank in joined:
            continue
        if rank not in arrived:
            out.append(f"{host} (rank {rank}: its agent never wrote a node file)")
        else:
            state = arrived[rank].get("state", "?")
            out.append(f"{host} (rank {rank}: agent is `{state}`, not yet in the Ray cluster)")
    return out


def stale_nodes(
    arrived: Mapping[int, Mapping[str, Any]], max_age_s: float, now: float | None = None
) -> list[int]:
    """Ranks whose heartbeat is older than `max_age_s` and that did not finish."""
    now = time.time() if now is None else now
    return [
        rank
        for rank, data in arrived.items()
        if data.get("state") not in ("exited",) and now - float(data.get("time", 0)) > max_age_s
    ]


# --- stop requests ---------------------------------------------------------------------------


def request_stop(
    paths: RunPaths, rank: int, by: str, reason: str, exit_code: int | None = None
) -> bool:
    """Ask every node to end the job (`by`: host name of node `rank`); True when this call was
    the first request."""
    tmp = paths.root / f".stop.{os.getpid()}.{secrets.token_hex(3)}"
    data = {"rank": rank, "by": by, "reason": reason, "exit_code": exit_code, "time": time.time()}
    atomic_write_json(tmp, data)
    try:
        os.link(tmp, paths.stop)  # atomic and exclusive, also on NFS
        _fsync_dir(paths.root)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def read_stop(paths: RunPaths) -> dict[str, Any] | None:
    return read_json(paths.stop)


def this_host() -> str:
    return socket.gethostname()
