"""Metrics with verl's names, to a JSONL file (always), the console, TensorBoard and wandb.

`<run_dir>/metrics.jsonl` holds one `{"step": N, ...}` object per line. When a run resumes from
step N the lines after N are dropped first, so the file never has a step missing or twice.
TensorBoard and wandb are imported only when `trainer.logger` names them; wandb runs offline
unless `WANDB_MODE` says otherwise (compute nodes often have no network; `wandb sync` later),
and a missing `wandb` package gives a warning, not a failure (the JSONL file has everything).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


class MetricsError(ValueError):
    """A metrics sink cannot be set up; the message says how to fix it."""


def truncate_jsonl(path: Path, keep_through: int) -> int:
    """Drop lines whose `step` exceeds `keep_through` (atomically); return lines kept."""
    if not path.exists():
        return 0
    kept = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if int(record.get("step", -1)) <= keep_through:
                kept.append(json.dumps(record))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(kept)


def last_step(path: str | Path) -> int:
    """The highest `step` logged in `path` (0: none, or no file); a line cut short is skipped."""
    best = 0
    try:
        with Path(path).open() as fh:
            for line in fh:
                try:
                    best = max(best, int(json.loads(line).get("step", 0)))
                except (ValueError, TypeError, AttributeError):
                    continue
    except FileNotFoundError:
        pass
    return best


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def format_console(step: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step:{step}"]
    for key, value in metrics.items():
        parts.append(f"{key}:{value:.4g}" if isinstance(value, float) else f"{key}:{value}")
    return " - ".join(parts)


class MetricsLogger:
    """Writes each step's metrics to every configured sink."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: Iterable[str],
        *,
        keep_through: int,
        project: str = "hpcrl",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        """`keep_through`: last step whose lines stay in an existing file (-1 on a fresh run)."""
        self.loggers = list(dict.fromkeys(loggers))
        unknown = [name for name in self.loggers if name not in VALID_LOGGERS]
        if unknown:
            raise MetricsError(f"unknown `trainer.logger` entries {unknown}; valid: {', '.join(VALID_LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        truncate_jsonl(self.path, keep_through)
        self._file = self.path.open("a")
        self._stream = stream or sys.stdout
        self._tb: Any = self._open_tensorboard() if "tensorboard" in self.loggers else None
        self._wandb: Any = (
            self._open_wandb(project, experiment, dict(config or {})) if "wandb" in self.loggers else None
        )

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise MetricsError(
                f"`trainer.logger` includes `tensorboard` but it cannot be imported ({err}); "
                "`pip install tensorboard` or remove it from `trainer.logger`"
            ) from None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _open_wandb(self, project: str, experiment: str, config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError:
            print(
                "trainer: warning: `trainer.logger` includes `wandb` but the `wandb` package is not "
                f"installed; metrics still go to {self.path}. `pip install wandb` to use it, or "
                "remove `wandb` from `trainer.logger` to silence this",
                file=sys.stderr, flush=True,
            )
            return None
        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        mode: Any = os.environ.get("WANDB_MODE", "offline")
        return wandb.init(project=project, name=experiment, id=run_id, resume="allow", mode=mode,
                          dir=str(self.run_dir), config=config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        clean = {k: _plain(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if "console" in self.loggers:
            print(format_console(step, clean), file=self._stream, flush=True)
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# ------------------------------------------------------------------------- metric computations


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {
        f"{prefix}/mean": values.float().mean().item(),
        f"{prefix}/max": values.float().max().item(),
        f"{prefix}/min": values.float().min().item(),
    }


def data_metrics(
    *,
    sequence_score: torch.Tensor,
    sequence_reward: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_response_length: int,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """verl's `compute_data_metrics`: score, reward, advantage, return, value and length stats."""
    mask = response_mask.bool()
    response_length = response_mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    out = {
        **_stats("critic/score", sequence_score),
        **_stats("critic/rewards", sequence_reward),
        **_stats("critic/advantages", advantages[mask]),
        **_stats("critic/returns", returns[mask]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean().item(),
        **_stats("prompt_length", prompt_length),
    }
    if values is not None:
        out.update(_stats("critic/values", values[mask]))
    return out


def timing_metrics(timings: Mapping[str, float]) -> dict[str, float]:
    """`timing_s/<phase>` for every timed phase."""
    return {f"timing_s/{name}": seconds for name, seconds in timings.items()}


def throughput_metrics(total_tokens: int, step_seconds: float, n_workers: int) -> dict[str, float]:
    """verl's `perf/total_num_tokens`, `perf/time_per_step` and `perf/throughput` (per worker)."""
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / max(n_workers, 1),
    }
