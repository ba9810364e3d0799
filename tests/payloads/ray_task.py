"""Payload used by the agent tests: connect with the explicit address, run one task per node.

Environment: PAYLOAD_EXIT (exit status), PAYLOAD_SLEEP (seconds to wait before exiting),
PAYLOAD_CHECK_REFUSAL=1 (first check that a driver without the token is refused),
PAYLOAD_CHECK_JOB_TOKEN=1 (first check that a driver holding only the job's token file is
accepted: the cluster runs on the job's token, not on one inherited from the environment),
PAYLOAD_WAIT_USR1=1 (at the end, wait for SIGUSR1 or SIGUSR2, the agent's stop request, and
exit 42),
PAYLOAD_WAIT_NODES=N (report the nodes alive at the start, then wait up to 120 s for N, as
the trainer's placement group does when the head starts it with `payload_start: head-alive`),
PAYLOAD_PROBE_DASHBOARD=1 (report whether the dashboard port answers on loopback and on the
node address).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

address = os.environ["RAY_ADDRESS"]
assert address != "auto"

if os.environ.get("PAYLOAD_CHECK_REFUSAL") == "1":
    no_token = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    probe = (
        "import ray, sys\n"
        "try:\n"
        f"    ray.init(address={address!r}, log_to_driver=False)\n"
        "except Exception as exc:\n"
        "    print('refused:', type(exc).__name__); sys.exit(0)\n"
        "print('ACCEPTED without token'); sys.exit(1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=no_token, capture_output=True, text=True, timeout=120
    )
    print(f"payload: driver without token: {result.stdout.strip()}", flush=True)
    if result.returncode != 0:
        sys.exit(90)

if os.environ.get("PAYLOAD_CHECK_JOB_TOKEN") == "1":
    file_only = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    probe = (
        "import ray, sys\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "print('accepted with the job token file')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=file_only, capture_output=True, text=True, timeout=120
    )
    print(f"payload: driver with the job's token file: {result.stdout.strip() or 'refused'} "
          f"({'RAY_AUTH_TOKEN set' if 'RAY_AUTH_TOKEN' in os.environ else 'no RAY_AUTH_TOKEN'})",
          flush=True)
    if result.returncode != 0:
        sys.exit(91)

if os.environ.get("PAYLOAD_PROBE_DASHBOARD") == "1":
    run = os.path.join(os.environ["HPCRL_RUN_DIR"], os.environ["HPCRL_RESTART"])
    with open(os.path.join(run, "rendezvous.json")) as f:
        info = json.load(f)
    for host in ("127.0.0.1", info["address"]):
        try:
            socket.create_connection((host, info["ports"]["dashboard"]), timeout=3).close()
            print(f"payload: dashboard on {host} open", flush=True)
        except OSError:
            print(f"payload: dashboard on {host} closed", flush=True)

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

ray.init(address=address, log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
want = int(os.environ.get("PAYLOAD_WAIT_NODES", "0"))
if want:
    print(f"payload: started with {len(alive)} alive nodes", flush=True)
    until = time.monotonic() + 120
    while len(alive) < want and time.monotonic() < until:
        time.sleep(0.2)
        alive = [n for n in ray.nodes() if n["Alive"]]
print(f"payload: {len(alive)} alive nodes", flush=True)


@ray.remote(num_cpus=0)
def where() -> str:
    return ray.get_runtime_context().get_node_id()


refs = [
    where.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
    ).remote()
    for n in alive
]
ran_on = set(ray.get(refs))
print(f"payload: one task ran on each of {len(ran_on)} nodes", flush=True)
print(
    f"payload: MASTER_ADDR={os.environ['MASTER_ADDR']} GLOO={os.environ.get('GLOO_SOCKET_IFNAME')}"
)

if os.environ.get("PAYLOAD_LIST_LISTENERS") == "1":  # where each port of the block listens
    run = os.path.join(os.environ["HPCRL_RUN_DIR"], os.environ["HPCRL_RESTART"])
    with open(os.path.join(run, "rendezvous.json")) as f:
        ports = json.load(f)["ports"]
    names = {p: n for n, p in ports.items() if not n.endswith("worker_port")}
    # Ray opens some ports after the cluster is up (the dashboard's metrics port among them):
    # wait, bounded, until every port named in PAYLOAD_LIST_LISTENERS_AWAIT listens, then list.
    awaited = {n for n in os.environ.get("PAYLOAD_LIST_LISTENERS_AWAIT", "").split(",") if n}
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout.split()
        found = [(names[int(port)], host, port) for host, _, port in (x.rpartition(":") for x in out[3::5])
                 if port.isdigit() and int(port) in names]
        if awaited <= {n for n, _, _ in found} or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # pacing the poll
    for name, host, port in found:
        print(f"payload: listener {name} {host}:{port}", flush=True)

ray.shutdown()
if os.environ.get("PAYLOAD_WAIT_USR1") == "1":
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(42))
    signal.signal(signal.SIGUSR2, lambda *_: sys.exit(42))
    print("payload: waiting for SIGUSR1", flush=True)
    time.sleep(300)
time.sleep(float(os.environ.get("PAYLOAD_SLEEP", "0")))
sys.exit(int(os.environ.get("PAYLOAD_EXIT", "0")))
