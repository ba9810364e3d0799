"""Payload used by the agent tests: connect with the explicit address, run one task per node."""

import os
import sys

import ray

address = os.environ["RAY_ADDRESS"]
assert address != "auto"
ray.init(address=address, log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
print(f"payload: {len(alive)} alive nodes", flush=True)


@ray.remote(num_cpus=0)
def where() -> str:
    return ray.util.get_node_ip_address()


ips = ray.get([where.remote() for _ in alive])
print(f"payload: tasks ran on {sorted(set(ips))}", flush=True)
print(f"payload: MASTER_ADDR={os.environ['MASTER_ADDR']} GLOO={os.environ.get('GLOO_SOCKET_IFNAME')}")
ray.shutdown()
sys.exit(int(os.environ.get("PAYLOAD_EXIT", "0")))
