"""`trainer.*`: the loop, logging, checkpoints and the cluster's size (verl's `trainer`
section), and verl's top-level Ray keys. Defaults: `trainer/config/trainer.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import h


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = h("passes over the training data")
    total_training_steps: int | None = h("stop after this many steps; null = epochs x batches")
    project_name: str = h("project name for loggers and the default checkpoint directory")
    experiment_name: str = h("experiment name for loggers and the default checkpoint directory")
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = h(
        "metric sinks; the JSONL file in `run_dir` is always written"
    )
    nnodes: int = h("nodes of the Ray cluster")
    log_val_generations: int = h(
        "at each validation, log this many samples (the same prompts every time: input, output, "
        "score) to `val_generations.jsonl` in `run_dir` and, with the console logger, print them")
    n_gpus_per_node: int = h("workers (GPUs) per node; CPU worker slots on nodes without GPUs")
    distributed: bool | None = h(
        "run on Ray worker groups (true) or in this process (false); null = Ray when "
        "`nnodes` x `n_gpus_per_node` > 1. Ray is joined at `RAY_ADDRESS` (never `auto`), "
        "or a private local cluster is started when it is unset"
    )
    device: Literal["auto", "cpu", "cuda"] = h("torch device of a run on one rank (several ranks: one GPU per rank, or CPUs)")
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
    max_actor_ckpt_to_keep: int | None = h("keep the newest K checkpoints; null = all")
    max_critic_ckpt_to_keep: int | None = h(
        "null or the same as `max_actor_ckpt_to_keep`: the critic is saved in the same checkpoint")
    balance_batch: bool = h("give data-parallel workers equal sample counts of similar token totals")
    seed: int = h("seed of model init, sampling and mini-batch shuffles")


#: verl's `trainer.*` (and top-level Ray) keys this trainer does not implement.
NOT_SUPPORTED: dict[str, str] = {
    "trainer.default_hdfs_dir": "HDFS upload",
    "trainer.del_local_ckpt_after_load": "",
    "trainer.validation_data_dir": "",
    "trainer.rollout_data_dir": "",
    "trainer.ray_wait_register_center_timeout": "",
    "trainer.esi_redundant_time": "",
    "trainer.profile_steps": "profiling",
    "trainer.controller_nsight_options": "profiling",
    "trainer.worker_nsight_options": "profiling",
    "ray_init": "",
    "ray_kwargs": "",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {
    "trainer.default_hdfs_dir": None,
    "trainer.del_local_ckpt_after_load": False,
}
