"""Run Ray's CLI once a file appears: `python3 ray_launch.py GO_FILE TIMEOUT_S -- ARGS...`
(GO_FILE `-`: at once, the head node).

First it refuses a Ray older than `MIN_RAY` (exit 4, naming the version found): before 2.52
Ray ignores `RAY_AUTH_MODE=token`, and the job's cluster would take orders from any user who can
reach its ports.

A worker node's `ray start` asks the GCS for the head node and, while the head's Ray is still
starting, asks again only every 2 s. This launcher imports Ray's CLI at once (the slow part, done
while the head starts) and runs `ray ARGS` when GO_FILE appears (polled every 50 ms), which the
head's agent writes as soon as the GCS lists the head node alive: the worker's first question is
answered.

Run next to Ray (inside the job's container), as a file: it imports nothing from hpcrl.
Exits 3 when GO_FILE does not appear within TIMEOUT_S.
"""

from __future__ import annotations

import os
import sys
import time

POLL_S = 0.05
MIN_RAY = (2, 52)
"""The oldest Ray with token authentication (`RAY_AUTH_MODE=token`); pyproject requires it too."""
TOO_OLD_EXIT = 4


def version_tuple(text: str) -> tuple[int, ...]:
    """`2.60.0` -> (2, 60, 0); `3.0.0.dev0` -> (3, 0, 0): the leading numbers."""
    out = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def too_old(version: str) -> str | None:
    """Why Ray `version` is refused, or None."""
    if version_tuple(version) >= MIN_RAY:
        return None
    need = ".".join(map(str, MIN_RAY))
    return (f"ray_launch: the container has Ray {version}; hpcrl needs Ray >= {need}, whose token "
            "authentication (`RAY_AUTH_MODE=token`) keeps other users of the network out of the "
            f"job's cluster (older Ray ignores it). Fix: install `ray[default]>={need}` in the "
            "image (`containers/`, `hpcrl image build`)")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        print("usage: ray_launch.py GO_FILE TIMEOUT_S -- RAY_ARGS...", file=sys.stderr)
        return 2
    go_file, timeout_s, ray_args = argv[0], float(argv[1]), argv[3:]
    import ray

    refused = too_old(ray.__version__)
    if refused:
        print(refused, file=sys.stderr)
        return TOO_OLD_EXIT
    from ray.scripts.scripts import main as ray_main

    deadline = time.monotonic() + timeout_s
    while go_file != "-" and not os.path.exists(go_file):
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
