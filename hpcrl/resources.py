"""Where the shipped data directories are, in a checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

DATA_DIRS = ("sbatch_templates", "site_profiles", "containers")


def data_dir(name: str) -> Path:
    """Return the directory `name` (one of `DATA_DIRS`), installed or in the source tree."""
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data directory `{name}`; valid: {', '.join(DATA_DIRS)}")
    here = Path(__file__).resolve().parent
    for candidate in (here / "_data" / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"hpcrl's `{name}` directory is missing (looked in {here / '_data'} and {here.parent}); "
        "reinstall hpcrl (`pip install hpcrl`) or run from a complete checkout"
    )
