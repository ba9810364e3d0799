"""The memory plan before the queue wait: `hpcrl submit` (dry run included) runs the trainer's
`python -m trainer --plan-memory` on the job's overrides in a subprocess (torch stays out of
hpcrl's process) against the profile's `slurm.gpu_memory_gib` and, when it sets one,
`slurm.mem` (each node's host memory: offloaded and pinned state, per-process baselines), and
refuses a configuration that cannot fit unless `--force` or `slurm.memory_plan: false` lets it
through. Only the plan's own verdict refuses: a plan that cannot run (a light install without
torch, say) is noted as not run, with the fix, and the job goes on."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.preflight import PreflightError

MODEL_KEY = "actor_rollout_ref.model.path"
_MEM_UNITS = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}


def slurm_mem_gib(mem: str | None) -> float:
    """Slurm's `--mem` (`200G`, `512000` in MiB, `1T`) in GiB; 0 for none or `0` (all of it)."""
    text = str(mem or "0").strip().upper()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", text)
    if match is None:
        raise PreflightError(f"`slurm.mem` is {mem!r}, not a Slurm memory size. Fix: a number with an "
                             "optional unit K, M, G or T (`200G`; no unit is MiB), or `0` for all of it")
    return float(match.group(1)) * _MEM_UNITS[match.group(2) or "M"]


def plan_command(overrides: Sequence[str], device_gib: float, host_gib: float = 0.0, module: str = "trainer"
                 ) -> list[str]:
    """The plan of the job's trainer (`module`: its loop's entry, whose start checks it makes)."""
    return [sys.executable, "-m", module, "--plan-memory", "--device-memory", str(device_gib),
            "--host-memory", str(host_gib), *overrides]


def check_memory(overrides: Sequence[str], values: Mapping[str, Any], slurm: Any, job_env: Mapping[str, str],
                 force: bool, module: str = "trainer") -> str | None:
    """Run the plan for a GPU job; raise `PreflightError` with the plan's refusal, or return
    the text to print (the plan's table, or why there is none, or the refusal let through)."""
    if int(slurm.gpus_per_node or 0) <= 0:
        return None  # a CPU job: no device memory to plan
    model = values.get(MODEL_KEY)
    if not isinstance(model, str) or not (Path(model).expanduser() / "config.json").is_file():
        return (f"hpcrl: note: no memory plan: `{MODEL_KEY}={model}` has no `config.json` on this host "
                "(the plan reads only that file; copy it here to have the job checked before it queues)")
    if not torch_installed():
        return not_run(f"torch is not installed in this Python (`{sys.executable}`: a light install, "
                       "as on a login node)", slurm)
    env = {**os.environ, **job_env}
    host_gib = slurm_mem_gib(slurm.mem)
    done = subprocess.run(plan_command(overrides, slurm.gpu_memory_gib, host_gib, module), env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return done.stdout.rstrip("\n")
    error = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    if done.returncode != 2 or not error[0].startswith("python -m trainer: error: "):
        # not the plan's verdict (status 2, the trainer's error line): the plan did not run
        return not_run(f"`python -m trainer --plan-memory` ended with exit status {done.returncode}: {error[0]}",
                       slurm)
    reason = error[0].removeprefix("python -m trainer: error: ")
    if force or not slurm.memory_plan:
        why = "`--force`" if force else "`slurm.memory_plan: false`"
        return f"{done.stdout.rstrip()}\nhpcrl: warning: submitted despite the memory plan ({why}): {reason}"
    host = f", {slurm.mem} per node, `slurm.mem`" if host_gib else ""
    raise PreflightError(f"the memory plan refuses this job before it queues "
                         f"({slurm.gpu_memory_gib:g} GiB per GPU, `slurm.gpu_memory_gib`{host}): {reason}. "
                         "To submit anyway: `hpcrl submit --force`")


def torch_installed() -> bool:
    """Whether this Python can import torch (the plan's one heavy need), without importing it."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def not_run(why: str, slurm: Any) -> str:
    """The note for a plan that did not run: why, and the two ways to settle it."""
    if not slurm.memory_plan:
        return f"hpcrl: note: no memory plan (`slurm.memory_plan: false`; it could not run anyway: {why})"
    return (f"hpcrl: note: the memory plan was not run, so GPU memory is unchecked: {why}. To have the "
            "job checked before it queues: `pip install 'hpcrl[train]'` (torch) on this host; to skip the "
            "plan and this note: `slurm.memory_plan: false` in the profile")
