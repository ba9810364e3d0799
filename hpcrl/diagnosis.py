"""A run's diagnoses: what the trainer found out about a failure that nothing else reports (a
rank that stopped making progress, a rank killed for memory), kept beside its metrics so that
`hpcrl status` shows it after the job has gone.

`<trainer run dir>/diagnosis.jsonl`, one JSON object a line, appended: ``time`` (epoch seconds),
``kind`` (``"hang"``, ``"oom"``, ...), ``summary`` (one line, the words a user reads first) and any
further fields the writer has (ranks, nodes, figures, files). Standard library only: the trainer
writes it, the launcher on a login node reads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DIAGNOSIS_FILE", "as_job_nodes", "blamed_nodes", "json_lines", "read_diagnoses", "slow_nodes",
           "write_diagnosis"]

DIAGNOSIS_FILE = "diagnosis.jsonl"


def write_diagnosis(run_dir: Path | str, kind: str, summary: str, **details: Any) -> Path:
    """Append one diagnosis to `run_dir`'s file (made if missing); return the file."""
    path = Path(run_dir) / DIAGNOSIS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"time": time.time(), "kind": kind, "summary": summary, **details}
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, default=str) + "\n")
    return path


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of `text`, one a line (the run directory's `.jsonl` files); a line cut
    short by a kill, or not an object, is skipped."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_diagnoses(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every diagnosis written to `run_dir` (none: an empty list); a line that is not a JSON
    object (a write cut short) is skipped."""
    path = Path(run_dir) / DIAGNOSIS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    return [r for r in json_lines(text) if isinstance(r.get("summary"), str)]


def blamed_nodes(run_dir: Path | str, since: float) -> list[str]:
    """The nodes the trainer's watchdog blamed for a stuck rank (a stopped or D-state process, or
    GPU errors on the node: uncorrected ECC, a failed row remap, an Xid or an amdgpu fault,
    :mod:`hpcrl.gpu_evidence`; `suspect_nodes` of a `hang` diagnosis) in diagnoses written at or
    after `since` (epoch seconds: this run's start)."""
    return _named_nodes(run_dir, since, "hang", "suspect_nodes")


def slow_nodes(run_dir: Path | str, since: float) -> list[str]:
    """The nodes the trainer named slow (`nodes` of a `slow` diagnosis,
    :mod:`trainer.stragglers`) in diagnoses written at or after `since`."""
    return _named_nodes(run_dir, since, "slow", "nodes")


def _named_nodes(run_dir: Path | str, since: float, kind: str, key: str) -> list[str]:
    out: set[str] = set()
    for record in read_diagnoses(run_dir):
        nodes = record.get(key)
        if record.get("kind") == kind and float(record.get("time", 0)) >= since and isinstance(nodes, list):
            out.update(str(n) for n in nodes)
    return sorted(out)


def as_job_nodes(hosts: Sequence[str], job_nodes: Sequence[str]) -> tuple[list[str], list[str]]:
    """`hosts` (the host names the trainer's ranks report) as the job's Slurm node names: the same
    name, or the same first label (`gpu017.cluster.local` is `gpu017`); and, apart, the hosts that
    are no node of the job (a container with a host name of its own), which Slurm would refuse in
    `ExcNodeList`."""
    by_short = {n.split(".")[0]: n for n in job_nodes}
    found: list[str] = []
    strangers: list[str] = []
    for host in hosts:
        node = host if host in job_nodes else by_short.get(host.split(".")[0])
        if node is None:
            strangers.append(host)
        elif node not in found:
            found.append(node)
    return found, strangers
