"""`python -m trainer [--print-config | --list-keys] KEY=VALUE ...`: the PPO trainer's entry.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.stop import StopRequest
from trainer.exit_codes import (
    ABORTED_EXIT_CODE,
    NO_SPACE_EXIT_CODE,
    USAGE_EXIT_CODE,
    WORKER_FAILURE_EXIT_CODE,
)


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
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from trainer.stop import StopRequest

    stop = StopRequest()
    stop.install()  # first: a stop request during start-up is kept, not fatal
    try:
        return _main(argv, stop)
    finally:
        stop.settle()  # the status is decided; a late stop signal must not turn it into a kill


def _main(argv: Sequence[str] | None, stop: StopRequest) -> int:
    from trainer.config import ConfigError, describe_keys, dump_config, load_config

    args = build_parser().parse_args(argv)
    if args.list_keys:
        for key, type_name, help_text in describe_keys():
            print(f"{key}  ({type_name})\n    {help_text}")
        return 0
    try:
        cfg = load_config(args.overrides)
    except ConfigError as err:
        print(f"python -m trainer: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from trainer.data import DataError
    from trainer.deadline import DeadlineError
    from trainer.driver import run_training
    from trainer.metrics import MetricsError
    from trainer.rewards import RewardError
    from trainer.workers.group import WorkerFailure

    try:
        return run_training(cfg, stop)
    except (ConfigError, DataError, RewardError, MetricsError, DeadlineError,
            FileNotFoundError) as err:
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
