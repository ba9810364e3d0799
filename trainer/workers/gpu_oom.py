"""A rank out of GPU memory, named: the phase it ran, what torch said, the memory plan's figure
for that phase on that device, and what to change.

torch raises `torch.OutOfMemoryError` ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0
has a total capacity of 79.11 GiB of which 1.02 GiB is free. ..."; ROCm's says "HIP out of
memory") in the rank; the driver gets it as the call's error. :func:`oom_line` finds it,
:func:`capacity_gib` the device's size in it, and :func:`describe` turns it, the driver's phase
(`trainer.watchdog.where`) and the plan (`trainer.memplan.plan_config` for that size, made only
now, in the failure's path) into one sentence. A requeue does not help: the same plan on the same
GPUs runs out again. Standard library only (the plan is passed in)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FIX", "PLAN_PHASES", "capacity_gib", "describe", "oom_line", "plan_phase"]

_OOM = re.compile(r"(?:CUDA|HIP) out of memory\..*")
_CAPACITY = re.compile(r"total capacity of ([\d.]+) GiB")

#: The driver's phases (the step timer's) and the memory plan's phase that covers each.
PLAN_PHASES = {"update_actor": "actor update", "update_critic": "critic update",
               "update_weights": "weight sync", "gen": "rollout"}

FIX = ("fewer tokens per micro-batch (`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` or, with dynamic "
       "batching, `ppo_max_token_len_per_gpu`; the same keys of `critic`), gradient checkpointing "
       "(`actor_rollout_ref.model.enable_gradient_checkpointing=true`), a smaller rollout share "
       "(`actor_rollout_ref.rollout.gpu_memory_utilization`), offload (`fsdp_config.param_offload`, "
       "`optimizer_offload`), or more GPUs; `python -m trainer --plan-memory --device-memory GIB <overrides>` "
       "checks a change before the queue")


def oom_line(text: str) -> str | None:
    """torch's out-of-memory sentence in an error's text, None when it is not one."""
    found = _OOM.search(text)
    return found.group(0).strip() if found else None


def capacity_gib(line: str) -> float | None:
    """The device's total memory torch names in its out-of-memory sentence."""
    found = _CAPACITY.search(line)
    return float(found.group(1)) if found else None


def plan_phase(plan: Any, phase: str | None) -> Any | None:
    """The plan's phase (a `trainer.memplan.Phase`) that covers the driver's `phase`, or None."""
    name = PLAN_PHASES.get(phase or "")
    return next((p for p in getattr(plan, "phases", ()) if p.name == name), None)


def describe(line: str, phase: str | None, planned: Any | str | None) -> str:
    """One sentence: out of GPU memory in `phase`, torch's words, the plan's figure (`planned`: the
    plan's `Phase`, or why there is none), that a requeue would not help, and the fix."""
    gib = 2 ** 30
    where = f" in phase `{phase}`" if phase else ""
    if planned is None or isinstance(planned, str):
        figure = f"no memory plan figure for it ({planned or 'the plan has no phase for it'})"
    else:
        name, size = planned.largest
        figure = (f"the memory plan's {planned.name} phase: {planned.peak / gib:.1f} GiB per device of "
                  f"{planned.limit / gib:.1f} GiB, its largest term {name} ({size / gib:.1f} GiB)"
                  + (" (the plan says it fits: it under-estimates this run, or another process holds "
                     "memory on the GPU)" if planned.fits else ""))
    return (f"ran out of GPU memory{where}: {line.rstrip('.')}; {figure}. A requeue would not help (the same plan on "
            f"the same GPUs runs out again): the job is not requeued. Fix: {FIX}")
