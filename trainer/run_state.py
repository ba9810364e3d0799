"""A run's state across its stops (:class:`RunState`): the step, the data position, which run
this is and where its checkpoints and metrics live; saving it beside the workers' shards,
resuming it, and reopening the metrics file after a resume.

Any loop over :class:`trainer.step.Stages` keeps its state here: the synchronous loop
(:class:`trainer.driver.PPODriver`) and an asynchronous one alike. What the state saves of its
own is small and independent of the number of ranks (:meth:`RunState.trainer_state`): the step,
the data position, the stages' KL controller, the RNG. The workers' shards are
:func:`trainer.stages.checkpoint.save`'s. A resume loads both, from a checkpoint written on any
number of ranks, and says how many logged steps are done again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.checkpoint import full_state as ckpt
from trainer.config import Config, config_to_dict, dump_config
from trainer.config.trainer import run_dir_of
from trainer.data import PromptLoader
from trainer.metrics import METRICS_FILE, MetricsLogger, last_step
from trainer.stages import checkpoint
from trainer.step import Stages

__all__ = ["RunState", "run_dir_of", "say_redone"]




class RunState:
    """The step, the data position (`loader`), the run's identity and directories; saved with
    the workers' shards of the stages it is given, and restored into them."""

    def __init__(self, cfg: Config, loader: PromptLoader) -> None:
        self.cfg, self.loader = cfg, loader
        self.ckpt_root = Path(cfg.trainer.default_local_dir or ".")
        self.run_dir = run_dir_of(cfg)
        self.global_step = 0
        self.data_position: dict[str, Any] | None = None
        """The data position a checkpoint records when it is not the loader's own: a loop that
        took the next batch ahead (one-step-off) sets the position before it, so that a resume
        gives that batch out again. None: the loader's."""
        self.loaded_position: dict[str, Any] | None = None
        """The data position of the checkpoint resumed from (None: a fresh start), for a loop
        that keeps more of it than the loader does (the fully-async prompt cursor)."""
        self._run: ckpt.RunIdentity | None = None

    @property
    def run(self) -> ckpt.RunIdentity:
        """This run (its run directory's persisted id): whose checkpoints it resumes and prunes."""
        if self._run is None:
            self._run = ckpt.run_identity(self.run_dir)
        return self._run

    def position(self) -> dict[str, Any]:
        """The data position a checkpoint records (:attr:`data_position`, else the loader's)."""
        return self.loader.state_dict() if self.data_position is None else self.data_position

    def trainer_state(self, stages: Stages) -> dict[str, Any]:
        """What the loop owns: step, data position, KL controller, RNG (small, world-size free)."""
        return {"global_step": self.global_step, "loader": self.position(),
                "kl_ctrl": stages.kl_ctrl.state_dict(), "rng": ckpt.capture_rng_state(), "world_size": stages.world}

    def save(self, stages: Stages) -> Path:
        """`<default_local_dir>/global_step_N/` (:func:`trainer.stages.checkpoint.save`)."""
        return checkpoint.save(
            self.ckpt_root, self.global_step, self.run, stages.groups(), self.trainer_state(stages),
            files={"config.yaml": dump_config(self.cfg)},
            metadata={"global_step": self.global_step, "epoch": self.position()["epoch"], "world_size": stages.world},
            keep_last=self.cfg.trainer.max_actor_ckpt_to_keep)

    def load(self, path: Path, stages: Stages) -> int | str:
        """Load a checkpoint written on any number of ranks into this state and `stages`' worker
        groups; returns that number."""
        state = checkpoint.load(path, stages.actor_group, stages.critic_group, self.cfg.algorithm.adv_estimator)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.loaded_position = dict(state["loader"])
        stages.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.restore_rng_state(state["rng"])
        return state.get("world_size", "?")  # type: ignore[no-any-return]

    def resume(self, stages: Stages) -> Path | None:
        """Load the checkpoint `trainer.resume_mode` selects; return it (None: a fresh start).
        The rollout gets the loaded weights from the caller's sync stage."""
        t = self.cfg.trainer
        start = time.perf_counter()
        path = ckpt.resolve_resume(self.ckpt_root, t.resume_mode, t.resume_from_path, run=self.run)
        others = ckpt.others_checkpoints(self.ckpt_root, self.run) if t.resume_mode == "auto" else []
        if others:
            print(f"trainer: note: `{self.ckpt_root}` also holds checkpoints of other runs "
                  f"({ckpt.describe_others(others)}); auto-resume takes only this run's "
                  f"(`{self.run.run_id}`)", flush=True)
        if path is not None:
            saved_on = self.load(path, stages)
            print(f"trainer: resumed from {path} (step {self.global_step}) (saved on {saved_on} rank(s)) "
                  f"on {stages.world} rank(s) in {time.perf_counter() - start:.1f}s", flush=True)
        return path

    def open_metrics(self, resumed: bool) -> MetricsLogger:
        """The run's metrics logger, the lines past the resumed step dropped."""
        t = self.cfg.trainer
        logged = last_step(self.run_dir / METRICS_FILE)
        if resumed or logged:  # a run killed before its first checkpoint starts over
            say_redone(self.global_step, logged)
        return MetricsLogger(self.run_dir, t.logger, keep_through=self.global_step if resumed else -1,
                             project=t.project_name, experiment=t.experiment_name, config=config_to_dict(self.cfg))


def say_redone(step: int, logged: int) -> None:
    """How many steps the earlier run logged after the checkpoint resumed from (they are done
    again): 0 when it saved at its stop."""
    redo = max(0, logged - step)
    span = "" if not redo else f" (step {logged})" if redo == 1 else f" (steps {step + 1}-{logged})"
    print(f"trainer: {redo} step(s) redone{span}: the last run logged step {logged}, "
          f"its newest checkpoint is step {step}", flush=True)
