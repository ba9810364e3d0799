"""Run Ray's CLI, immune to SIGTERM, once a file appears: `python3 ray_launch.py GO_FILE
TIMEOUT_S -- ARGS...` (GO_FILE `-`: at once).

SIGTERM is blocked first thing, and every process Ray starts inherits the blocked mask (the GCS,
the raylet, the dashboard and every worker process: Ray's own spawning keeps it, as it keeps the
SIGINT it blocks itself). Slurm signals every process of the job step when the job is cancelled,
requeued or preempted (`scancel`, `scontrol requeue`, `GraceTime`): without this, the raylet
drains and every worker process exits (Ray's worker ends on SIGTERM by design) while the trainer
still saves. The agent stops Ray with SIGINT (`ray start --block` then stops its processes) and
SIGKILL, which no mask holds back.

A worker node's `ray start` asks the GCS for the head node and, while the head's Ray is still
starting, asks again only every 2 s. This launcher imports Ray's CLI at once (the slow part, done
while the head starts) and runs `ray ARGS` when GO_FILE appears (polled every 50 ms), which the
head's agent writes as soon as the GCS lists the head node alive: the worker's first question is
answered.

Run next to Ray (inside the job's container), as a file: it imports nothing from hpcrl.
Exits 3 when GO_FILE does not appear within TIMEOUT_S.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

POLL_S = 0.05
AT_ONCE = "-"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL when the parent (the agent, or the container runtime's process) dies: the parent
    death's SIGTERM is blocked here. Ray kills its own processes when this one dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        print("usage: ray_launch.py GO_FILE|- TIMEOUT_S -- RAY_ARGS...", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _die_with_parent()
    go_file, timeout_s, ray_args = argv[0], float(argv[1]), argv[3:]
    from ray.scripts.scripts import main as ray_main

    deadline = time.monotonic() + timeout_s
    while go_file != AT_ONCE and not os.path.exists(go_file):
        if time.monotonic() > deadline:
            print(
                f"ray_launch: `{go_file}` did not appear within {timeout_s:.0f} s: the head "
                "node's Ray did not come up; see the head's agent log",
                file=sys.stderr,
            )
            return 3
        time.sleep(POLL_S)
    sys.argv = ["ray", *ray_args]
    return int(ray_main() or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
