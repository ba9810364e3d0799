"""Lab payload: connect to the job's Ray cluster with the explicit address, run one task pinned
to every alive node, and record what each task sees (hostname, container, environment) in
`$HPCRL_RUN_DIR/probe.json`. PROBE_ENV names the variables to report (comma-separated)."""

import json
import os
import socket
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

address = os.environ["RAY_ADDRESS"]
names = [n for n in os.environ.get("PROBE_ENV", "").split(",") if n]


@ray.remote(num_cpus=0)
def inspect(names: list) -> dict:
    container = "podman" if os.path.exists("/run/.containerenv") else (
        "apptainer" if os.environ.get("APPTAINER_CONTAINER") else "none")
    return {"hostname": socket.gethostname(), "container": container,
            "env": {n: os.environ.get(n) for n in names}}


t0 = time.monotonic()
ray.init(address=address, log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
tasks = [inspect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(names)
         for n in alive]
result = {
    "address": address,
    "alive": len(alive),
    "tasks": ray.get(tasks),
    "driver": {"hostname": socket.gethostname(), "env": {n: os.environ.get(n) for n in names},
               "MASTER_ADDR": os.environ.get("MASTER_ADDR"), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME")},
    "seconds": round(time.monotonic() - t0, 2),
}
ray.shutdown()
out = os.path.join(os.environ["HPCRL_RUN_DIR"], "probe.json")
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)
print(f"probe: {len(alive)} alive nodes, tasks on {sorted(t['hostname'] for t in result['tasks'])}", flush=True)
sleep = float(os.environ.get("PROBE_SLEEP", "0"))
if sleep:
    time.sleep(sleep)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
