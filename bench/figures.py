"""Draws the documentation's figures from the numbers recorded in `bench/README.md`, so that a
figure shows what the record says and nothing else:

    .venv/bin/python -m bench.figures      # writes docs/img/first_step.png and docs/img/memory_plan.png

- `first_step.png`: seconds to the first finished step under hpcrl, the `srun ray start` recipe
  and `ray symmetric-run`, per node count: the `first-step` row of the headline figures (`make
  figures` measures it and redraws this figure from what it recorded, with its commit);
- `memory_plan.png`: what a step adds to a rank's memory, measured against the memory plan's
  estimate (the calibration table of "The memory plan against the measurement").

`docs/img/learning.png` is `hpcrl plot` of the learning run itself. The figures are committed
under `docs/img/`, where the docs and the repository's own view both find them.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

RECORD = Path(__file__).with_name("README.md")


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


def _number(text: str) -> float:
    return float(re.sub(r"[^0-9.\-]", "", text.split("(")[0]))


FIRST_STEP_RE = re.compile(r"N=(\d+): hpcrl ([\d.]+) s, symmetric-run ([\d.]+) s \([\d.]+\), "
                           r"srun \+ ray start ([\d.]+) s")


def headline_first_step(text: str) -> tuple[dict[int, dict[str, float]], str]:
    """({nodes: {'hpcrl'|'seed'|'symm.': seconds}}, commit) from the headline's `first-step` row."""
    from bench import headline

    row = headline.read_rows(text).get("first-step")
    if row is None:
        raise ValueError(f"{RECORD}: no `first-step` row among the headline figures: make figures")
    found = {int(n): {"hpcrl": float(h), "symm.": float(sy), "seed": float(se)}
             for n, h, sy, se in FIRST_STEP_RE.findall(row.value)}
    if not found:
        raise ValueError(f"{RECORD}: the `first-step` row says no `N=<nodes>: hpcrl <s> s, ...`: {row.value!r}")
    return found, row.commit


def calibration_rows(text: str) -> list[tuple[str, int, float, float]]:
    """[(precision, W, measured MiB added, estimated MiB added)] from the calibration table."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| precision | W |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        c = _cells(ln)
        added = re.search(r"\(\+([\d,]+)\)", c[3])
        if added is None:
            raise ValueError(f"{RECORD}: no `(+MiB)` in {c[3]!r}")
        rows.append((c[0], int(c[1]), _number(added.group(1)), _number(c[4])))
    return rows


def _pyplot() -> Any:
    """matplotlib's pyplot, headless, its caches in a temporary folder (never the home directory)."""
    import tempfile

    os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="hpcrl-mpl-"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_first_step(data: dict[int, dict[str, float]], commit: str, out: Path) -> None:
    plt = _pyplot()
    labels = {"hpcrl": "hpcrl", "seed": "srun + ray start recipe", "symm.": "ray symmetric-run"}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    nodes = sorted(data)
    width = 0.26
    for k, (key, label) in enumerate(labels.items()):
        xs = [n + (k - 1) * width for n in nodes]
        bars = ax.bar(xs, [data[n][key] for n in nodes], width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(nodes, [f"{n} node{'s' if n > 1 else ''}" for n in nodes])
    ax.set_ylabel("seconds to the first finished step")
    ax.set_title(f"Time to the first step (Slurm lab, 2 shared cores), at {commit}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_memory_plan(rows: list[tuple[str, int, float, float]], out: Path) -> None:
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{p} W={w}" for p, w, _, _ in rows]
    xs = range(len(rows))
    width = 0.38
    measured = ax.bar([x - width / 2 for x in xs], [r[2] for r in rows], width, label="measured")
    planned = ax.bar([x + width / 2 for x in xs], [r[3] for r in rows], width,
                     label="memory plan's estimate")
    ax.bar_label(measured, fmt="%d", fontsize=8)
    ax.bar_label(planned, fmt="%d", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("MiB a training step adds (largest rank)")
    ax.set_title("Memory plan against the measurement (144M model, CPU)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=RECORD.parent.parent / "docs" / "img")
    args = parser.parse_args(argv)
    text = RECORD.read_text()
    draw_first_step(*headline_first_step(text), args.out_dir / "first_step.png")
    draw_memory_plan(calibration_rows(text), args.out_dir / "memory_plan.png")
    print(f"wrote {args.out_dir / 'first_step.png'} and {args.out_dir / 'memory_plan.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
