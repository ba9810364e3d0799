"""The project's Slurm test lab: a real multi-node cluster on this machine.

By hand: `python -m tests.lab up [--nodes N] [--ipv6-only] [--grace-time S]`, `status`, `down`.
From tests: the `lab` fixture of `tests/conftest.py` gives a `Lab`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

from hpcrl.slurm import parse_scontrol_show_job as parse_scontrol_record
from tests.lab import cluster
from tests.lab.cluster import LabError
from tests.lab.config import APPTAINER_PREFIX, IMAGE, SIF, LabConfig, Paths

__all__ = ["Lab", "LabConfig", "LabError", "IMAGE", "SIF", "APPTAINER_BIN", "parse_scontrol_record"]

APPTAINER_BIN = APPTAINER_PREFIX / "bin" / "apptainer"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class Lab:
    """A running lab: its configuration and the Slurm client calls tests need."""

    def __init__(self, cfg: LabConfig, paths: Paths | None = None) -> None:
        self.cfg = cfg
        self.paths = paths or Paths()

    @classmethod
    def up(cls, cfg: LabConfig | None = None) -> Lab:
        cfg = cfg or LabConfig()
        return cls(cfg, cluster.up(cfg))

    def down(self) -> None:
        cluster.down(self.paths)

    def is_up(self) -> bool:
        return cluster.running_config(self.paths) == self.cfg and cluster.nodes_idle_or_busy(self.cfg, self.paths)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.paths.env()}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sbatch, squeue, scontrol, ...) against the lab."""
        res = subprocess.run(argv, env=self.env, text=True, capture_output=True, timeout=timeout)
        if check and res.returncode != 0:
            raise LabError(f"`{shlex.join(argv)}` exited {res.returncode}: {res.stderr.strip()}\n\n{self.logs()}")
        return res

    def sbatch(self, script: str | Path, *args: str) -> int:
        """Submit a batch script (text or path); return the job id."""
        if isinstance(script, str):
            res = subprocess.run(["sbatch", "--parsable", *args], input=script, env=self.env,
                                 text=True, capture_output=True, timeout=30)  # fmt: skip
        else:
            res = self.run("sbatch", "--parsable", *args, str(script), check=False)
        if res.returncode != 0:
            raise LabError(f"sbatch failed: {res.stderr.strip()}")
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        res = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return parse_scontrol_record(res.stdout) if res.returncode == 0 and res.stdout.strip() else {}

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_state(self, job_id: int, states: set[str] | str, timeout: float = 60) -> dict[str, str]:
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in wanted:
                return record
            time.sleep(0.2)
        raise LabError(
            f"job {job_id} did not reach {sorted(wanted)} within {timeout:.0f} s; last: "
            f"{record.get('JobState')} {record.get('Reason', '')}\n\n{self.logs()}"
        )

    def wait_done(self, job_id: int, timeout: float = 120) -> dict[str, str]:
        return self.wait_state(job_id, FINISHED, timeout)

    def nsexec(self, node: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run `argv` in `node`'s network namespace (as a job step would, minus Slurm)."""
        return subprocess.run(["nsenter", f"--net=/run/netns/{cluster.NETNS_PREFIX}{node}", *argv],
                              text=True, capture_output=True, **kw)  # fmt: skip

    def wait_out_of_queue(self, job_id: int | None = None, timeout: float = 60) -> None:
        """Wait until Slurm lists the job (or any job) no more: past COMPLETING, when its
        processes are gone (a cancelled job is CANCELLED at once, while its steps still end)."""
        argv = ["squeue", "-h", "-o", "%i", *(["-j", str(job_id)] if job_id is not None else [])]
        deadline = time.monotonic() + timeout
        while self.run(*argv, check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise LabError(f"{f'job {job_id}' if job_id else 'jobs'} still in the queue after "
                               f"{timeout:.0f} s\n\n{self.logs()}")
            time.sleep(0.2)

    def sweep(self, timeout: float = 60) -> list[str]:
        """Leave the lab as a fresh one: cancel every job still queued or running, wait until
        Slurm has none, then kill what finished jobs left running (`cluster.strays`). Returns
        what it had to clean, empty when the test left nothing."""
        cleaned = []
        jobs = self.run("squeue", "-h", "-o", "%i %j %T").stdout.split("\n")
        jobs = [j for j in jobs if j.strip()]
        if jobs:
            cleaned += [f"job {j}" for j in jobs]
            self.run("scancel", *[j.split()[0] for j in jobs], check=False)
            self.wait_out_of_queue(timeout=timeout)
        cleaned += [f"process {pid}: {cmd}" for pid, cmd in cluster.kill_strays(self.paths).items()]
        return cleaned

    def logs(self) -> str:
        return cluster.collect_logs(self.paths)
