"""verl itself as the payload: `hpcrl submit --verl -- <verl overrides>` runs the user's own
`python3 -m verl.trainer.main_ppo <overrides>` (their verl, in their image or venv; hpcrl imports
nothing of it) on the job's Ray cluster.

What this payload kind adds (read from verl 0.9.1's code, cited by file):

- Overrides (:func:`verl_overrides`): checkpoints under the run directory
  (`trainer.default_local_dir`) resumed with `trainer.resume_mode=auto`
  (`verl/trainer/ppo/ray_trainer.py` `_load_checkpoint`); `trainer.nnodes` and
  `trainer.n_gpus_per_node` from the allocation; the `file` logger added. Refused:
  `save_freq <= 0` (verl then never saves, not even at its early-save hook, `ray_trainer.py`
  `fit`), `ray_kwargs.ray_init.num_cpus/num_gpus` (Ray refuses them when it connects to the job's
  running cluster), numbers that disagree with the allocation, and a job that may shrink
  (`model_world_size_{N}_rank_{r}.pt`: verl's checkpoints are tied to the world size).
- Ray's environment (:func:`ray_env`): the job's end minus the warning lead as
  `MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`, which verl's `should_save_ckpt_esi`
  (`verl/utils/checkpoint/checkpoint_manager.py`) reads with `os.getenv` inside the TaskRunner
  actor after every step and forces a save when the time left is below 60 s plus its longest
  step; and `VERL_FILE_LOGGER_PATH`, one file per run of the job, since verl's `FileLogger`
  (`verl/utils/tracking.py`) truncates its file at every start.
- The stop (:class:`VerlStop`): verl's driver dies of SIGUSR2 (140) and Ray's driver handler
  exits 15 on SIGTERM, so verl runs under `verl_launch.py` with SIGTERM blocked and is never sent
  the stop signal; at a stop the head waits, bounded by what Slurm leaves, for a checkpoint newer
  than the one at the stop (`latest_checkpointed_iteration.txt`), then ends verl and the job is
  requeued (or cancelled) as after the trainer's exit 3.
- Status (:func:`merge_metrics`): verl's nested `{step, data}` records of every run become the
  run directory's flat `metrics.jsonl`, which `hpcrl status`, `plot` and `--follow` read.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.agent import requeue as rq
from hpcrl.rundir import CHECKPOINTS, RunPaths, restart_indices
from hpcrl.runreport import parse_metrics, tracked_checkpoint
from hpcrl.slurm import SlurmError, kill_wait_s, parse_slurm_time, show_job
from trainer.metrics import METRICS_FILE

MODULE = "verl.trainer.main_ppo"
KIND = "verl"
ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
LOGGER_ENV = "VERL_FILE_LOGGER_PATH"
LOGGER_FILE = "verl-metrics.jsonl"
"""verl's file logger's output in each run's directory (`RUN/<N>/verl-metrics.jsonl`)."""
LAUNCHER = "verl_launch.py"
CPUS_FIXED = 10
"""Ray CPUs verl 0.9.1 takes besides its GPU bundles: the TaskRunner (1), the TransferQueue
controller (1) and `num_data_storage_units` (8) storage actors at 1 CPU each."""
CPUS_PER_GPU = 3
"""Each GPU's bundle `{CPU: 3, GPU: 1}` (`verl/single_controller/ray/base.py`)."""
ASYNC_SAVE = "actor_rollout_ref.actor.checkpoint.async_save"
REFUSED_KEYS = ("ray_kwargs.ray_init.num_cpus", "ray_kwargs.ray_init.num_gpus")


class VerlError(ValueError):
    """verl's overrides cannot run under hpcrl as given; the message names the fix."""


def is_verl(payload: Sequence[str]) -> bool:
    """Whether `payload` (a job's argv) runs verl's trainer (`python -m verl.trainer.main_ppo`)."""
    return tuple(payload[1:3]) == ("-m", MODULE)


def given(overrides: Sequence[str]) -> dict[str, str]:
    """`key -> value` of the `key=value` overrides (`+`/`++` stripped, the last one wins; `~key`
    removes it): the keys hpcrl fills or refuses, read as verl's Hydra command line reads them."""
    out: dict[str, str] = {}
    for arg in overrides:
        if arg.startswith("~"):
            out.pop(arg[1:].split("=", 1)[0], None)
            continue
        key, eq, value = arg.lstrip("+").partition("=")
        if eq:
            out[key] = value.strip().strip("'\"")
    return out


def _number(key: str, value: str, fix: str) -> int:
    try:
        return int(value)
    except ValueError:
        empty = " (empty: a shell variable such as `$SLURM_NNODES` expanded to nothing where " \
                "the line was typed; the allocation exists only in the job)" if not value else ""
        raise VerlError(f"`{key}={value}` is not a whole number{empty}. Fix: {fix}") from None


def verl_overrides(overrides: Sequence[str], run_dir: Path, nodes: int, gpus: int,
                   node_range: str | None) -> list[str]:
    """The overrides verl runs with under hpcrl: `overrides` checked, with what hpcrl fills."""
    have, added = given(overrides), []
    if node_range:
        raise VerlError(
            f"the job may resume on {node_range} nodes (`--nodes MIN-MAX`, `slurm.min_nodes`), "
            "but verl's checkpoints are tied to the world size (`model_world_size_{N}_rank_{r}.pt`"
            ") and a smaller run cannot load them. Fix: ask for an exact node count")
    for key in REFUSED_KEYS:
        if key in have:
            raise VerlError(
                f"`{key}` makes Ray refuse to connect to the job's Ray cluster (it may be set "
                "only when Ray starts one itself); hpcrl sizes Ray to the allocation. Fix: leave "
                "it out (the site profile's `ray.num_cpus`/`ray.num_gpus` set Ray's numbers)")
    save_freq = _number("trainer.save_freq", have.get("trainer.save_freq", "-1"),
                        "give `trainer.save_freq=N` with N > 0")
    if save_freq <= 0:
        raise VerlError(
            f"`trainer.save_freq` is {save_freq}: verl then saves no checkpoint, not even at a "
            "stop (its early save is checked only with `save_freq > 0`), and a requeued run "
            "starts again from step 0. Fix: add `trainer.save_freq=N` with N > 0 (e.g. 10)")
    if have.get(ASYNC_SAVE, "false").lower() == "true":
        raise VerlError(
            f"`{ASYNC_SAVE}=True`: verl then writes no `latest_checkpointed_iteration.txt` "
            "(`ray_trainer.py` `_save_checkpoint`), so neither a resume nor hpcrl's stop finds "
            f"its checkpoints. Fix: leave `{ASYNC_SAVE}` out")
    mode = have.get("trainer.resume_mode", "auto")
    if mode != "auto":
        raise VerlError(
            f"`trainer.resume_mode={mode}`: a requeued run must resume from the newest "
            "checkpoint in the run directory. Fix: leave it out (hpcrl passes `auto`)")
    if gpus <= 0:
        raise VerlError(
            "the site grants no GPU (`slurm.gpus_per_node` and `ray.num_gpus` are 0), and verl "
            "0.9.1 has no CPU path (its resource pool needs GPUs). Fix: a site with "
            "`slurm.gpus_per_node` (or `--site` of a GPU partition)")
    for key, value in (("trainer.nnodes", nodes), ("trainer.n_gpus_per_node", gpus)):
        if key not in have:
            added.append(f"{key}={value}")
        elif _number(key, have[key], f"leave `{key}` out: hpcrl fills it ({value})") != value:
            raise VerlError(
                f"`{key}={have[key]}` disagrees with the allocation ({value}: "
                f"{'the nodes asked for' if key == 'trainer.nnodes' else 'GPUs per node'}). "
                f"Fix: leave `{key}` out (hpcrl fills it) or ask for that many")
    added += _paths(have, run_dir) + _logger(have)
    return [o for o in overrides if not _replaced(o, added)] + added


def _replaced(override: str, added: Sequence[str]) -> bool:
    key = override.lstrip("+").split("=", 1)[0]
    return any(a.split("=", 1)[0] == key for a in added)


def _paths(have: Mapping[str, str], run_dir: Path) -> list[str]:
    """`trainer.default_local_dir` in the run directory (a relative one is put there), and
    `resume_mode=auto` spelled out."""
    out = [] if "trainer.resume_mode" in have else ["trainer.resume_mode=auto"]
    value = have.get("trainer.default_local_dir")
    if value is None or not os.path.isabs(value):
        root = run_dir / (value or CHECKPOINTS)
        return [*out, f"trainer.default_local_dir={root}"]
    if not Path(value).is_relative_to(run_dir):
        raise VerlError(
            f"`trainer.default_local_dir={value}` is outside the run directory `{run_dir}`: "
            "hpcrl resumes from and reports the checkpoints it finds there. Fix: leave it out "
            "(`RUN/checkpoints`) or give a path relative to the run directory")
    return out


def _logger(have: Mapping[str, str]) -> list[str]:
    """verl's `file` logger added to `trainer.logger` (verl's default: console and wandb)."""
    text = have.get("trainer.logger", "[console,wandb]")
    names = [n.strip().strip("'\"") for n in text.strip("[]").split(",") if n.strip()]
    return [] if "file" in names else [f"trainer.logger=[{','.join([*names, 'file'])}]"]


def payload(python: str, overrides: Sequence[str]) -> tuple[str, ...]:
    """The job's payload argv: the user's verl line."""
    return (python, "-m", MODULE, *overrides)


# ----------------------------------------------------------------------------- on the nodes


def ray_env(paths: RunPaths, end_time: float | None, lead_s: float) -> dict[str, str]:
    """What verl must find in Ray's own environment (set before Ray starts, so every actor
    inherits it): its early-save deadline and this run's file-logger path."""
    env = {LOGGER_ENV: str(paths.root / LOGGER_FILE)}
    if end_time is not None:
        env[ESI_ENV] = f"{end_time - lead_s:.0f}"
    return env


def launcher_argv(python: str, helper: Path, argv: Sequence[str]) -> list[str]:
    """verl's line run under `verl_launch.py` (SIGTERM blocked, verl's version printed)."""
    return [python, str(helper), "--", *argv]


def cpus_needed(nodes: int, gpus_per_node: int) -> int:
    return CPUS_FIXED + CPUS_PER_GPU * nodes * gpus_per_node


def check_cpus(ray_cpus: int | None, payload_argv: Sequence[str]) -> str | None:
    """Why verl would hang waiting for Ray CPUs (it prints its config and waits without a
    word), or None."""
    have = given(payload_argv[3:])
    try:
        nodes, gpus = int(have["trainer.nnodes"]), int(have["trainer.n_gpus_per_node"])
    except (KeyError, ValueError):
        return None
    need = cpus_needed(nodes, gpus)
    if ray_cpus is None or ray_cpus >= need:
        return None
    return (f"verl needs {need} Ray CPUs ({CPUS_FIXED} for its TaskRunner, TransferQueue "
            f"controller and 8 storage units, {CPUS_PER_GPU} per GPU for {nodes * gpus} GPUs); "
            f"the job's Ray cluster has {ray_cpus}, and verl would wait for them without a word. "
            "Fix: more CPUs per node (`slurm.cpus_per_task`, or `ray.num_cpus` in the site "
            "profile)")


def checkpoint_root(payload_argv: Sequence[str], run_dir: Path) -> Path:
    value = given(payload_argv[3:]).get("trainer.default_local_dir")
    return Path(value) if value else run_dir / CHECKPOINTS


# ----------------------------------------------------------------------------- metrics


def flat_records(text: str, restart: int) -> list[dict[str, Any]]:
    """verl's `{step, data}` lines as hpcrl's flat records (`training/restart` added); a line
    cut short is skipped."""
    return [{**rec["data"], "step": rec["step"], "training/restart": restart}
            for rec in parse_metrics(text) if isinstance(rec.get("data"), dict)]


def merge_metrics(run_dir: Path) -> int:
    """Write `RUN/metrics.jsonl` from every run's verl file: a later run's steps replace the
    ones it redid. Returns the number of records (the file is rewritten only when it changes)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in restart_indices(run_dir):
        try:
            text = (RunPaths(run_dir, r).root / LOGGER_FILE).read_text(errors="replace")
        except OSError:
            continue
        records = flat_records(text, r)
        if records:
            first = min(x["step"] for x in records)
            by_step = {s: x for s, x in by_step.items() if s < first}
            by_step.update({x["step"]: x for x in records})
    text = "".join(json.dumps(by_step[s], sort_keys=True) + "\n" for s in sorted(by_step))
    target = run_dir / METRICS_FILE
    try:
        if target.read_text() == text:
            return len(by_step)
    except OSError:
        pass
    if by_step:
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    return len(by_step)


def last_logged(run_dir: Path) -> int:
    try:
        text = (run_dir / METRICS_FILE).read_text()
    except OSError:
        return 0
    steps = [int(m.group(1)) for m in re.finditer(r'"step": (\d+)', text)]
    return max(steps, default=0)


# ----------------------------------------------------------------------------- the stop


def redo_note(saved: int, logged: int) -> str:
    """What the next run redoes when verl ends unsaved: the steps after its newest checkpoint
    (`saved`, 0: none) up to the one in progress after the last logged step."""
    start = f"global_step_{saved}" if saved else "step 0"
    return (f"the next run resumes from {start} and redoes steps {saved + 1} to {logged + 1} "
            f"(step {logged + 1} was in progress)")


LOG_WAIT_S = 120.0
"""After the checkpoint at a stop, how long verl may take to log that step's metrics (it updates
the rollout's weights and may validate first)."""
STOP_MARGIN_S = 15.0
"""Left for ending verl, the teardown and the requeue before the bound Slurm sets."""


@dataclass
class VerlStop:
    """At a stop request: wait until verl saves a checkpoint newer than the one at the stop (or,
    at the time limit, until the last logged step is saved: verl's early-save hook did it before
    the stop), bounded by `bound` (epoch seconds); then end verl. `ended`: hpcrl ended it."""

    run_dir: Path
    root: Path
    log: Any
    at_stop: int | None = None
    bound: float | None = None
    ended: bool = False
    note: str = ""
    _asked: float = field(default=0.0)
    _saved_at: float = field(default=0.0)

    def begin(self, bound: float, why: str) -> None:
        newest = tracked_checkpoint(self.root)
        self.at_stop = newest[0] if newest else 0
        self.bound = bound
        self._asked = time.time()
        self.log.info("%s: verl is not signalled (it would die unsaved); waiting up to %.0f s "
                      "for a checkpoint newer than step %d (%s)", why, bound - time.time(),
                      self.at_stop, self.root / "latest_checkpointed_iteration.txt")

    def tick(self, payload: Any, clock_stop: bool) -> None:
        """Once the stop began: end verl when the checkpoint came or the bound passed."""
        if self.bound is None or self.ended:
            return
        merge_metrics(self.run_dir)
        newest = tracked_checkpoint(self.root)
        step = newest[0] if newest else 0
        logged = last_logged(self.run_dir)
        if step > (self.at_stop or 0):
            # verl logs a step's metrics after saving it (`ray_trainer.py` `fit`): let it
            self._saved_at = self._saved_at or time.time()
            if logged < step and time.time() < min(self.bound, self._saved_at + LOG_WAIT_S):
                return
            self.note = f"verl saved global_step_{step} after the stop; nothing is redone"
        elif clock_stop and step and step >= logged:
            self.note = (f"verl's early-save hook saved global_step_{step} (its last step) "
                         "before the stop; only the step in progress is redone")
        elif time.time() >= self.bound:
            self.note = f"no checkpoint newer than step {step} came in time: " \
                + redo_note(step, logged)
        else:
            return
        self.log.info("%s; ending verl", self.note)
        self.ended = True
        payload.send(signal.SIGKILL)

    def status(self, code: int, requeue_code: int) -> int:
        """The payload's status as the head reads it: a verl that hpcrl ended at a stop counts
        as the trainer's "checkpointed, requeue me"."""
        return requeue_code if self.ended else code


MERGE_EVERY_S = 2.0


@dataclass
class VerlKind:
    """The head's side of a verl payload while it runs: its metrics merged into
    `RUN/metrics.jsonl`, and the stop (:class:`VerlStop`) begun once the head's `StopControl`
    has a reason, bounded by what Slurm leaves for that kind of stop."""

    node: Any
    stop: Any
    waiter: VerlStop | None = None
    _merged: float = 0.0

    def tick(self, payload: Any) -> None:
        now = time.monotonic()
        if now - self._merged >= MERGE_EVERY_S:
            self._merged = now
            merge_metrics(self.node.run_dir)
        if self.stop.reason is None:
            return
        if self.waiter is None:
            self.waiter = VerlStop(self.node.run_dir,
                                   checkpoint_root(self.node.job.payload, self.node.run_dir),
                                   self.node.log)
            self.waiter.begin(self.bound(), self.stop.reason)
        clock = self.stop.terminated_by is None and self.stop.cancelled is None
        self.waiter.tick(payload, clock_stop=clock)

    def bound(self) -> float:
        """Until when verl may save: the job's end (less a margin) at the time limit and after
        `hpcrl cancel`; after SIGTERM, Slurm's KillWait, or the preemption's GraceTime first."""
        now, end = time.time(), self.stop.deadline.end_time
        if self.stop.terminated_by is None:
            return (end if end is not None else now + self.node.job.signal_lead_s) - STOP_MARGIN_S
        local = self.node.ctx.local
        info: dict[str, str] = {}
        if not local:
            try:
                info = show_job(self.node.ctx.job_id)
            except (SlurmError, OSError):
                pass
        grace_end = parse_slurm_time(info.get("EndTime", "")) if rq.preempted_in_grace(info) \
            else None
        if grace_end is not None:  # stopped within the grace time, the head requeues the job
            return grace_end - min(STOP_MARGIN_S, (grace_end - now) / 3)
        wait = float((None if local else kill_wait_s()) or self.node.job.grace_s)
        return now + wait - min(STOP_MARGIN_S, wait / 3)

    def after_loss(self) -> None:
        """A node is lost (or Ray died) while verl ran: nothing can be saved any more; the log
        names what the next run redoes."""
        merge_metrics(self.node.run_dir)
        newest = tracked_checkpoint(checkpoint_root(self.node.job.payload, self.node.run_dir))
        self.node.log.error("verl could not save: %s",
                            redo_note(newest[0] if newest else 0, last_logged(self.node.run_dir)))

    def status(self, code: int, requeue_code: int) -> int:
        merge_metrics(self.node.run_dir)
        return self.waiter.status(code, requeue_code) if self.waiter else code
