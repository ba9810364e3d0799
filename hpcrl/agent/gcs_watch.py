"""Stream the Ray GCS's node table as JSON lines, one line whenever it changes.

Run next to Ray (inside the job's container), as a file: `python3 gcs_watch.py ADDRESS`.
SIGTERM is blocked: the agent ends it (and its death kills it) with SIGKILL.
It imports nothing from hpcrl, so the container needs only Ray. It asks the GCS directly
(`GcsClient.get_all_node_info`, well under a millisecond a call) without registering a driver,
and reads the auth token from `RAY_AUTH_MODE`/`RAY_AUTH_TOKEN_PATH` like every Ray process.

Output lines: `{"alive": ["ip:port", ...], "dead": [...]}` with nodes keyed by node-manager
address and port, or `{"error": "..."}` while the GCS cannot be asked.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

ALIVE = 0  # GcsNodeInfo.GcsNodeState.ALIVE


def snapshot(client: Any) -> dict[str, list[str]]:
    alive: list[str] = []
    dead: list[str] = []
    for info in client.get_all_node_info(timeout=5).values():
        key = f"{info.node_manager_address}:{info.node_manager_port}"
        (alive if info.state == ALIVE else dead).append(key)
    return {"alive": sorted(alive), "dead": sorted(dead)}


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: gcs_watch.py GCS_ADDRESS [INTERVAL_S]", file=sys.stderr)
        return 2
    # like Ray's processes (ray_launch.py), the watcher outlives Slurm's SIGTERM to every process
    # of the step: the head goes on watching the cluster while the trainer saves
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    address = argv[0]
    interval = float(argv[1]) if len(argv) > 1 else 0.1
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    client: Any = None
    last: Any = None
    line: Any
    while True:
        try:
            if client is None:
                client = GcsClient(address=address)
            line = snapshot(client)
        except Exception as exc:  # the GCS may be starting or gone; report and retry
            client = None
            line = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if line != last:
            print(json.dumps(line), flush=True)
            last = line
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
