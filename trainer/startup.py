"""Where a run's start-up time goes: wall-clock marks from the process start to the first
finished step, written once per run to `<run_dir>/startup.json` (each run overwrites it).

What users wait for is the first finished training step, not "Ray is up";
`bench/first_step_lab.py` reads these marks beside the node agents' own. `python -m trainer`
marks the process's own start-up (`PROCESS`); each driver copies those into its `Clock`.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = "startup.json"

PROCESS: dict[str, float] = {}
"""This process's start-up marks (`python`, `imports`), set by `python -m trainer`."""


def mark_process(name: str) -> None:
    PROCESS.setdefault(name, time.time())


@dataclass
class Clock:
    """One run's marks: phase name -> Unix time it ended, in the order reached; a phase
    reached again keeps its first time."""

    marks: dict[str, float] = field(default_factory=lambda: dict(PROCESS))
    written: bool = False

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.time())

    def write_once(self, run_dir: Path) -> None:
        """After the first step: the marks, with the run's restart (`HPCRL_RESTART`)."""
        if self.written:
            return
        self.written = True
        data = {"restart": int(os.environ.get("HPCRL_RESTART", "0") or 0), "pid": os.getpid(),
                "marks": self.marks}
        tmp = run_dir / f".{FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(run_dir / FILE)


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
