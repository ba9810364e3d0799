"""Metrics with verl's names, to a JSONL file (always), the console, TensorBoard, wandb and MLflow.

`<run_dir>/metrics.jsonl` holds one `{"step": N, ...}` object per line. When a run resumes from
step N the lines after N are dropped first, so the file never has a step missing or twice.
TensorBoard and wandb are imported only when `trainer.logger` names them; wandb runs offline
unless `WANDB_MODE` says otherwise (compute nodes often have no network; `wandb sync` later),
and a missing `wandb` package gives a warning, not a failure (the JSONL file has everything).
MLflow (`trainer.mlflow_tracking`) logs to `MLFLOW_TRACKING_URI` or a SQLite file in the run
directory; a missing `mlflow` package stops the run at its start, naming the fix.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TextIO

from trainer.mlflow_tracking import MlflowRun, MlflowUnavailable

if TYPE_CHECKING:
    import torch

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


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
        self._mlflow: Any = None
        if "mlflow" in self.loggers:
            try:
                self._mlflow = MlflowRun(self.run_dir, project, experiment, dict(config or {}))
            except MlflowUnavailable as err:
                raise MetricsError(str(err)) from None

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
        if self._mlflow is not None:
            self._mlflow.log(step, clean)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


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
    max_prompt_length: int,
    values: torch.Tensor | None = None,
    response_attention: torch.Tensor | None = None,
) -> dict[str, float]:
    """verl's `compute_data_metrics`: score, reward, advantage, return, value and length stats.

    Scores and rewards are over the rows with a response (verl leaves out aborted, empty ones);
    a prompt counts as clipped at `data.max_prompt_length` tokens, a response at
    `data.max_response_length`. Advantages, returns and values are over `response_mask` (the
    model's tokens); lengths count every attended response token, `response_attention` (tool
    turns included, verl's `_compute_response_info`), the same as `response_mask` by default."""
    mask = response_mask.bool()
    response_length = (response_mask if response_attention is None else response_attention).sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    answered = response_length > 0
    if not answered.any():
        raise ValueError("every response of the batch is empty; no step can learn from it")
    out = {
        **_stats("critic/score", sequence_score[answered]),
        **_stats("critic/rewards", sequence_reward[answered]),
        **_stats("critic/advantages", advantages[mask]),
        **_stats("critic/returns", returns[mask]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean().item(),
        **_stats("response_length_non_aborted", response_length[answered]),
        "response_length_non_aborted/clip_ratio":
            (response_length[answered] >= max_response_length).float().mean().item(),
        "response/aborted_ratio": (~answered).float().mean().item(),
        **_stats("prompt_length", prompt_length),
        "prompt_length/clip_ratio": (prompt_length >= max_prompt_length).float().mean().item(),
    }
    if values is not None:
        out.update(_stats("critic/values", values[mask]))
        # 1 - Var(returns - values) / Var(returns), unbiased variances over the response tokens
        diff_var = (returns[mask] - values[mask]).float().var()
        out["critic/vf_explained_var"] = (1.0 - diff_var / (returns[mask].float().var() + 1e-5)).item()
    return out


#: Phases timed per token over the response tokens (`gen`) or over all tokens (verl's list).
PER_TOKEN_PHASES = {"gen": "response", "ref": "all", "values": "all", "adv": "all",
                    "update_critic": "all", "update_actor": "all"}


def rollout_probs_diff(rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling probabilities are from the actor's on the sampled tokens,
    as verl logs it with `rollout.calculate_log_probs` (verl/utils/debug/metrics.py
    `calculate_debug_metrics`): `|p_actor - p_rollout|` over the response tokens (max, mean and
    the unbiased std) and the Pearson correlation of the two probabilities."""
    import torch

    mask = response_mask.bool()
    actor = torch.masked_select(actor_log_probs.float().exp(), mask)
    rollout = torch.masked_select(rollout_log_probs.float().exp(), mask)
    diff = (actor - rollout).abs()
    return {"training/rollout_probs_diff_valid": 1.0,
            "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()),
            "training/rollout_actor_probs_pearson_corr": float(torch.corrcoef(torch.stack([actor, rollout]))[0, 1])}


def timing_metrics(timings: Mapping[str, float], *, response_tokens: float | None = None,
                   all_tokens: float | None = None) -> dict[str, float]:
    """`timing_s/<phase>` for every timed phase and, given the step's token counts,
    `timing_per_token_ms/<phase>` for verl's phases (`PER_TOKEN_PHASES`)."""
    out = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    counts = {"response": response_tokens, "all": all_tokens}
    for name, over in PER_TOKEN_PHASES.items():
        tokens = counts[over]
        if name in timings and tokens:
            out[f"timing_per_token_ms/{name}"] = timings[name] * 1000 / tokens
    return out


def throughput_metrics(total_tokens: int, step_seconds: float, n_workers: int) -> dict[str, float]:
    """verl's `perf/total_num_tokens`, `perf/time_per_step` and `perf/throughput` (per worker)."""
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / max(n_workers, 1),
    }


# ------------------------------------------------------------------------- model FLOPs utilisation

#: Promised dense bf16 FLOP/s by device name (verl's `flops_counter` table); the first key, in
#: reverse alphabetical order, contained in the device's name wins, as in verl.
DEVICE_FLOPS = {
    "CPU": 448e9, "GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1336e12, "H100": 989e12,
    "H800": 989e12, "H200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362.05e12,
    "L40": 181.05e12, "A40": 149.7e12, "L20": 119.5e12, "H20": 148e12, "910B": 354e12,
    "Ascend910": 354e12, "RTX 3070 Ti": 21.75e12,
}

#: Model types whose FLOPs verl counts with the dense decoder formula (Llama/Qwen2 layout);
#: other types report an MFU of 0, as verl does for a model it cannot count.
DENSE_MODEL_TYPES = ("qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "qwen3", "minicpmv", "minicpmo",
                     "mistral", "seed_oss", "glm4v", "mimo")


def device_flops(device_name: str) -> float:
    """Promised FLOP/s of a device named `device_name` ("CPU" for the host); infinite for an
    unknown device (its MFU is then 0, as in verl)."""
    for key in sorted(DEVICE_FLOPS, reverse=True):
        if key in device_name:
            return DEVICE_FLOPS[key]
    return float("inf")


FLOPS_FIELDS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "num_hidden_layers", "vocab_size")


def flops_fields(config: Any) -> dict[str, Any]:
    """What :func:`train_flops` reads of a model config, as a plain dict (sent by each worker)."""
    return {name: getattr(config, name, None) for name in FLOPS_FIELDS}


def train_flops(config: Any, seqlens: Iterable[int]) -> float:
    """FLOPs of one forward and backward pass over sequences of `seqlens` tokens, verl's count
    for dense decoders: 6 x (the linear layers' and embeddings' parameters) per token, plus
    6 x seqlen^2 x head_dim x heads per layer for attention. 0 for other model types."""
    if isinstance(config, Mapping):
        config = SimpleNamespace(**config)
    if getattr(config, "model_type", None) not in DENSE_MODEL_TYPES:
        return 0.0
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    mlp = hidden * config.intermediate_size * 3
    attn_linear = hidden * (heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)
    dense = (mlp + attn_linear) * config.num_hidden_layers + config.vocab_size * hidden * 2
    lengths = list(seqlens)
    attention = 6 * sum(n * n for n in lengths) * head_dim * heads * config.num_hidden_layers
    return float(6 * dense * sum(lengths) + attention)


def mfu(config: Any, seqlens: Iterable[int], seconds: float, device_name: str, *, epochs: int = 1,
        world_size: int = 1) -> float:
    """verl's `perf/mfu/actor|critic`: the FLOP/s of `epochs` passes over the whole batch
    (`seqlens`: every row's token count) in `seconds`, per rank, over the device's promise."""
    if seconds <= 0:
        return 0.0
    return train_flops(config, seqlens) / seconds * epochs / device_flops(device_name) / world_size


# ------------------------------------------------------------------------- validation

#: Bootstrap draws and seed of the `best@N`, `worst@N` and `maj@N` estimates (verl's).
N_BOOTSTRAP, BOOTSTRAP_SEED = 1000, 42


def _subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below `n`, then `n` (none for a single response)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def _draws(n: int, k: int, seed: int) -> Any:
    """`N_BOOTSTRAP` samples of `k` indices out of `n`, with replacement: verl's draws
    (`np.random.seed(seed)` then `np.random.choice`), from a generator of their own."""
    import numpy as np

    return np.random.RandomState(seed).choice(n, size=(N_BOOTSTRAP, k), replace=True)


def _majority_value(values: list[float], preds: list[Any]) -> float:
    """The value of the first response whose `pred` is the most frequent (ties: the `pred`
    seen first)."""
    counts: dict[Any, int] = {}
    first: dict[Any, float] = {}
    for value, pred in zip(values, preds, strict=True):
        counts[pred] = counts.get(pred, 0) + 1
        first.setdefault(pred, value)
    return first[max(counts, key=lambda p: counts[p])]


def _prompt_metrics(values: list[float], preds: list[Any] | None, seed: int) -> dict[str, float]:
    """One prompt's `mean@n`, and for n > 1 `std@n` and the bootstrap `best@k`, `worst@k`
    (and `maj@k` given `preds`) means and standard deviations."""
    import numpy as np

    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    array = np.asarray(values, dtype=np.float64)
    for k in _subset_sizes(n):
        idx = _draws(n, k, seed)
        for name, reduced in (("best", array[idx].max(axis=1)), ("worst", array[idx].min(axis=1))):
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(np.mean(reduced)), float(np.std(reduced))
        if preds is not None:
            maj = np.array([_majority_value([values[i] for i in row], [preds[i] for i in row]) for row in idx])
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return out


def validation_metrics(data_sources: list[str], uids: list[Any], columns: Mapping[str, list[Any]],
                       seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """verl's validation metrics (`process_validation_metrics` and the `val-core`/`val-aux`
    split): for every data source and numeric column (`reward`, and what the reward function
    returned beside its score), each prompt's (`uids`) `mean@n`, `std@n`, `best@k`, `worst@k`
    and, where the reward function returns a `pred`, `maj@k`, averaged over the prompts.
    `val-core` holds the core column (`acc` where present, else `reward`) at the largest `n`
    (`mean`, `best` and `maj`); everything else is `val-aux`. Added here: `val-aux/.../sem@n`,
    the standard error of each column's `mean@n` over all its rows."""
    import numpy as np

    groups: dict[str, dict[Any, list[int]]] = {}
    for row, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(row)
    out: dict[str, float] = {}
    for source, prompts in groups.items():
        per_column: dict[str, dict[str, list[float]]] = {}
        for rows in prompts.values():
            preds = [columns["pred"][r] for r in rows] if "pred" in columns else None
            for name, values in columns.items():
                picked = [values[r] for r in rows]
                if not picked or isinstance(picked[0], str):
                    continue
                for metric, value in _prompt_metrics([float(v) for v in picked], preds, seed).items():
                    per_column.setdefault(name, {}).setdefault(metric, []).append(value)
        core = "acc" if "acc" in per_column else "reward"
        for name, metrics in per_column.items():
            n_max = max(int(m.split("@")[-1].split("/")[0]) for m in metrics)
            for metric, values in metrics.items():
                is_core = (name == core and metric.startswith(("mean", "maj", "best"))
                           and f"@{n_max}" in metric)
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(values))
            every = [float(columns[name][r]) for p in prompts.values() for r in p]
            sem = float(np.std(every, ddof=1) / np.sqrt(len(every))) if len(every) > 1 else 0.0
            out[f"val-aux/{source}/{name}/sem@{n_max}"] = sem
    return out
