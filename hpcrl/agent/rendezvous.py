"""Rendezvous of a job's node agents through the run directory on the shared filesystem.

The files of one run (restart `R`), named by :class:`hpcrl.rundir.RunPaths`: the canary
(`RUN/canary`, checked by every node), the Ray token, the head's publication, `head-alive`, one
file per node (arrival, state, heartbeat, final summary), the stop request (first writer wins)
and the batch script's `warning`.

Every file is written to a temporary name, flushed to disk and renamed, so a reader sees either
nothing or a complete file; except the node files, which their agent rewrites in place every
`BEAT_S` (a create and a rename per beat would cost the file system's metadata server two
operations per node every beat) and which the others read through descriptors they keep open,
taking a torn read for no news.

A node is alive while the content of its file changes (its agent's `beat` counter), timed on the
reader's own monotonic clock (:class:`Peers`): the nodes' wall clocks are never compared.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl import runstate
from hpcrl.rundir import RunDir, RunPaths
from hpcrl.runstate import AGENT_STARTED, read_state

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
        try:
            runstate.fs_write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
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


def node_record(rank: int, beat: int, state: Mapping[str, Any]) -> dict[str, Any]:
    """What a node file holds: `rank`, `beat` (one more at every write: what tells the readers
    that the node lives), `time` (the writer's wall clock, for people), `pid`, and `state`."""
    return {"rank": rank, "beat": beat, "time": time.time(), "pid": os.getpid(), **state}


@dataclass
class NodeFileWriter:
    """A node's own file, opened once and rewritten in place: a beat costs a write of the open
    file, no create, rename or directory sync. A shorter record is padded with blanks (JSON
    ignores them) rather than truncating the file, a metadata operation."""

    path: Path
    flush_always: bool = False
    """Flush every write, `sync` or not: NFS (its clients may hold a write back for 30 s)."""
    fd: int | None = None
    size: int = 0

    def write(self, data: Mapping[str, Any], sync: bool = False) -> None:
        """Rewrite the file with `data`; `sync`: flush it to the file system's servers too
        (a state change; on Lustre and GPFS, coherent across clients, the readers see a beat
        without, and a flush costs the metadata server an operation)."""
        raw = (json.dumps(data, sort_keys=True) + "\n").encode()
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self.size = os.fstat(self.fd).st_size
        try:
            runstate.fs_write(self.fd, raw.ljust(self.size), 0)
            if sync or self.flush_always:
                os.fsync(self.fd)
        except OSError:
            self.close()  # opened again at the next try (a stale handle stays stale)
            raise
        self.size = max(self.size, len(raw))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def fs_type(path: Path, mounts: Path = Path("/proc/self/mounts")) -> str:
    """The type of the file system holding `path` (`lustre`, `gpfs`, `nfs4`...; '' unknown)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return ""
    target, best, kind = os.path.realpath(path), "", ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def write_node(paths: RunPaths, rank: int, state: Mapping[str, Any], beat: int = 0) -> None:
    """Write node `rank`'s file once (its agent keeps a :class:`NodeFileWriter` open)."""
    writer = NodeFileWriter(paths.node_file(rank))
    try:
        writer.write(node_record(rank, beat, state), sync=True)
    finally:
        writer.close()


def _parse_node(raw: bytes) -> dict[str, Any] | None:
    """A node file's object; None while it is empty or torn (read mid-rewrite)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Peers:
    """The node files as one node reads them, through descriptors it keeps open (a read costs
    no open, lookup or close), and whether each node lives: its file's content changed within
    the last `max_age_s` of this reader's monotonic clock (`clock`). A node first seen counts
    as changed then; a torn or empty read is no news."""

    paths: RunPaths
    expected: int | None = None
    """How many nodes the job has: once every file is open, the directory is no longer listed."""
    clock: Callable[[], float] = time.monotonic
    data: dict[int, dict[str, Any]] = field(default_factory=dict)
    _fds: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, float] = field(default_factory=dict)
    """rank -> reader time of the last change (or of the first sight)."""
    _moved: dict[int, float] = field(default_factory=dict)
    """rank -> reader time of the last change seen (first sights excluded)."""
    _read_at: dict[tuple[int, ...] | None, float] = field(default_factory=dict)

    def read(self, ranks: Iterable[int] | None = None, max_age_s: float = 0.0
             ) -> dict[int, dict[str, Any]]:
        """The files of `ranks` (default: every file present), read again unless read within
        `max_age_s`; files that do not exist yet are left out."""
        wanted = None if ranks is None else sorted(ranks)
        key, now = None if wanted is None else tuple(wanted), self.clock()
        if (now - self._read_at.get(key, -math.inf) >= max_age_s
                or any(r not in self.data for r in wanted or ())):
            self._open(wanted)
            for rank in wanted if wanted is not None else sorted(self._fds):
                self._read_one(rank, now)
            self._read_at[key] = now
        return {r: d for r, d in self.data.items() if wanted is None or r in wanted}

    def _open(self, wanted: list[int] | None) -> None:
        if wanted is None and len(self._fds) != self.expected:
            try:
                names = os.listdir(self.paths.nodes)
            except FileNotFoundError:
                return
            wanted = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
        for rank in wanted or ():
            if rank not in self._fds:
                try:
                    self._fds[rank] = os.open(self.paths.node_file(rank), os.O_RDONLY)
                except FileNotFoundError:
                    pass

    def _read_one(self, rank: int, now: float) -> None:
        fd = self._fds.get(rank)
        if fd is None:
            return
        try:
            raw = os.pread(fd, 1 << 20, 0)
        except OSError:  # a stale handle: open the file again next time
            os.close(self._fds.pop(rank))
            return
        data = _parse_node(raw)
        if data is None or data == self.data.get(rank):
            return
        if rank in self.data:
            self._moved[rank] = now
        self.data[rank], self._seen[rank] = data, now

    def silent_s(self, rank: int) -> float:
        """Seconds of this reader's clock since node `rank`'s file last changed."""
        return self.clock() - self._seen.get(rank, self.clock())

    def stale(self, max_age_s: float, ranks: Iterable[int] | None = None) -> list[int]:
        """Ranks (of those read) whose file did not change for `max_age_s` and that did not
        finish (state `exited`)."""
        return [r for r in sorted(self.data) if (ranks is None or r in ranks)
                and self.data[r].get("state") != "exited" and self.silent_s(r) > max_age_s]

    def changed_after(self, rank: int, since: float) -> bool:
        """Whether node `rank`'s file changed after `since` (this reader's clock)."""
        return self._moved.get(rank, -math.inf) > since

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_nodes(paths: RunPaths) -> dict[int, dict[str, Any]]:
    """Every node file present, by rank, read once."""
    peers = Peers(paths)
    try:
        return peers.read()
    finally:
        peers.close()


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
