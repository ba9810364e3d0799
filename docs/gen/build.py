"""Run by mkdocs-gen-files at build time: the benchmark record, `bench/README.md` as it is, as a
page of the site (the reference pages and figures are committed under `docs/`)."""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
HEADER = "<!-- copied at build time by docs/gen/build.py from bench/README.md: edit that file -->\n\n"

with mkdocs_gen_files.open("reference/benchmarks.md", "w") as fh:
    fh.write(HEADER + (ROOT / "bench" / "README.md").read_text())
