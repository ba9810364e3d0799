"""torch's flight recorder in every trainer rank: what each rank's process groups last did (each
collective, its sequence number, sizes and state, and the Python stack that issued it), dumped
into the run directory when the watchdog fires (:mod:`trainer.watchdog`).

- :func:`recorder_env`: the variables torchtitan sets before its process group is made
  (`TORCH_FR_BUFFER_SIZE`, the successor of `TORCH_NCCL_TRACE_BUFFER_SIZE`; `TORCH_NCCL_DUMP_ON_TIMEOUT`;
  `TORCH_FR_DUMP_TEMP_FILE`, the successor of `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`), with the dump files
  at `<run_dir>/nccl_trace/rank_<r>`. Each rank sets them before it joins its group, on every
  backend: NCCL reads them, and so does gloo in torch >= 2.10 (its own flight recorder), so the
  CPU runs record too. NCCL's own watchdog then writes the same files when a collective passes
  `actor_rollout_ref.nccl_timeout`.
- :func:`start_listener`: a thread in the rank that waits on a named pipe (node-local, named by
  the rank's pid: :func:`pipe_path`) and, whenever a byte arrives, dumps the recorder to
  `rank_<r>` and a note on it to `notes/<r>.json` (the file, or why there is none). The watchdog
  writes the byte from the rank's own node (:func:`request_dump`), after the bound fired.

Why a thread and a pipe. A rank the watchdog finds stuck is usually blocked in a collective:
its main thread waits inside torch's C++ code (gloo's `wait`, a CUDA synchronisation behind
NCCL's stream) with the GIL released, so its other Python threads still run, while a signal
handler written in Python would wait for the main thread to come back. The dump itself is one
call into torch (`_dump_nccl_trace` where the group runs on NCCL, `_dump_fr_trace` for gloo), and
reading the pipe costs nothing while no one writes. What only a GPU reaches: NCCL's recorder
(entries whose state moves from `scheduled` to `completed` as their CUDA events fire, through
`started` with `TORCH_NCCL_ENABLE_TIMING=1`, so a dump tells the collective a GPU never finished)
and NCCL's dump on timeout; gloo's entries stay `scheduled`, and the group's `pg_status` tells
the last collective each rank enqueued and completed (:func:`summarise` reads that, on both). A rank
stopped (`T`) runs no thread at all and writes nothing; one in `D` state may.

Standard library at import; torch only inside the dump (the ranks have it loaded already).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["BUFFER_SIZE", "TRACE_DIR", "dump", "note_path", "note_time", "pipe_path", "read_note", "recorder_env",
           "request_dump", "start_listener", "summarise", "trace_path"]

TRACE_DIR = "nccl_trace"
"""The run directory's folder of the dumps (`rank_<r>`, torch's own file name) and their notes."""
BUFFER_SIZE = 20000
"""Entries each rank's recorder keeps (torchtitan's `comm.trace_buf_size`)."""


def recorder_env(folder: Path) -> dict[str, str]:
    """The flight recorder's variables, dumps into `folder/rank_<r>` (torch appends the rank)."""
    return {"TORCH_FR_BUFFER_SIZE": str(BUFFER_SIZE), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/rank_"}


def trace_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}"


def note_path(folder: Path, rank: int) -> Path:
    """The note beside a dump (a name without `rank_`: torch's analyzer, `fr_trace`, reads every
    file whose name holds its prefix)."""
    return folder / "notes" / f"{rank}.json"


def pipe_path(pid: int) -> Path:
    """The named pipe of process `pid` on this node: in its temporary folder, which the watchdog's
    task on the node shares (both are processes of the node's Ray), never on the shared file
    system."""
    return Path(tempfile.gettempdir()) / f"hpcrl-flight-recorder-{os.getuid()}-{pid}"


def start_listener(folder: Path, rank: int) -> threading.Thread | None:
    """Make this process's pipe and start the thread that dumps on each byte written to it; None
    (said on stderr) where the pipe cannot be made: the rank runs on, and a watchdog diagnosis
    says it listens for no dump request."""
    pipe = pipe_path(os.getpid())
    try:
        for old in pipe.parent.glob(f"hpcrl-flight-recorder-{os.getuid()}-*"):  # killed ranks' pipes (SIGKILL)
            pid = old.name.rsplit("-", 1)[-1]
            if pid.isdigit() and (int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists()):
                old.unlink(missing_ok=True)
        os.mkfifo(pipe, 0o600)
    except OSError as err:
        print(f"trainer: rank {rank}: no flight-recorder dumps at a watchdog fire: cannot make the pipe "
              f"`{pipe}` ({err.strerror}); point `TMPDIR` at a writable local folder", file=sys.stderr, flush=True)
        return None
    thread = threading.Thread(target=_listen, args=(pipe, folder, rank), name="hpcrl-flight-recorder", daemon=True)
    thread.start()
    return thread


def _listen(pipe: Path, folder: Path, rank: int) -> None:
    while True:
        with pipe.open("rb") as requests:  # blocks until a writer opens it
            if not requests.read():
                continue
        dump(folder, rank)


def dump(folder: Path, rank: int) -> dict[str, Any]:
    """Dump this process's flight recorder into `folder` (:func:`trace_path`) and write its note
    (:func:`note_path`): the file and a summary, or why there is no dump. Returns the note."""
    note: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "time": time.time()}
    try:
        data, note["recorder"] = _recorder_bytes()
    except _NoDump as why:
        data, note["why"] = None, str(why)
    except Exception as err:  # noqa: BLE001 - a diagnosis must not end the rank
        data, note["why"] = None, f"the dump raised {type(err).__name__}: {err}"
    if data is not None:
        path = trace_path(folder, rank)
        _write_atomic(path, data)
        note["file"] = str(path)
        note.update(summarise(pickle.loads(data)))
    _write_atomic(note_path(folder, rank), json.dumps(note).encode())
    return note


class _NoDump(Exception):
    """Why this process has nothing to dump."""


def _recorder_bytes() -> tuple[bytes, str]:
    """The recorder's pickle and its kind: NCCL's where the default group runs on NCCL, else
    the CPU recorder (gloo's)."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        raise _NoDump("this rank is in no process group")
    if dist.get_backend() == "nccl":  # in CUDA and ROCm builds only
        return bytes(getattr(c10d, "_dump_nccl_trace")()), "nccl"  # noqa: B009
    if not hasattr(c10d, "_dump_fr_trace"):
        raise _NoDump("this torch build has no NCCL, and no flight recorder for gloo (torch < 2.10)")
    return bytes(c10d._dump_fr_trace()), "gloo" if dist.is_nccl_available() else "gloo (this torch build has no NCCL)"


def summarise(trace: dict[str, Any]) -> dict[str, Any]:
    """What a dump (the recorder's dictionary) says in a line: its entries, and for each process
    group the last collective this rank enqueued and the last it completed, with the oldest
    collective past its group's last completed one (`pending`: the collective it waits in).

    An entry whose own `state` is `completed` is done: NCCL's recorder sets it at the dump from
    the collective's CUDA end event, a direct reading, while its group's `last_completed` can lag
    (on an H200, torch 2.11, NCCL 2.28.9: five finished all-reduces, `last_completed` still -1
    four seconds after their CUDA events fired; `bench/gpu_check.py`'s `flight_recorder`). Other
    entries are measured by their group's status, not by their `retired`: gloo's entries stay
    `scheduled`, and are retired some time after they complete."""
    entries = [e for e in trace.get("entries", []) if isinstance(e, dict)]
    groups = {str(pg): {"last_enqueued": s.get("last_enqueued_collective"),
                        "last_completed": s.get("last_completed_collective")}
              for pg, s in (trace.get("pg_status") or {}).items() if isinstance(s, dict)}

    def waiting(e: dict[str, Any]) -> bool:
        if e.get("state") == "completed":
            return False
        done = groups.get(str(e.get("pg_id")), {}).get("last_completed")
        if isinstance(done, int) and not e.get("is_p2p"):
            return int(e.get("collective_seq_id") or 0) > done
        return not e.get("retired")

    pending = [e for e in entries if waiting(e)]
    first = pending[0] if pending else None
    return {"entries": len(entries), "groups": groups,
            "pending": None if first is None else f"{first.get('profiling_name')} #{first.get('collective_seq_id')}"}


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_bytes(data)
    part.replace(path)


def request_dump(pid: int) -> str | None:
    """Ask process `pid` on this node to dump its recorder (a byte into its pipe); None when
    asked, else why not. Never blocks: a pipe no thread reads refuses the writer."""
    pipe = pipe_path(pid)
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return "the rank listens for no dump request (it started without the watchdog)"
    except OSError as err:  # ENXIO: the pipe is there, no thread reads it
        return f"no thread of the rank reads its dump request ({err.strerror})"
    try:
        os.write(fd, b"d")
    finally:
        os.close(fd)
    return None


def note_time(folder: Path, rank: int) -> float | None:
    """When `rank`'s last note was written (its own clock), None when there is none: the
    watchdog waits for it to change (the driver's clock may differ from the rank's node's)."""
    note = read_note(folder, rank)
    return None if note is None else float(note.get("time", 0))


def read_note(folder: Path, rank: int) -> dict[str, Any] | None:
    """The note of `rank`'s last dump (:func:`dump`), None when there is none."""
    try:
        note = json.loads(note_path(folder, rank).read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None
