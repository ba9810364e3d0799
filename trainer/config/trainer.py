"""`trainer.*`: the loop, logging, checkpoints and the cluster's size (verl's `trainer`
section), and verl's top-level Ray keys. Defaults: `trainer/config/trainer.yaml`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.config.base import GPUS_ENV, PROFILER, ConfigError, h


@dataclass(frozen=True)
class WatchdogConfig:
    enable: bool = h("end a run whose call to the ranks runs far past its usual time, naming the ranks "
                     "that did not answer, with their stacks (`<run_dir>/stacks/`), their flight recorders "
                     "(`<run_dir>/nccl_trace/`) and each node's GPU errors; Ray ranks only")
    floor_s: float = h("a call's bound until it has `warmup` durations in its phase (the first steps compile "
                       "and warm caches; the ranks' start, loading the models, is not bounded)")
    multiple: float = h("afterwards the bound is this many times the median of the call's earlier durations")
    min_s: float = h("... and at least this many seconds")
    warmup: int = h("durations of a call before its median sets the bound (a requeued run: those its earlier "
                    "runs kept in `<run_dir>/watchdog/` count, once it has made the call itself)")
    poll_s: float = h("how often the driver checks a call still running (a hang is found at most this late)")
    slow_factor: float = h("a node whose rollout is slower per generated token than this many times the median "
                           "of the other nodes' in a step is past the bound (`trainer.stragglers`); above 1")
    slow_steps: int = h("steps in a row past the bound before the node is named slow (in the log and as a "
                        "diagnosis `hpcrl status` shows; the run goes on)")


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = h("passes over the training data")
    total_training_steps: int | None = h("stop after this many steps; null = epochs x batches")
    project_name: str = h("project name for loggers and the default checkpoint directory")
    experiment_name: str = h("experiment name for loggers and the default checkpoint directory")
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = h(
        "metric sinks; the JSONL file in `run_dir` is always written; `mlflow` logs to "
        "`MLFLOW_TRACKING_URI`, else `<run_dir>/mlruns.db` (see trainer.mlflow_tracking)"
    )
    nnodes: int = h("nodes of the Ray cluster")
    use_legacy_worker_impl: Literal["auto", "enable", "disable"] = h(
        "verl's worker switch, here the loss normalisers: auto/enable = verl's default worker (each "
        "micro-batch's mean times 1/gradient accumulation), disable = verl's model engine (the "
        "actor divides by the whole mini-batch's tokens or rows; the critic sums micro-batch means)")
    log_val_generations: int = h(
        "at each validation, log this many samples (the same prompts every time: input, output, "
        "score) to `val_generations.jsonl` in `run_dir` and, with the console logger, print them")
    n_gpus_per_node: int | None = h(
        "workers (GPUs) per node; CPU worker slots on nodes without GPUs. null (verl's default is 8) = "
        "under hpcrl the GPUs per node the job was granted (the profile's `slurm.gpus_per_node`, "
        "`HPCRL_GPUS_PER_NODE`), standalone the GPUs this process sees; 1 where there are none")
    distributed: bool | None = h(
        "run on Ray worker groups (true) or in this process (false); null = Ray when "
        "`nnodes` x `n_gpus_per_node` > 1. Ray is joined at `RAY_ADDRESS` (never `auto`), "
        "or a private local cluster is started when it is unset"
    )
    device: Literal["auto", "cpu", "cuda"] = h(
        "torch device of a run on one rank (several ranks: one GPU per rank, or CPUs); a worker given "
        "a GPU (by Ray, a visible-device variable or `cuda`) that torch cannot see refuses to start "
        "unless this is `cpu`")
    save_freq: int = h("checkpoint every N steps; -1 = only on stop and at the end")
    resume_mode: Literal["auto", "disable", "resume_path"] = h(
        "auto: newest complete checkpoint; disable: start fresh; resume_path: `resume_from_path`"
    )
    resume_from_path: str | None = h("checkpoint directory for `resume_mode=resume_path`")
    val_before_train: bool = h("validate once before the first step")
    val_only: bool = h("validate once, log it, and exit without training (a model's baseline)")
    test_freq: int = h("validate every N steps; -1 = never")
    critic_warmup: int = h("steps during which only the critic is trained")
    default_local_dir: str | None = h(
        "checkpoint root; null = `$HPCRL_RUN_DIR/checkpoints` under hpcrl, else "
        "checkpoints/<project>/<experiment>"
    )
    run_dir: str | None = h(
        "metrics file and STOP file directory; null = `$HPCRL_RUN_DIR` under hpcrl, else "
        "`default_local_dir`"
    )
    deadline_margin_s: float = h(
        "seconds kept free before the job's end (`HPCRL_JOB_END_TIME`, set by hpcrl) for the "
        "launcher to stop and requeue: the trainer checkpoints and stops by itself when one more "
        "step and a checkpoint would not fit"
    )
    watchdog: WatchdogConfig = h("the progress watchdog (`trainer.watchdog.*`)")
    max_actor_ckpt_to_keep: int | None = h("keep the newest K checkpoints; null = all")
    max_critic_ckpt_to_keep: int | None = h(
        "null or the same as `max_actor_ckpt_to_keep`: the critic is saved in the same checkpoint")
    balance_batch: bool = h("give data-parallel workers equal sample counts of similar token totals")
    seed: int = h("seed of model init, sampling and mini-batch shuffles")
    rollout_data_dir: str | None = h(
        "write each step's generations to `<dir>/<step>.jsonl` as verl does (input, output, gts, "
        "score, step, and the reward extras); null = do not")
    validation_data_dir: str | None = h(
        "write each validation's generations, every row, to `<dir>/<step>.jsonl` as verl does "
        "(the columns of `rollout_data_dir` and `reward`); null = do not")


_OLD_PROFILER = ("verl's older profiler keys; verl now reads `global_profiler.*` and `<role>.profiler.*`, "
                 "which are accepted here (the profiler changes no number)")

def default_gpus_per_node(env: Mapping[str, str]) -> int:
    """`trainer.n_gpus_per_node` when it is null: `HPCRL_GPUS_PER_NODE` (set by hpcrl from the
    GPUs asked of Slurm) when set, else the GPUs visible to this process; at least 1 (one CPU
    worker on a node without GPUs)."""
    given = env.get(GPUS_ENV)
    if given is None:
        return max(visible_gpus(), 1)
    try:
        return max(int(given), 1)
    except ValueError:
        raise ConfigError(f"`{GPUS_ENV}={given}` is not a whole number; it is set by hpcrl to the "
                          "GPUs per node of the job (unset it, or set `trainer.n_gpus_per_node`)") from None


def visible_gpus() -> int:
    """GPUs this process sees (`CUDA_VISIBLE_DEVICES` / ROCm's variables applied), counted by
    torch without initialising CUDA (NVML on NVIDIA); 0 without GPUs or a CUDA/ROCm torch."""
    import torch

    return int(torch.cuda.device_count())


#: verl's `trainer.*` (and top-level Ray) keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "trainer.default_hdfs_dir": "HDFS upload",
    "trainer.del_local_ckpt_after_load": "",
    "trainer.ray_wait_register_center_timeout": "",
    "trainer.esi_redundant_time": "",
    "trainer.profile_steps": _OLD_PROFILER,
    "trainer.controller_nsight_options": _OLD_PROFILER,
    "trainer.worker_nsight_options": _OLD_PROFILER,
    "ray_init": "",
    "ray_kwargs": "",
}

#: Keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "global_profiler": PROFILER,
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "trainer.default_hdfs_dir": None,
    "trainer.del_local_ckpt_after_load": False,
}


def run_dir_of(cfg: Any) -> Path:
    """The run's directory (metrics, STOP file, diagnoses, stacks, memory samples):
    `trainer.run_dir`, or where the checkpoints go when it is unset."""
    t = cfg.trainer
    return Path(t.run_dir) if t.run_dir else Path(t.default_local_dir or ".")
