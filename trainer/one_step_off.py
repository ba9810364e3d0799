"""`python -m trainer.one_step_off [--config-path DIR --config-name FILE] KEY=VALUE ...`: verl's
one-step-off recipe (`python -m verl.experimental.one_step_off_policy.main_ppo`), with exactly
the arguments of `python -m trainer`: generation on a rollout pool of its own
(`actor_rollout_ref.hybrid_engine=false rollout.nnodes=N rollout.n_gpus_per_node=G`), one step
ahead of training (:mod:`trainer.async_rl.one_step_off`). Exit statuses as `python -m trainer`'s."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer import startup
from trainer.stop import StopRequest

startup.mark_process("python")
# as `python -m trainer`: the stop handlers before the imports below load torch
_STARTUP_STOP = StopRequest() if __name__ == "__main__" else None
if _STARTUP_STOP is not None:
    _STARTUP_STOP.install()

from trainer.__main__ import main as trainer_main  # noqa: E402
from trainer.async_rl.one_step_off import OneStepOffDriver  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    return trainer_main(argv, OneStepOffDriver, _STARTUP_STOP)


if __name__ == "__main__":
    sys.exit(main())
