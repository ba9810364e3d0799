"""`python -m trainer [--print-config | --list-keys] [--config-path DIR --config-name FILE] KEY=VALUE ...`:
the PPO trainer's entry.

Exit status: 0 when training finished, 2 for bad configuration or input (fix and rerun),
3 (`REQUEUE_EXIT_CODE`) when a stop was requested and a checkpoint written (requeue me),
1 (`WORKER_FAILURE_EXIT_CODE`) when a distributed worker failed (the message names its node
and rank) or the Ray cluster could not be reached.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence

from trainer import startup
from trainer.stop import StopRequest

startup.mark_process("python")
# `python -m trainer` installs the stop handlers before the imports below load torch (seconds):
# a stop request arriving during start-up is kept, not fatal (SIGUSR2's default action ends the
# process). Imported as a module (tests), `main` installs them itself.
_STARTUP_STOP = StopRequest() if __name__ == "__main__" else None
if _STARTUP_STOP is not None:
    _STARTUP_STOP.install()

from trainer.checkpoint.layout import CheckpointOwnerError, CheckpointPermissionError  # noqa: E402
from trainer.config import (  # noqa: E402
    ConfigError,
    check_run,
    compat_notes,
    describe_keys,
    dump_config,
    file_overrides,
    load_config,
)
from trainer.config.async_training import ENTRY_DEFAULTS  # noqa: E402
from trainer.data import DataError  # noqa: E402
from trainer.deadline import DeadlineError  # noqa: E402
from trainer.driver import PPODriver, run_training  # noqa: E402
from trainer.exit_codes import (  # noqa: E402
    ABORTED_EXIT_CODE,
    NO_SPACE_EXIT_CODE,
    USAGE_EXIT_CODE,
    WORKER_FAILURE_EXIT_CODE,
)
from trainer.memplan import PlanError, plan_config  # noqa: E402
from trainer.metrics import MetricsError  # noqa: E402
from trainer.rewards import RewardError  # noqa: E402
from trainer.workers.group import WorkerFailure  # noqa: E402

startup.mark_process("imports")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="PPO/GRPO trainer configured with verl-style dotted overrides "
        "(e.g. data.train_batch_size=64 trainer.logger=['console','wandb']).",
    )
    parser.add_argument(
        "--print-config", action="store_true",
        help="validate the overrides, print the resolved configuration and exit",
    )
    parser.add_argument(
        "--list-keys", action="store_true", help="list every key with its type and help and exit",
    )
    parser.add_argument(
        "--plan-memory", action="store_true",
        help="estimate the per-device peak of each phase from the model's config.json (no weights) "
        "and exit: 0 when it fits, 2 with the phase, its largest term and the fix when not",
    )
    parser.add_argument("--device-memory", type=float, default=80.0, metavar="GIB",
                        help="with --plan-memory: memory of one device in GiB (default 80)")
    parser.add_argument("--config-path", "-cp", metavar="DIR",
                        help="as verl's Hydra entry: the directory of the `--config-name` file")
    parser.add_argument("--config-name", "-cn", metavar="FILE",
                        help="as verl's Hydra entry: a YAML file of keys set over verl's `ppo_trainer` "
                        "(its `defaults: [ppo_trainer, _self_]`); the KEY=VALUE overrides apply over it")
    parser.add_argument("--host-memory", type=float, default=0.0, metavar="GIB",
                        help="with --plan-memory: the job's host memory per node in GiB (Slurm's "
                        "`--mem`); 0 (default) leaves host memory unchecked")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return parser


def plan_memory(cfg: object, device_gib: float, host_gib: float = 0.0) -> int:
    """`--plan-memory`: print the plan; refuse (status 2) a configuration that cannot fit."""
    try:
        plan = plan_config(cfg, device_gib, host_gib=host_gib)
    except PlanError as err:
        print(f"python -m trainer: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    print(plan.table())
    refusal = plan.refusal()
    if refusal is not None:
        print(f"python -m trainer: error: {refusal}", file=sys.stderr)
        return USAGE_EXIT_CODE
    return 0


def main(argv: Sequence[str] | None = None, driver_class: type[PPODriver] = PPODriver,
         stop: StopRequest | None = None) -> int:
    """The entry of `python -m trainer`; another loop's entry passes its driver
    (`python -m trainer.one_step_off`) and the stop request it installed before its imports."""
    stop = stop or _STARTUP_STOP or StopRequest()
    stop.install()  # first: a stop request during start-up is kept, not fatal
    try:
        return _main(argv, stop, driver_class)
    finally:
        stop.settle()  # the status is decided; a late stop signal must not turn it into a kill


def _main(argv: Sequence[str] | None, stop: StopRequest, driver_class: type[PPODriver] = PPODriver) -> int:
    args = build_parser().parse_args(argv)
    if args.list_keys:
        for key, type_name, help_text in describe_keys():
            print(f"{key}  ({type_name})\n    {help_text}")
        return 0
    try:
        # without `--config-name`, the entry's own file beneath the overrides, as verl composes it
        entry = ENTRY_DEFAULTS[driver_class.loop] if args.config_name is None else ()
        overrides = [*entry, *file_overrides(args.config_path, args.config_name, args.overrides), *args.overrides]
        cfg = load_config(overrides)
        if args.plan_memory:  # what the start would refuse is not planned (a critic sized by nothing)
            check_run(cfg, driver_class.loop)
    except ConfigError as err:
        print(f"python -m trainer: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    for line in compat_notes(overrides, cfg):
        print(f"python -m trainer: note: {line}", file=sys.stderr)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    if args.plan_memory:
        return plan_memory(cfg, args.device_memory, args.host_memory)
    try:
        return run_training(cfg, stop, driver_class)
    except (ConfigError, DataError, RewardError, MetricsError, DeadlineError,
            FileNotFoundError, CheckpointOwnerError, CheckpointPermissionError) as err:
        print(f"python -m trainer: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except (WorkerFailure, ConnectionError) as err:  # before OSError: ConnectionError is one
        print(f"python -m trainer: error: {err}", file=sys.stderr)
        return WORKER_FAILURE_EXIT_CODE
    except KeyboardInterrupt:
        print("python -m trainer: aborted (second interrupt); the current step was not "
              "checkpointed, a resumed run starts from the last checkpoint", file=sys.stderr)
        return ABORTED_EXIT_CODE
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        print(f"python -m trainer: error: no space left on the device while writing "
              f"`{err.filename or cfg.trainer.default_local_dir}`. Fix: free space there, point "
              "`trainer.default_local_dir` at a larger filesystem, or keep fewer checkpoints "
              "with `trainer.max_actor_ckpt_to_keep=1`", file=sys.stderr)
        return NO_SPACE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
