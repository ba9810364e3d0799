"""verl 0.9.1's side of `test_queue_vs_verl.py`, run by verl's interpreter:
`python verl_queue_side.py IN.json OUT.json`. For each scenario it replays the event stream on
verl's own code: `FullyAsyncRollouter.set_max_required_samples`, `_should_pause_generation` and
`reset_staleness` (called unbound on a stand-in holding only the attributes they read), with
verl's `MessageQueue` (the class under its Ray decorator) as the message queue; the two lines
of `_processor_worker` the methods rely on are replayed as written there: a submitted prompt is
counted (`self.staleness_samples += 1`) and joins `active_tasks`. OUT gets verl's sizes, its
answer at every admission check, the queue's size after every event and `staleness_samples`
after every sync."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from types import SimpleNamespace

from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
from verl.experimental.fully_async_policy.message_queue import MessageQueue

ROLLOUTER = FullyAsyncRollouter.__ray_actor_class__
QUEUE = MessageQueue.__ray_actor_class__


async def replay(s: dict) -> dict:
    mq = QUEUE(None, max_queue_size=10**9)  # resized below to verl's max_queue_size, as verl builds it
    r = SimpleNamespace(
        lock=asyncio.Lock(), paused=False, _resume_event=asyncio.Event(), active_tasks=set(),
        message_queue_client=mq, staleness_samples=0, staleness_threshold=s["staleness_threshold"],
        required_samples=s["ppo_mini_batch_size"] * s["require_batches"],  # FullyAsyncRollouter.__init__
        config=SimpleNamespace(async_training=SimpleNamespace(trigger_parameter_sync_step=s["trigger"])),
        total_rollout_steps=s["total_rollout_steps"], concurrent_samples_per_replica=16,
        llm_server_manager=SimpleNamespace(get_active_server_count=lambda: 1000),
        _active_count_history=[(time.time(), 0, 0)], step_start_time=time.time(), idle_start_time=0.0,
        _step_generated_samples=0, _completed_steps=1, _step_samples_history=deque(maxlen=10),
        _STEP_HISTORY_SIZE=10, _compute_rollout_resource_utilization=lambda: 0.0)
    await ROLLOUTER.set_max_required_samples(r)
    mq.max_queue_size = int(r.max_queue_size)
    mq.queue = deque(maxlen=mq.max_queue_size)
    out = {"max_required_samples": r.max_required_samples, "max_queue_size": r.max_queue_size,
           "total_train_steps": r.total_train_steps, "pauses": [], "queue_sizes": [], "after_sync": []}
    for event in s["events"]:
        kind, arg = event[0], event[1] if len(event) > 1 else None
        if kind == "check":
            out["pauses"].append(await ROLLOUTER._should_pause_generation(r))
        elif kind == "submit":
            r.staleness_samples += 1  # _processor_worker
            r.active_tasks.add(arg)
        elif kind == "finish":
            r.active_tasks.discard(arg)
            await mq.put_sample(arg)
        elif kind == "take":
            for _ in range(int(arg or 0)):
                await mq.get_sample()
        elif kind == "sync":
            await ROLLOUTER.reset_staleness(r)
            out["after_sync"].append(r.staleness_samples)
        out["queue_sizes"].append(await mq.get_queue_size())
    out["dropped"] = mq.dropped_samples
    return out


def main() -> None:
    scenarios = json.loads(open(sys.argv[1]).read())
    results = [asyncio.run(replay(s)) for s in scenarios]
    with open(sys.argv[2], "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
