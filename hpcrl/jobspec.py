"""The job specification: `<RUN_DIR>/job.json`, written before submission, read by the node agent.

Contract with the node agent (`python -m hpcrl.agent <RUN_DIR>`, one per node):

- ``JobSpec.from_dict(hpcrl.rundir.read_job(run_dir))`` gives the job.
- ``profile`` is the fully resolved site profile as plain data; rebuild the dataclasses with
  :func:`hpcrl.profiles.profile_from_dict`.
- ``payload`` is the argv of the payload run on the head inside the container (default
  ``[python, -m, trainer, <overrides...>]``).
- ``secrets`` lists variable NAMES passed through from the submitting environment; the values
  reach the job through Slurm's environment export and are never written here.

Starting the payload's container on a node, as the agent is expected to::

    profile = profile_from_dict(spec.profile)
    env = {**profile.env, **env_for_ray_version(profile.ray.version_env, ray_version_in_image)}
    cmd = container_command(profile.container, argv, env, passthrough=spec.secrets,
                            binds=[str(run_dir)], workdir=profile.container.workdir or str(run_dir))
    subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env})

(:func:`hpcrl.containers.container_command`, :func:`hpcrl.profiles.env_for_ray_version`.)

The file is written with mode 0600 inside a run directory of mode 0700, atomically (temporary
name, then rename).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.rundir import RunDir, RunFileError, read_job

SPEC_VERSION = 1
PAYLOAD_STARTS = ("all-joined", "head-alive")
"""When the head starts the payload (`JobSpec.payload_start`)."""


class JobSpecError(ValueError):
    """`job.json` is missing fields, has wrong types, or comes from an unknown version."""


@dataclass(frozen=True)
class JobSpec:
    """What to run, where and how often it may requeue."""

    site: str = field(metadata={"help": "name of the site profile"})
    profile: Mapping[str, Any] = field(metadata={"help": "fully resolved profile (plain data)"})
    payload: tuple[str, ...] = field(metadata={"help": "argv run on the head in the container"})
    nodes: int = field(metadata={"help": "number of nodes (one agent each)"})
    max_requeues: int = field(metadata={"help": "requeues allowed after time limit/preemption"})
    secrets: tuple[str, ...] = field(default=(), metadata={
        "help": "names of variables passed through from the submitting environment"})
    created: float = field(default_factory=time.time, metadata={
        "help": "creation time, seconds since the epoch"})
    version: int = field(default=SPEC_VERSION, metadata={"help": "format version of job.json"})
    payload_start: str = field(default="all-joined", metadata={
        "help": "when the head starts the payload: `all-joined` (every node's Ray is in the "
                "cluster) or `head-alive` (the head's Ray is; the payload waits for the other "
                "nodes itself, as the trainer's placement group does, and its start-up overlaps "
                "their joining)"})

    def to_json(self) -> str:
        data = {
            "version": self.version,
            "site": self.site,
            "profile": self.profile,
            "payload": list(self.payload),
            "nodes": self.nodes,
            "max_requeues": self.max_requeues,
            "secrets": list(self.secrets),
            "created": self.created,
            "payload_start": self.payload_start,
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JobSpecError(f"job.json is not valid JSON ({exc}); rewrite it with "
                               "`hpcrl submit`/`hpcrl render`") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """The job from the decoded `job.json`, every field checked."""
        if not isinstance(data, dict):
            raise JobSpecError(f"job.json must hold an object, got {type(data).__name__}")
        if data.get("version") != SPEC_VERSION:
            raise JobSpecError(f"job.json has version {data.get('version')!r}; this hpcrl reads "
                               f"version {SPEC_VERSION}: submit with the same hpcrl version")
        expected: dict[str, type | tuple[type, ...]] = {"site": str, "profile": dict, "payload": list, "nodes": int,
                    "max_requeues": int, "secrets": list, "created": (int, float)}
        unknown = sorted(set(data) - set(expected) - {"version", "payload_start"})
        if unknown:
            raise JobSpecError(f"job.json has unknown key(s) {unknown}; valid keys: "
                               f"{', '.join(['version', *expected, 'payload_start'])}")
        for key, typ in expected.items():
            if not isinstance(data.get(key), typ) or isinstance(data.get(key), bool):
                raise JobSpecError(f"job.json key `{key}` is {data.get(key)!r}, which is not "
                                   f"a {getattr(typ, '__name__', 'number')}")
        start = data.get("payload_start", "all-joined")  # absent in job.json files before it
        if start not in PAYLOAD_STARTS:
            raise JobSpecError(f"job.json key `payload_start` is {start!r}; expected one of "
                               f"{', '.join(PAYLOAD_STARTS)}")
        return cls(site=data["site"], profile=data["profile"], payload=tuple(data["payload"]),
                   nodes=data["nodes"], max_requeues=data["max_requeues"],
                   secrets=tuple(data["secrets"]), created=float(data["created"]),
                   version=data["version"], payload_start=start)


def default_payload(python: str, overrides: Sequence[str]) -> tuple[str, ...]:
    """`[python, -m, trainer, <overrides>]`: the PPO trainer with verl-style overrides."""
    return (python, "-m", "trainer", *overrides)


class RunDirError(ValueError):
    """The run directory exists and is not empty, or cannot be created."""


def canary_nonce(spec: JobSpec, run_dir: str | Path) -> str:
    """The value every node must find in `<run_dir>/canary` (exported as `HPCRL_CANARY`): a
    digest of this submission, so a node with its own copy of the run directory fails fast."""
    timeless = dataclasses.replace(spec, created=0.0)  # a dry run and its submission agree
    digest = hashlib.sha256(f"{Path(run_dir).expanduser().absolute()}\0{timeless.to_json()}".encode())
    return digest.hexdigest()[:32]


def prepare_run_dir(run_dir: Path, spec: JobSpec, *, resume: bool = False) -> Path:
    """Create `run_dir` (0700) with `logs/` and write `job.json` (0600) atomically.

    An existing non-empty directory is refused unless `resume` is true; when resuming, an existing
    `job.json` is kept (the job continues as first specified).
    """
    run_dir = run_dir.expanduser().absolute()
    if resume and not run_dir.is_dir():
        raise RunDirError(
            f"`--resume`: run directory `{run_dir}` does not exist, so there is nothing to "
            f"resume{_nearby_runs(run_dir.parent)}. Check the path, or leave out `--resume` to "
            "start a new run there")
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise RunDirError(
            f"run directory `{run_dir}` exists and is not empty; it belongs to another job. "
            "Choose a new `--run-dir`, or pass `--resume` to continue that job")
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(run_dir, 0o700)
        RunDir(run_dir).logs.mkdir(mode=0o700, exist_ok=True)
        _write_private(RunDir(run_dir).canary, canary_nonce(spec, run_dir))
    except OSError as exc:
        raise RunDirError(
            f"cannot create the run directory `{run_dir}`: {exc.strerror or exc} "
            f"(`{exc.filename}`); choose a `--run-dir` on a writable file system the nodes "
            "share") from None
    target = RunDir(run_dir).job
    if resume and target.exists():
        try:  # refuse a damaged job.json before submitting
            JobSpec.from_dict(read_job(run_dir, "rewrite it with `hpcrl submit`/`hpcrl render`"))
        except RunFileError as exc:
            raise JobSpecError(str(exc)) from None
        return run_dir
    _write_private(target, spec.to_json())
    return run_dir


def _nearby_runs(parent: Path, limit: int = 5) -> str:
    """`; run directories in PARENT: a, b` (newest first), for an error about a mistyped path."""
    try:
        runs = [d for d in parent.iterdir() if RunDir(d).job.is_file()]
    except OSError:
        return f" (`{parent}` does not exist either)"
    if not runs:
        return f" (`{parent}` holds no run directory)"
    runs.sort(key=lambda d: RunDir(d).job.stat().st_mtime, reverse=True)
    more = f" and {len(runs) - limit} more" if len(runs) > limit else ""
    return f"; run directories in `{parent}`: " + ", ".join(d.name for d in runs[:limit]) + more


def _write_private(target: Path, text: str) -> None:
    """Write `text` to `target` (mode 0600) atomically: a temporary file renamed over it."""
    tmp = target.with_name(f".{target.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, target)
