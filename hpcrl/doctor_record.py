"""Where `hpcrl doctor` records that a site passed: `$XDG_STATE_HOME/hpcrl/doctor/SITE.json`
(default `~/.local/state/hpcrl/doctor/`). `hpcrl submit` suggests the doctor where none is."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULT = "doctor.json"
"""The doctor job's rows, in its run directory."""


def row(check: str, ok: bool | None, detail: str, fix: str = "") -> dict[str, str]:
    status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    return {"check": check, "status": status, "detail": detail, "fix": "" if ok or ok is None else fix}



def state_file(site: str, environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    root = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME", "~")) / ".local" / "state")
    return Path(root).expanduser() / "hpcrl" / "doctor" / f"{site}.json"


def has_passed(site: str, environ: Mapping[str, str] | None = None) -> bool:
    return state_file(site, environ).is_file()


def record_pass(site: str, run_dir: Path, rows: Sequence[Mapping[str, Any]],
                environ: Mapping[str, str] | None = None) -> Path:
    path = state_file(site, environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"passed": time.time(), "run_dir": str(run_dir), "rows": list(rows)}))
    os.replace(tmp, path)
    return path


def suggestion(site: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The note `hpcrl submit` prints on a site the doctor has never passed."""
    if has_passed(site, environ):
        return None
    return (f"hpcrl: note: `hpcrl doctor --site {site}` has never passed here: it checks the "
            "container, the GPUs, the all-reduce between nodes and Ray in a short job")
