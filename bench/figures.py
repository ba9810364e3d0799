"""Draws the documentation's figures from the numbers recorded in `bench/README.md`, so that a
figure shows what the record says and nothing else:

    .venv/bin/python -m bench.figures      # writes docs/img/first_step.png and docs/img/memory_plan.png

- `first_step.png`: seconds to the first finished step under hpcrl, the `srun ray start` recipe
  and `ray symmetric-run` at 1, 2 and 3 nodes (the last "first step done" row of "Time to the
  first finished step": the trainer starting with the head alone; the earlier row was measured
  in another run, whose seconds do not compare);
- `memory_plan.png`: what a step adds to a rank's memory, measured against the memory plan's
  estimate (the calibration table of "The memory plan against the measurement").

`docs/img/learning.png` is `hpcrl plot` of the learning run itself. The figures are committed
under `docs/img/`, where the docs and the repository's own view both find them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RECORD = Path(__file__).with_name("README.md")


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


def _number(text: str) -> float:
    return float(re.sub(r"[^0-9.\-]", "", text.split("(")[0]))


def first_step_rows(text: str) -> dict[str, dict[str, list[float]]]:
    """{'before'|'after': {'hpcrl'|'seed'|'symm.': [N=1, N=2, N=3]}} from the record."""
    header = next(ln for ln in text.splitlines() if ln.startswith("| phase | hpcrl N=1"))
    names = _cells(header)[1:]
    rows = [ln for ln in text.splitlines() if ln.startswith("| **first step done**")]
    if len(rows) != 2:
        raise ValueError(f"{RECORD}: expected two `first step done` rows, found {len(rows)}")
    out: dict[str, dict[str, list[float]]] = {}
    for label, row in zip(("before", "after"), rows, strict=True):
        series: dict[str, list[float]] = {}
        for name, cell in zip(names, _cells(row)[1:], strict=True):
            series.setdefault(name.split(" N=")[0], []).append(_number(cell))
        out[label] = series
    return out


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


def draw_first_step(data: dict[str, dict[str, list[float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"hpcrl": "hpcrl", "seed": "srun + ray start recipe", "symm.": "ray symmetric-run"}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    nodes = [1, 2, 3]
    width = 0.26
    for k, (key, label) in enumerate(labels.items()):
        xs = [n + (k - 1) * width for n in nodes]
        bars = ax.bar(xs, data["after"][key], width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(nodes, [f"{n} node{'s' if n > 1 else ''}" for n in nodes])
    ax.set_ylabel("seconds to the first finished step")
    ax.set_title("Time to the first step (lab, 2 shared cores, medians of 2)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_memory_plan(rows: list[tuple[str, int, float, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    draw_first_step(first_step_rows(text), args.out_dir / "first_step.png")
    draw_memory_plan(calibration_rows(text), args.out_dir / "memory_plan.png")
    print(f"wrote {args.out_dir / 'first_step.png'} and {args.out_dir / 'memory_plan.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
