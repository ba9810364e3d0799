"""Lab payload: what Ray offers this job. Connects with the explicit address and writes
`$HPCRL_RUN_DIR/resources.json`: `ray.cluster_resources()`, each alive node's own resources by
host, the visible-device variables the driver got, and the wall-clock span of the probe (it holds
the cluster for PROBE_SLEEP seconds, so that two jobs overlap)."""

import json
import os
import time

import ray

DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")

started = time.time()
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
nodes = {n["NodeManagerHostname"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
result = {
    "cluster": ray.cluster_resources(),
    "nodes": {host: {k: v for k, v in res.items() if not k.startswith("node:")}
              for host, res in nodes.items()},
    "driver_env": {n: os.environ.get(n) for n in DEVICE_VARS},
}
time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
result["span"] = [started, time.time()]
ray.shutdown()
out = os.path.join(os.environ["HPCRL_RUN_DIR"], "resources.json")
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)
print(f"resources: {result['cluster']}", flush=True)
