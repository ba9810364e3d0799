"""`python -m trainer.fully_async [--config-path DIR --config-name FILE] KEY=VALUE ...`: verl's
fully-async recipe (`python -m verl.experimental.fully_async_policy.fully_async_main`), with
exactly the arguments of `python -m trainer`: a rollouter streaming samples from a rollout pool
of its own (`actor_rollout_ref.hybrid_engine=false rollout.nnodes=N rollout.n_gpus_per_node=G`)
into a bounded queue the trainer drains (:mod:`trainer.async_rl.fully_async`). Exit statuses as `python -m trainer`'s."""

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
from trainer.async_rl.fully_async import FullyAsyncDriver  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    return trainer_main(argv, FullyAsyncDriver, _STARTUP_STOP)


if __name__ == "__main__":
    sys.exit(main())
