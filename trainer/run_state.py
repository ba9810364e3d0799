"""A run's state across its stops: what the driver saves beside the workers' shards, how a run
resumes, and how the metrics file is reopened after a resume.

The driver owns little: the step, the data position, the KL controller and the RNG, small and
independent of the number of ranks (:func:`trainer_state`). The workers' shards are
:func:`trainer.stages.checkpoint.save`'s. A resume loads both, from a checkpoint written on any
number of ranks, and says how many logged steps are done again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import full_state as ckpt
from trainer.config import config_to_dict, dump_config
from trainer.metrics import METRICS_FILE, MetricsLogger, last_step
from trainer.stages import checkpoint

if TYPE_CHECKING:
    from trainer.driver import PPODriver

__all__ = ["load", "open_metrics", "resume", "save", "trainer_state"]


def trainer_state(driver: PPODriver) -> dict[str, Any]:
    """What the driver owns: step, data position, KL controller, RNG (small, world-size free)."""
    return {"global_step": driver.global_step, "loader": driver.loader.state_dict(),
            "kl_ctrl": driver.kl_ctrl.state_dict(), "rng": ckpt.capture_rng_state(), "world_size": driver.world}


def save(driver: PPODriver) -> Path:
    """`<default_local_dir>/global_step_N/` (:func:`trainer.stages.checkpoint.save`)."""
    return checkpoint.save(
        driver.ckpt_root, driver.global_step, driver.run, driver.stages.groups(), trainer_state(driver),
        files={"config.yaml": dump_config(driver.cfg)},
        metadata={"global_step": driver.global_step, "epoch": driver.loader.epoch, "world_size": driver.world},
        keep_last=driver.cfg.trainer.max_actor_ckpt_to_keep)


def load(driver: PPODriver, path: Path) -> int | str:
    """Load a checkpoint written on any number of ranks into `driver`; returns that number."""
    state = checkpoint.load(path, driver.actor_group, driver.critic_group, driver.cfg.algorithm.adv_estimator)
    driver.global_step = int(state["global_step"])
    driver.loader.load_state_dict(state["loader"])
    driver.kl_ctrl.load_state_dict(state["kl_ctrl"])
    ckpt.restore_rng_state(state["rng"])
    return state.get("world_size", "?")  # type: ignore[no-any-return]


def resume(driver: PPODriver) -> Path | None:
    """Load the checkpoint `trainer.resume_mode` selects; return it (None: a fresh start)."""
    t = driver.cfg.trainer
    start = time.perf_counter()
    path = ckpt.resolve_resume(driver.ckpt_root, t.resume_mode, t.resume_from_path, run=driver.run)
    others = ckpt.others_checkpoints(driver.ckpt_root, driver.run) if t.resume_mode == "auto" else []
    if others:
        print(f"trainer: note: `{driver.ckpt_root}` also holds checkpoints of other runs "
              f"({ckpt.describe_others(others)}); auto-resume takes only this run's "
              f"(`{driver.run.run_id}`)", flush=True)
    if path is not None:
        saved_on = load(driver, path)
        print(f"trainer: resumed from {path} (step {driver.global_step}) (saved on {saved_on} rank(s)) "
              f"on {driver.world} rank(s) in {time.perf_counter() - start:.1f}s", flush=True)
    return path


def open_metrics(driver: PPODriver, resumed: bool) -> MetricsLogger:
    """The run's metrics logger, the lines past the resumed step dropped."""
    t = driver.cfg.trainer
    logged = last_step(driver.run_dir / METRICS_FILE)
    if resumed or logged:  # a run killed before its first checkpoint starts over
        say_redone(driver.global_step, logged)
    return MetricsLogger(driver.run_dir, t.logger, keep_through=driver.global_step if resumed else -1,
                         project=t.project_name, experiment=t.experiment_name, config=config_to_dict(driver.cfg))


def say_redone(step: int, logged: int) -> None:
    """How many steps the earlier run logged after the checkpoint resumed from (they are done
    again): 0 when it saved at its stop."""
    redo = max(0, logged - step)
    span = "" if not redo else f" (step {logged})" if redo == 1 else f" (steps {step + 1}-{logged})"
    print(f"trainer: {redo} step(s) redone{span}: the last run logged step {logged}, "
          f"its newest checkpoint is step {step}", flush=True)
