"""Stand-in for verl 0.9.1's `python3 -m verl.trainer.main_ppo` in hpcrl's tests: verl's stop,
checkpoint and logging behaviour without a model or a GPU. Each behaviour it copies, with the
file and line of verl 0.9.1 (the `verl-0.9.1-py3-none-any.whl` of PyPI) it comes from:

- The driver connects to the running Ray cluster with `ray.init()` and no address
  (`verl/trainer/main_ppo.py:74`, `run_ppo`; Ray then takes `RAY_ADDRESS`) and runs the training
  loop in a TaskRunner actor (`main_ppo.py:91-92`, `runner.run.remote(config)`).
- Signals: the driver dies of SIGUSR2, which nothing catches (status 140 in a shell); on SIGTERM
  it exits 15 through the handler `ray.init` installs in the driver (Ray 2.60
  `ray/_private/worker.py:1675`, `sigterm_handler` -> `sys.exit(signum)`), which this stand-in
  gets from the same `ray.init()`.
- The early save (`verl/utils/checkpoint/checkpoint_manager.py:262`, `should_save_ckpt_esi`,
  called in `verl/trainer/ppo/ray_trainer.py:1693` after the actor update, inside the TaskRunner
  actor): the actor reads `MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP` with `os.getenv` and
  saves when `0 < remaining <= 60 + max_steps_duration + esi_redundant_time`, only with
  `save_freq > 0` (`ray_trainer.py:1704`); `max_steps_duration` is the longest step before this
  one (updated at the step's end, `ray_trainer.py:1762`).
- Checkpoints (`ray_trainer.py:983` `_save_checkpoint`, `:1052` `_load_checkpoint`;
  `verl/utils/checkpoint/fsdp_checkpoint_manager.py:213,233,242`): under
  `trainer.default_local_dir`, `global_step_{N}/actor/model_world_size_{W}_rank_{r}.pt`,
  `optim_world_size_{W}_rank_{r}.pt`, `extra_state_world_size_{W}_rank_{r}.pt`,
  `global_step_{N}/data.pt` (`ray_trainer.py:1032`), then `latest_checkpointed_iteration.txt`
  holding `N`, written last (`ray_trainer.py:1046-1050`). `resume_mode=auto` resumes from the
  step the tracker names (`checkpoint_manager.py:222` `find_latest_ckpt_path`) and prints
  `Resuming from <folder>` (`ray_trainer.py:1086`).
- The metrics of a step are logged after its checkpoint (`ray_trainer.py` `fit`: save, weight
  update, validation, then the loggers).
- The loggers write a step in the order `trainer.logger` names them (`verl/utils/tracking.py:191`
  `Tracking.log`; hpcrl appends `file`, so the console line comes first).
- The file logger (`verl/utils/tracking.py:529` `FileLogger`): opens `VERL_FILE_LOGGER_PATH`
  with mode `wb` (truncated at each start, `:541`) and writes `{"step": N, "data": {...}}`
  lines (`:544`).

`tests/hpcrl/payloads/test_verl_layout.py` checks this layout against real verl's checkpoint
code where verl 0.9.1 is installed. Test knob (environment): `STANDIN_STEP_S` (seconds per
step, default 1).
"""

from __future__ import annotations

import json
import os
import sys
import time

ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
TRACKER = "latest_checkpointed_iteration.txt"


def config(argv: list[str]) -> dict[str, str]:
    out = {"trainer.total_training_steps": "10", "trainer.save_freq": "-1",
           "trainer.resume_mode": "auto", "trainer.nnodes": "1", "trainer.n_gpus_per_node": "8",
           "trainer.default_local_dir": "checkpoints/verl_examples/gsm8k",
           "trainer.esi_redundant_time": "0"}
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        out[key] = value
    return out


def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60,
                         redundant_time: float = 0) -> bool:
    exp_ts_mlp = os.getenv(ESI_ENV)
    if not exp_ts_mlp:
        return False
    try:
        remaining = float(exp_ts_mlp) - time.time()
    except ValueError:
        return False
    return (remaining > 0 and max_steps_duration > 0
            and remaining <= save_ckpt_duration + max_steps_duration + redundant_time)


def checkpoint_paths(root: str, step: int, world: int) -> list[str]:
    """The files of one checkpoint, as verl's FSDP checkpoint manager names them."""
    folder = os.path.join(root, f"global_step_{step}")
    actor = os.path.join(folder, "actor")
    files = []
    for rank in range(world):
        files += [os.path.join(actor, f"{kind}_world_size_{world}_rank_{rank}.pt")
                  for kind in ("model", "optim", "extra_state")]
    return [*files, os.path.join(folder, "data.pt")]


def save(root: str, step: int, world: int) -> None:
    for path in checkpoint_paths(root, step, world):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(f"step {step}\n")
    with open(os.path.join(root, TRACKER), "w") as fh:
        fh.write(str(step))
    print(f"local_global_step_folder: {os.path.join(root, f'global_step_{step}')}", flush=True)


def resume_step(root: str, mode: str) -> int:
    if mode == "disable":
        return 0
    try:
        with open(os.path.join(root, TRACKER)) as fh:
            step = int(fh.read())
    except (OSError, ValueError):
        print("Training from scratch", flush=True)
        return 0
    folder = os.path.join(root, f"global_step_{step}")
    if not os.path.isdir(folder):
        return 0
    print(f"Resuming from {folder}", flush=True)
    return step


def fit(cfg: dict[str, str]) -> int:
    """The TaskRunner's loop (in the Ray actor)."""
    root = cfg["trainer.default_local_dir"]
    total, save_freq = int(cfg["trainer.total_training_steps"]), int(cfg["trainer.save_freq"])
    world = int(cfg["trainer.nnodes"]) * int(cfg["trainer.n_gpus_per_node"])
    step_s = float(os.environ.get("STANDIN_STEP_S", "1"))
    path = os.environ.get("VERL_FILE_LOGGER_PATH")
    logger = open(path, "wb", buffering=0) if path else None  # noqa: SIM115 (verl's FileLogger)
    step = resume_step(root, cfg["trainer.resume_mode"]) + 1
    max_steps_duration = 0.0
    while step <= total:
        began = time.time()
        time.sleep(step_s)
        esi = should_save_ckpt_esi(max_steps_duration,
                                   redundant_time=float(cfg["trainer.esi_redundant_time"]))
        if save_freq > 0 and (step == total or step % save_freq == 0 or esi):
            if esi:
                print("Force saving checkpoint: ESI instance expiration approaching.", flush=True)
            save(root, step, world)
        data = {"critic/score/mean": step / total, "timing_s/step": time.time() - began,
                "training/global_step": step}
        max_steps_duration = max(max_steps_duration, time.time() - began)
        print(f"step:{step} - " + " - ".join(f"{k}:{v:.3f}" for k, v in data.items()),
              flush=True)  # the loggers in their configured order: console before file
        if logger is not None:
            logger.write(json.dumps({"step": step, "data": data}).encode() + b"\n")
        step += 1
    return step - 1


class TaskRunner:
    """verl's TaskRunner actor (`main_ppo.py`): the loop runs in it, with Ray's environment."""

    def run(self, cfg: dict[str, str]) -> int:
        return fit(cfg)


def main(argv: list[str]) -> int:
    import ray

    cfg = config(argv)
    ray.init()  # RAY_ADDRESS; installs Ray's driver SIGTERM handler (exit 15)
    runner = ray.remote(num_cpus=1)(TaskRunner).remote()
    done = ray.get(runner.run.remote(cfg))
    print(f"standin: finished at step {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
