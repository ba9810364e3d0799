"""The preflight that `hpcrl submit`, `hpcrl submit --dry-run` and `hpcrl render` share: the same
checks, the same verdict, before anything is created or queued (see `hpcrl.preflight`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hpcrl import preflight as pf
from hpcrl.jobspec import payload_loop
from hpcrl.memcheck import check_memory
from hpcrl.runreport import reading_env

__all__ = ["PASSED", "preflight"]

PASSED = "hpcrl: preflight passed (the checks `hpcrl submit` runs before it queues)"


def preflight(args: argparse.Namespace, profile: Any, req: Any, *, submitting: bool) -> None:
    """Stop when the job cannot work. `submitting` (submit and its dry run) also needs this
    host's Slurm client; `hpcrl render` prints a script to submit elsewhere and does not."""
    problems = pf.check_local_nodes(profile.name, profile.scheduler, req.spec.nodes)
    if submitting:
        problems += pf.check_scheduler(profile.name, profile.scheduler)
    pf.report(problems, fatal=True)
    check_payload(args, profile, req)


def check_payload(args: argparse.Namespace, profile: Any, req: Any) -> None:
    """The trainer's checks of the payload's overrides. A key or value the trainer refuses
    stops it on every node, so it is refused on any site; a model, data file or disk space that
    this host cannot confirm is refused where the job runs on this host (the local site), and
    elsewhere named as unchecked (it may exist only on the compute nodes)."""
    if args.whole_command or args.verl or (args.resume and not args.update_spec):
        return
    run_dir = Path(req.run_dir)
    job_env = reading_env(req.spec.nodes, run_dir, req.spec.profile)
    loop = payload_loop(req.spec.payload) or "sync"
    overrides, problems = pf.parse_overrides(list(req.spec.payload[3:]), job_env, loop)
    pf.report(problems, fatal=True)
    text = check_memory(list(req.spec.payload[3:]), overrides, profile.slurm, job_env,
                        getattr(args, "force", False), req.spec.payload[2])
    if text:
        print(text, file=sys.stderr)
    inputs = pf.check_job_inputs(overrides, run_dir, hub_env={**os.environ, **profile.env})
    if profile.scheduler == "local":
        pf.report(inputs, fatal=True)
    for problem in inputs:
        print(f"hpcrl: warning: unchecked: {problem}; this host cannot see it, so the job finds out "
              "on the compute nodes (at its start) whether it is there", file=sys.stderr)
    for problem in pf.check_binds(overrides, run_dir, profile.container.runtime, profile.container.binds):
        print(f"hpcrl: warning: {problem}", file=sys.stderr)
