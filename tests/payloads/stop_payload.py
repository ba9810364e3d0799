"""Payload of the agent's stop/requeue tests: speaks the trainer's protocol without training.

Handlers for SIGUSR2 and SIGTERM only set a flag; the loop then "checkpoints" (writes
`stopped.json` in the run directory) and exits 3 (please requeue). PAYLOAD_EXIT_AT_ONCE=N exits
with N at once; otherwise it exits 0 after PAYLOAD_SECONDS (default 120).
"""

import json
import os
import signal
import sys
import time

got: list[str] = []
for sig in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, lambda num, _frame: got.append(signal.Signals(num).name))
run_dir = os.environ["HPCRL_RUN_DIR"]
print(f"payload: end time {os.environ.get('HPCRL_JOB_END_TIME')}", flush=True)
if os.environ.get("PAYLOAD_EXIT_AT_ONCE"):
    sys.exit(int(os.environ["PAYLOAD_EXIT_AT_ONCE"]))
deadline = time.monotonic() + float(os.environ.get("PAYLOAD_SECONDS", "120"))
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
if got:
    record = {"signals": got, "end_time": os.environ.get("HPCRL_JOB_END_TIME")}
    with open(os.path.join(run_dir, "stopped.json"), "w") as fh:
        json.dump(record, fh)
    print(f"payload: stopped by {got[0]}, exiting 3", flush=True)
    sys.exit(3)
sys.exit(0)
