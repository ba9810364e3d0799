"""The run directory: where every file of a job lives, and the one reader of `job.json`,
`submission.json` and `lease.json`. The job's state file (`state.jsonl`: its events, how they are
written, and every run and how it ended) is :mod:`hpcrl.runstate`'s; what the trainer leaves
there (metrics, checkpoints) and the run in words are :mod:`hpcrl.runreport`'s.

No other module joins path names inside a run directory: the submission, the node agent, the
commands and the trainer's reader ask :class:`RunDir` and :class:`RunPaths`. Reading stays light
(no Slurm, no torch). Layout::

    RUN/job.json               the job (payload = trainer argv with its overrides)
    RUN/submission.json        job id and log patterns
    RUN/canary                 nonce written at submission; every node checks it
    RUN/state.jsonl            the job's state file: one JSON object per line, appended by the
                               node agents (phase changes, exit statuses, requeues)
    RUN/lease.json             the job holding the run directory (its head's lease: job id, run,
                               host, pid); one job at a time, a requeued run takes it over
    RUN/logs/                  the batch script's and the nodes' output (Slurm's log files)
    RUN/<R>/                   one directory per run (R = 0, 1, ...: the next free one, claimed
                               by the job script at every start, of every job of RUN):
        token rendezvous.json head-alive nodes/<rank>.json stop.json warning summary.txt
        logs/agent-<rank>-<host>.log logs/payload.log
    RUN/metrics.png            `hpcrl plot`'s picture
    <trainer.run_dir>/metrics.jsonl              one JSON object per step
    <trainer.run_dir>/run_id                     the run's identity, written once by its first
                                                 checkpoint (`trainer.checkpoint.layout`)
    <trainer.default_local_dir>/global_step_N/   checkpoints (complete: the trainer's rule,
                                                 a manifest naming the step and every file
                                                 with its size, all present)

Launched by hpcrl (`HPCRL_RUN_DIR` set), the trainer writes its metrics to RUN and its
checkpoints to `RUN/checkpoints`; explicit `trainer.run_dir=`/`trainer.default_local_dir=`
overrides in the payload are followed (relative ones from RUN, its working directory).

The state of a job (`hpcrl status`, `--follow`, `cancel`, a local run's progress) is read from
`state.jsonl` alone; the agents' logs are for people and are never parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.metrics import METRICS_FILE  # the trainer writes it; named once, there

JOB_FILE = "job.json"
SUBMISSION_FILE = "submission.json"
CANARY_FILE = "canary"
STATE_FILE = "state.jsonl"
LEASE_FILE = "lease.json"
LOGS = "logs"
PAYLOAD_LOG = "payload.log"
CHECKPOINTS = "checkpoints"


class RunFileError(ValueError):
    """A file of the run directory is missing or damaged."""


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class RunPaths:
    """Where one run (job + restart) keeps its files: `RUN/<restart>/`."""

    run_dir: Path
    restart: int

    @property
    def root(self) -> Path:
        return self.run_dir / str(self.restart)

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous.json"

    @property
    def head_alive(self) -> Path:
        return self.root / "head-alive"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def stop(self) -> Path:
        return self.root / "stop.json"

    @property
    def cancel(self) -> Path:
        """`hpcrl cancel`'s request to the job named in it: checkpoint, then end (`RUN/`, not
        the restart's directory: the command does not know which restart runs)."""
        return self.run_dir / "cancel.json"

    @property
    def summary(self) -> Path:
        """The run's summary for people: a headline, then one line per node."""
        return self.root / "summary.txt"

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def payload_log(self) -> Path:
        return self.logs / PAYLOAD_LOG

    @property
    def warning(self) -> Path:
        """Written by the batch script's trap when Slurm's warning signal arrives (the signal
        itself stays in the batch shell: sent through `srun` it would reach every process of the
        step, Ray's included, and kill them)."""
        return self.root / "warning"

    def node_file(self, rank: int) -> Path:
        return self.nodes / f"{rank}.json"

    def agent_log(self, rank: int, host: str) -> Path:
        return self.logs / f"agent-{rank}-{host}.log"

    def node_log(self, role: str, rank: int, host: str) -> Path:
        """The output of a process the agent of node `rank` started (`ray-start`, `gcs-watch`),
        or, for `ray`, the directory of Ray's own logs kept after the run."""
        return self.logs / (f"{role}-{rank}-{host}" + ("" if role == "ray" else ".log"))

    def helper(self, name: str) -> Path:
        """A script the head copies here for the processes next to Ray (in the container)."""
        return self.root / name

    def agent_logs(self, rank: int | None = None) -> list[Path]:
        """The agents' logs present (every node, or node `rank`), by rank."""
        pattern = f"agent-{rank}-*.log" if rank is not None else "agent-*.log"
        return sorted(self.logs.glob(pattern), key=lambda p: (int(p.name.split("-")[1]), p.name))


@dataclass(frozen=True)
class RunDir:
    """Where the job as a whole keeps its files: `RUN/`."""

    path: Path

    @property
    def job(self) -> Path:
        return self.path / JOB_FILE

    @property
    def submission(self) -> Path:
        return self.path / SUBMISSION_FILE

    @property
    def canary(self) -> Path:
        return self.path / CANARY_FILE

    @property
    def state(self) -> Path:
        return self.path / STATE_FILE

    @property
    def lease(self) -> Path:
        """The head's lease: which job holds the run directory (`hpcrl.agent.lease`)."""
        return self.path / LEASE_FILE

    @property
    def plot(self) -> Path:
        """Where `hpcrl plot` writes its PNG unless told otherwise."""
        return self.path / "metrics.png"

    @property
    def logs(self) -> Path:
        """Slurm's output files of the batch script and the nodes (`local-node0.out` locally)."""
        return self.path / LOGS

    def looks_like_one(self) -> bool:
        """A directory hpcrl wrote: it holds `job.json` or the trainer's metrics."""
        return (self.job.is_file() or (self.path / METRICS_FILE).is_file()
                or any(self.path.glob(f"*/{METRICS_FILE}")))


# The submission names the run's files in the scripts it renders: as text, exactly as given.


def log_patterns(run_dir: str) -> dict[str, str]:
    """Where Slurm (or submitit, or the local job script) writes each log (`%j` = job id,
    `%n`/`%t` = node index)."""
    return {
        "batch": f"{run_dir}/{LOGS}/slurm-%j.out",
        "node": f"{run_dir}/{LOGS}/%j-node%n.out",
        "local_node": f"{run_dir}/{LOGS}/local-node0.out",
        "submitit_folder": f"{run_dir}/submitit",
        "submitit_node": f"{run_dir}/submitit/%j_%t_log.out",
        "submitit_node_err": f"{run_dir}/submitit/%j_%t_log.err",
    }


def script_file(run_dir: str, local: bool) -> str:
    """The rendered job script: `job.sh` run by bash here, `job.sbatch` given to sbatch."""
    return f"{run_dir}/{'job.sh' if local else 'job.sbatch'}"


def job_file(run_dir: str) -> str:
    return f"{run_dir}/{JOB_FILE}"


def restart_indices(run_dir: Path) -> list[int]:
    """The restarts present in `run_dir` (`RUN/<N>/`), oldest first."""
    try:
        return sorted(int(p.name) for p in run_dir.iterdir() if p.name.isdigit() and p.is_dir())
    except FileNotFoundError:
        return []


# ----------------------------------------------------------------------------- job.json, submission.json


def _read_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; a :class:`RunFileError` naming the file, the fault and `fix`."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunFileError(f"cannot read `{path}` ({exc.strerror}); {fix}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunFileError(f"`{path}` is not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise RunFileError(f"`{path}` holds {type(data).__name__}, expected a JSON object; {fix}")
    return data


JOB_FIX = "the run directory must be created by `hpcrl submit` and be visible on every node"


def read_job(run_dir: Path, fix: str = JOB_FIX) -> dict[str, Any]:
    """The decoded `job.json` (its fields are checked by whoever uses them: `JobSpec`, the
    agent's `parse_job`); an error names the file, the fault and `fix`."""
    return _read_object(RunDir(run_dir).job, fix)


def read_submission(run_dir: Path) -> dict[str, Any]:
    """The decoded `submission.json`: `job_id`, `via`, `logs` (patterns with `%j`, `%n`)."""
    return _read_object(RunDir(run_dir).submission, "give the job id instead of the run "
                        "directory, or submit again with `--resume`")


def submission_logs(run_dir: Path) -> dict[str, str]:
    """The log patterns `submission.json` records (`batch`, `node`, ...)."""
    logs = read_submission(run_dir).get("logs")
    if not isinstance(logs, dict) or not all(isinstance(v, str) for v in logs.values()):
        raise RunFileError(
            f"`{RunDir(run_dir).submission}` has no `logs` mapping of log patterns (received "
            f"`logs`: {logs!r}); `hpcrl submit` records them there. Fix: read one run's logs "
            f"with `hpcrl logs {run_dir} --restart last`, or the files under `{run_dir}/logs/`")
    return logs


def submitted_job_id(run_dir: Path) -> str | None:
    """The job id `submission.json` records, None when there is none to read."""
    try:
        job_id = read_submission(run_dir).get("job_id")
    except RunFileError:
        return None
    return None if job_id is None else str(job_id)


def read_lease(run_dir: Path) -> dict[str, Any] | None:
    """The lease (`job_id`, `run`, `host`, `pid`, `time`), None when no job holds it; a damaged
    one reads as `{"job_id": None}` (held by nobody known)."""
    try:
        return _read_object(RunDir(run_dir).lease, "")
    except RunFileError:
        return None if not RunDir(run_dir).lease.exists() else {"job_id": None}


def write_submission(run_dir: Path, data: dict[str, Any]) -> None:
    """Record the submission (job id, how, log patterns) for `status`, `logs` and `cancel`."""
    RunDir(run_dir).submission.write_text(json.dumps(data, indent=2) + "\n")

