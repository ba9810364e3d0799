"""`hpcrl plot RUN`: a PNG with the six series against step (validation with error bars), restarts marked."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hpcrl.plotting import PANELS, PlotError, build_figure, plot_run
from tests.conftest import run_hpcrl
from tests.hpcrl.test_rundir import record, write_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    records = [record(s, 0, total=6, reward=0.1 * s) for s in (1, 2, 3)]
    records += [record(s, 1, total=6, reward=0.1 * s) for s in (4, 5, 6)]
    write_metrics(run / "metrics.jsonl", records)
    return run


def test_figure_has_the_six_series_and_the_restart(run: Path) -> None:
    out, fig = plot_run(run, run / "plot.png")
    assert png_size(out) == (800, 1300)
    axes = fig.get_axes()
    assert [a.get_title(loc="left") for a in axes] == [p.title for p in PANELS] == [
        "reward", "validation", "KL", "entropy", "response length", "step time"]
    assert axes[-1].get_xlabel() == "step"
    expected = {"reward": "critic/score/mean", "KL": "actor/kl_loss", "entropy": "actor/entropy",
                "response length": "response_length/mean", "step time": "timing_s/step"}
    for ax in axes:
        if ax.get_title(loc="left") == "validation":
            assert "not logged" in ax.texts[0].get_text()  # this run never validated
            continue
        data = [ln for ln in ax.get_lines() if ln.get_label() == expected[ax.get_title(loc="left")]]
        assert len(data) == 1, ax.get_title(loc="left")
        assert list(data[0].get_xdata()) == [1, 2, 3, 4, 5, 6]
        restart_lines = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [3.5, 3.5]]
        assert len(restart_lines) == 1, "restart 1 (first step 4) is marked on every panel"
    rewards = next(ln for ln in axes[0].get_lines() if ln.get_label() == "critic/score/mean")
    assert list(rewards.get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert any("restart 1: resumed after step 3" in t.get_text() for t in axes[0].texts)
    assert "6 steps of 6, 1 restart" in fig.texts[0].get_text()


def test_restart_says_how_the_run_before_it_ended(run: Path) -> None:
    """The state file tells why run 0 ended: it checkpointed (status 3) and was requeued."""
    from hpcrl import rundir, runstate
    from hpcrl.agent.requeue import REQUEUE

    for index in (0, 1):
        rundir.RunPaths(run, index).root.mkdir()
    head = runstate.StateWriter(run, 0, 0, "n1")
    head.append(runstate.PAYLOAD_EXITED, status=3)
    head.append(runstate.REQUEUE_DECIDED, action=REQUEUE, message="requeueing job 5")
    head.append(runstate.RUN_ENDED, summary="job 5 restart 0: payload exited with status 3")
    _, fig = plot_run(run, run / "plot.png")
    texts = [t.get_text() for t in fig.get_axes()[0].texts]
    assert "restart 1: resumed after step 3 (run 0 stopped, requeued)" in texts, texts


def test_step_axis_has_whole_numbers_only() -> None:
    fig = build_figure([{"step": s, "critic/score/mean": 0.1 * s} for s in (1, 2, 3, 4)])
    ticks = [t for t in fig.get_axes()[-1].get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks  # no "step 1.5"


def test_validation_accuracy_is_drawn_with_its_standard_error() -> None:
    """Validation before training (step 0) and every 2 steps: accuracy preferred over reward,
    with error bars from `val-aux/.../sem@1`."""
    src = "hpcrl/arith"
    val = {s: {f"val-core/{src}/reward/mean@1": 0.1 * s, f"val-core/{src}/acc/mean@1": 0.2 + 0.05 * s,
               f"val-aux/{src}/acc/sem@1": 0.02} for s in (0, 2, 4)}
    records = [{"step": 0, **val[0]}] + [{"step": s, "critic/score/mean": 0.1, **val.get(s, {})}
                                         for s in (1, 2, 3, 4)]
    fig = build_figure(records)
    assert [a for a in fig.get_axes() if a.containers] == [fig.get_axes()[1]], "error bars on validation only"
    ax = fig.get_axes()[1]
    [line] = [ln for ln in ax.get_lines() if ln.get_label() == f"val-core/{src}/acc/mean@1"]
    assert list(line.get_xdata()) == [0, 2, 4]
    assert list(line.get_ydata()) == pytest.approx([0.2, 0.3, 0.4])
    [bars] = [c for c in ax.containers if c.get_label() == "± 1 standard error"]
    segments = bars.lines[2][0].get_segments()
    assert [tuple(seg[:, 1]) for seg in segments] == [pytest.approx((y - 0.02, y + 0.02)) for y in (0.2, 0.3, 0.4)]


def test_missing_series_is_said_not_drawn() -> None:
    fig = build_figure([{"step": 1, "critic/score/mean": 0.2}])
    kl = fig.get_axes()[2]
    assert kl.get_lines() == [] and "not logged" in kl.texts[0].get_text()


def test_plot_command_writes_a_png(run: Path, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = run_hpcrl(["plot", str(run), "-o", str(tmp_path / "out.png")], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "out.png")
    assert png_size(tmp_path / "out.png") == (800, 1300)
    default = run_hpcrl(["plot", str(run)], env)
    assert default.returncode == 0 and (run / "metrics.png").stat().st_size > 10_000


def test_nothing_to_plot_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="no steps to plot"):
        build_figure([])
    empty = tmp_path / "empty"
    (empty).mkdir()
    (empty / "job.json").write_text('{"payload": []}')
    proc = run_hpcrl(["plot", str(empty)], {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "no `metrics.jsonl`" in proc.stderr
    proc = run_hpcrl(["plot", str(tmp_path / "nope" / "run")], {"PATH": "/usr/bin:/bin",
                                                                  "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_an_asynchronous_run_gets_its_lag_and_idle_panels() -> None:
    sync = build_figure([{"step": 1, "critic/score/mean": 0.2}])
    assert len(sync.get_axes()) == len(PANELS)
    fully = build_figure([{"step": s, "critic/score/mean": 0.2, "fully_async/lag/max": s % 2,
                           "fully_async/trainer/idle_ratio": 0.1 * s} for s in (1, 2, 3)])
    lag, idle = fully.get_axes()[-2:]
    assert len(fully.get_axes()) == len(PANELS) + 2
    assert list(lag.get_lines()[0].get_ydata()) == [1, 0, 1]
    assert list(idle.get_lines()[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])


def test_a_light_install_without_matplotlib_is_told_what_to_install(run: Path, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """A login node's `pip install hpcrl` has no matplotlib (`tests/lab/test_quickstart.py` runs
    the command there): the plot names the extra, and writes nothing."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    with pytest.raises(PlotError, match=r"pip install 'hpcrl\[plot\]'"):
        plot_run(run, run / "out.png")
    assert not (run / "out.png").exists()
