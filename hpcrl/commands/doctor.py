"""`hpcrl doctor --site X --nodes N`: a short job through `hpcrl submit`'s own path whose
payload (:mod:`hpcrl.doctor_check`) checks the day-one faults on the cluster; prints a
PASS/FAIL/SKIP table, each FAIL with its fix, and records a pass per site."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl import preflight as pf
from hpcrl.commands import submit
from hpcrl.commands._common import user_errors
from hpcrl.doctor_record import RESULT, record_pass, row
from hpcrl.memcheck import check_memory
from hpcrl.profile_load import load_profile
from hpcrl.profiles import ProfileError, SiteProfile, profile_to_dict
from hpcrl.runreport import reading_env

HELP = "check a site on the cluster with a short job: container, GPUs, all-reduce, Ray, vLLM"


def table(rows: Sequence[Mapping[str, str]]) -> str:
    """The result as text: status, check, detail; the fix under each FAIL."""
    width = max((len(r["check"]) for r in rows), default=0)
    out = []
    for r in rows:
        out.append(f"{r['status']:<4}  {r['check']:<{width}}  {r['detail']}")
        if r["status"] == "FAIL" and r.get("fix"):
            out.append(f"{'':<4}  {'':<{width}}  fix: {r['fix']}")
    return "\n".join(out)


def vendor_of(p: SiteProfile) -> str:
    """The GPU vendor the profile is set up for (`amd`, `nvidia`), `any` when it does not say."""
    if p.container.gpu in ("rocm", "rocm-host") or "/dev/kfd" in p.container.devices or "HIP_FORCE_DEV_KERNARG" in p.env:
        return "amd"
    if p.container.gpu == "nv" or any(d.startswith("nvidia.com/gpu") for d in p.container.devices):
        return "nvidia"
    return "any"


def memory_plan_row(p: SiteProfile, overrides: Sequence[str], reports: Sequence[Mapping[str, Any]],
                    nodes: int, run_dir: Path) -> dict[str, str]:
    """The memory plan of `overrides`, as `hpcrl submit` runs it, against what the job found:
    the smallest GPU (the profile's `slurm.gpu_memory_gib` when it found none) and the smallest
    node's host memory (Ray's, from Slurm and the cgroup; the profile's `slurm.mem` when no node
    reported one), so the plan's host-memory phase (offloaded and pinned state, per-process
    baselines) is checked against the nodes the job really gets."""
    name = "memory plan of the given command line"
    if not overrides:
        return row(name, None, "no command line: pass the trainer's overrides after `--`")
    found = [d["memory_gib"] for r in reports for d in r["devices"]]
    gib = min(found) if found else p.slurm.gpu_memory_gib
    host = min((int(r["memory_bytes"]) for r in reports if r.get("memory_bytes")), default=0)
    mem = f"{host // 2**20}M" if host else p.slurm.mem
    env = reading_env(nodes, run_dir, profile_to_dict(p))
    values, problems = pf.parse_overrides(list(overrides), env)
    if problems:
        return row(name, False, "; ".join(str(x) for x in problems), "fix the command line")
    slurm = dataclasses.replace(p.slurm, gpu_memory_gib=gib, mem=mem, memory_plan=True)
    try:
        text = check_memory(list(overrides), values, slurm, env, force=False)
    except pf.PreflightError as exc:
        return row(name, False, str(exc), "a smaller micro-batch, offload, or more GPUs (tensor parallel); "
                   "for the host memory, a larger `slurm.mem` or less offload")
    if text is None or text.startswith("hpcrl: note:"):
        return row(name, None, text.removeprefix("hpcrl: note: ") if text else "no GPU: nothing to plan")
    where = f" and {host / 2**30:.1f} GiB of host memory per node (found)" if host else \
        f" and `slurm.mem` {mem} per node" if mem and str(mem) != "0" else ""
    return row(name, True, f"fits {gib:g} GiB per GPU{where}: " + text.splitlines()[0])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", required=True, help="site profile to check")
    parser.add_argument("--nodes", type=int, default=2, help="nodes to check across (default 2)")
    parser.add_argument("--run-dir", help="run directory (default: RUN_ROOT/doctor-TIME)")
    parser.add_argument("--via", choices=["submitit", "sbatch"], default="sbatch")
    parser.add_argument("--model", help="model directory vLLM loads to generate a few tokens "
                        "(on the cluster's filesystem); without it that check is skipped")
    parser.add_argument("overrides", nargs="*", help="after `--`: a trainer command line whose "
                        "memory plan is checked against the GPU memory found")


def submit_args(args: argparse.Namespace, run_dir: Path) -> argparse.Namespace:
    p = load_profile(args.site).profile
    python = p.container.python or p.python or sys.executable
    check = [python, "-m", "hpcrl.doctor_check", "--runtime", p.container.runtime,
             "--nodes", str(args.nodes), "--gpus", str(p.slurm.gpus_per_node),
             "--vendor", vendor_of(p), "--gpu-gib", str(p.slurm.gpu_memory_gib),
             "--floor-gbps", str(p.doctor.allreduce_floor_gbps)]
    if args.model:
        check += ["--model", args.model]
    parser = argparse.ArgumentParser()
    submit.configure(parser)
    parser.set_defaults(doctor=True)  # the doctor's own job: no "run the doctor" note
    return parser.parse_args(["--site", args.site, "--nodes", str(args.nodes), "--via", args.via,
                              "--run-dir", str(run_dir), "--follow", "--command", "--", *check])


@user_errors
def run(args: argparse.Namespace) -> int:
    p = load_profile(args.site).profile
    run_dir = Path(args.run_dir or Path(p.run_root).expanduser() / f"doctor-{time.strftime('%Y%m%d-%H%M%S')}")
    status = submit.run(submit_args(args, run_dir))
    result = run_dir / RESULT
    if not result.is_file() and not (run_dir / "job.json").is_file():
        return status or 1  # not submitted: submit said why
    if not result.is_file():
        raise ProfileError(f"the doctor's job wrote no {result}: the node agent, the container or Ray did "
                           f"not start, or the nodes do not see `{run_dir}` (the profile's `run_root` must "
                           "be on a filesystem the login and compute nodes share; the agent runs with the "
                           f"profile's `python:`, else {sys.executable}, which must exist on every node); "
                           f"read the logs with `hpcrl logs {run_dir}`")
    found = json.loads(result.read_text())
    rows = [*found["rows"], memory_plan_row(p, args.overrides, found["reports"], args.nodes, run_dir)]
    print(table(rows))
    failed = [r for r in rows if r["status"] == "FAIL"]
    if failed:
        print(f"\n{len(failed)} check(s) failed on `{args.site}`; fix them and run the doctor again")
        return 1
    state = record_pass(args.site, run_dir, rows)
    print(f"\n`{args.site}` passed ({len(rows)} checks); recorded in {state}")
    return 0
