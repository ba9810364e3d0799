"""`hpcrl plot RUN`: one PNG with reward, validation (accuracy or reward, with standard-error
bars), KL, entropy, response length and step time per step.

matplotlib is imported only here, when a plot is asked for, with the Agg backend (no display).
Restarts (a run that resumed from a checkpoint) are dashed vertical lines at the first step of
each later run, labelled `restart N` and how the run before it ended (from the state file).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl import rundir, runreport, runstate
from hpcrl.agent.requeue import REQUEUE


class PlotError(ValueError):
    """Nothing to plot; the message says why and what to do."""


@dataclass(frozen=True)
class Panel:
    """One subplot: a title and the metric names tried in order."""

    title: str
    names: tuple[str, ...]
    ylabel: str


PANELS = (
    Panel("reward", runreport.REWARD, "mean score"),
    Panel("validation", runreport.VALIDATION, "mean on the validation set"),
    Panel("KL", runreport.KL, "KL"),
    Panel("entropy", runreport.ENTROPY, "nats/token"),
    Panel("response length", runreport.RESPONSE_LENGTH, "tokens"),
    Panel("step time", runreport.STEP_TIME, "seconds"),
)

ASYNC_PANELS = (
    Panel("samples' lag (versions behind the trainer)", runreport.LAG, "versions"),
    Panel("idle share (trainer waiting for samples)", runreport.TRAINER_IDLE, "share of the step"),
)
"""Shown for a run of an asynchronous loop (one that logged a lag) only."""


def series(records: Sequence[dict[str, Any]], panel: Panel) -> tuple[str | None, list[int], list[float]]:
    """(metric name used, steps, values) of one panel; the first name (or `*` pattern) that any
    record has."""
    for pattern in panel.names:
        names = sorted({k for r in records for k in r if fnmatch.fnmatchcase(k, pattern)})
        for name in names[:1]:
            steps = [int(r["step"]) for r in records if isinstance(r.get(name), int | float)]
            values = [float(r[name]) for r in records if isinstance(r.get(name), int | float)]
            return name, steps, values
    return None, [], []


def build_figure(records: Sequence[dict[str, Any]], title: str = "",
                 endings: Mapping[int, str] | None = None) -> Any:
    """The matplotlib Figure: one row per panel, shared step axis, restarts marked (with how
    the run before each one ended, from `endings`: restart -> words)."""
    if not records:
        raise PlotError("no steps to plot: the run has not logged any step yet (`metrics.jsonl` "
                        "is empty); wait for the first step or check `hpcrl logs RUN`")
    try:
        import matplotlib
    except ModuleNotFoundError:  # a login node's `pip install hpcrl`: the light launcher
        raise PlotError("the plot needs matplotlib, which the light launcher (`pip install hpcrl`) leaves out. "
                        "Fix: `pip install 'hpcrl[plot]'` (matplotlib alone), or plot where `hpcrl[train]` "
                        "is installed; `hpcrl status RUN` prints the latest metrics without it") from None

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = PANELS + (ASYNC_PANELS if series(records, ASYNC_PANELS[0])[0] else ())
    fig = Figure(figsize=(8, 13 * len(panels) / len(PANELS)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    restarts = runreport.restart_starts(records)
    for ax, panel in zip(axes, panels, strict=True):
        name, steps, values = series(records, panel)
        if name is None:
            ax.text(0.5, 0.5, f"not logged ({', '.join(panel.names)})", ha="center",
                    va="center", transform=ax.transAxes, color="gray")
        else:
            ax.plot(steps, values, marker="o", markersize=3, label=name)
            sem = runreport.sem_name(name)
            errors = {int(r["step"]): r[sem] for r in records
                      if sem is not None and isinstance(r.get(sem), int | float)}
            if errors and set(errors) >= set(steps):
                ax.errorbar(steps, values, yerr=[errors[s] for s in steps], fmt="none",
                            capsize=3, label="± 1 standard error")
            ax.legend(loc="best", fontsize="small")
        ax.set_title(panel.title, loc="left", fontsize="medium")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        for restart, step in restarts:
            ax.axvline(step - 0.5, color="tab:red", linestyle="--", linewidth=1)
            if panel is PANELS[0]:
                why = (endings or {}).get(restart)
                ax.annotate(f"restart {restart}: resumed after step {step - 1}"
                            + (f" ({why})" if why else ""), xy=(step - 0.5, 1),
                            xycoords=("data", "axes fraction"),
                            xytext=(3, -12), textcoords="offset points", color="tab:red",
                            fontsize="small")
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[-1].set_xlabel("step")
    last = records[-1]
    total = last.get("training/total_steps")
    trained = len({int(r["step"]) for r in records if int(r["step"]) > 0})  # step 0: validation only
    summary = f"{trained} steps" + (f" of {total}" if isinstance(total, int) else "")
    if restarts:
        summary += f", {len(restarts)} restart{'s' if len(restarts) > 1 else ''}"
    fig.suptitle(f"{title}\n{summary}" if title else summary, fontsize="medium")
    return fig


def restart_endings(run_dir: Path) -> dict[int, str]:
    """restart R -> how run R-1 ended, from the state file (`run 0 stopped, requeued`)."""
    out = {}
    for r in rundir.restart_indices(run_dir):
        info = runstate.read_restart(run_dir, r)
        if info.ended is not None:
            requeued = ", requeued" if info.requeue_action == REQUEUE else ""
            out[r + 1] = f"run {r} {runstate.restart_state(info, alive=False)}{requeued}"
    return out


def plot_run(run_dir: Path, output: Path | None = None) -> tuple[Path, Any]:
    """Write the PNG of `run_dir` (default `RUN/metrics.png`); return (path, figure)."""
    metrics = runreport.find_metrics(run_dir)
    if metrics is None:
        raise PlotError(f"no `metrics.jsonl` in `{run_dir}` (searched 3 levels deep): is it a run "
                        "directory, and has the trainer logged a step yet?")
    fig = build_figure(runreport.read_metrics(metrics), title=str(run_dir),
                       endings=restart_endings(run_dir))
    out = output or rundir.RunDir(run_dir).plot
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out, fig
