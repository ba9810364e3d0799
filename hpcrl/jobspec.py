"""The job specification: `<RUN_DIR>/job.json`, written before submission, read by the node agent.

Contract with the node agent (`python -m hpcrl.agent <RUN_DIR>`, one per node):

- ``JobSpec.from_dict(hpcrl.rundir.read_job(run_dir))`` gives the job.
- ``profile`` is the fully resolved site profile as plain data; rebuild the dataclasses with
  :func:`hpcrl.profile_load.profile_from_dict`.
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
import shutil
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


#: The trainer's loops (`hpcrl submit --loop`) and the module each runs: the colocated,
#: synchronous trainer, and verl's one-step-off and fully-async recipes on a rollout pool of its own.
LOOP_MODULES = {"sync": "trainer", "one-step-off": "trainer.one_step_off", "fully-async": "trainer.fully_async"}


def default_payload(python: str, overrides: Sequence[str], loop: str = "sync") -> tuple[str, ...]:
    """`[python, -m, trainer, <overrides>]`: the PPO trainer with verl-style overrides (`loop`:
    the module of another loop, :data:`LOOP_MODULES`)."""
    return (python, "-m", LOOP_MODULES[loop], *overrides)


def payload_loop(payload: Sequence[str]) -> str | None:
    """The trainer loop a default payload runs, as the trainer names it (`sync`,
    `one_step_off`, `fully_async`); None for another command."""
    for loop, module in LOOP_MODULES.items():
        if list(payload[1:3]) == ["-m", module]:
            return loop.replace("-", "_")
    return None


class RunDirError(ValueError):
    """The run directory exists and is not empty, or cannot be created."""


def canary_nonce(spec: JobSpec, run_dir: str | Path) -> str:
    """The value every node must find in `<run_dir>/canary` (exported as `HPCRL_CANARY`): a
    digest of this submission, so a node with its own copy of the run directory fails fast."""
    timeless = dataclasses.replace(spec, created=0.0)  # a dry run and its submission agree
    digest = hashlib.sha256(f"{Path(run_dir).expanduser().absolute()}\0{timeless.to_json()}".encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_run_dir` did, so that a submission that fails can undo it: no
    `job.json` remains that a later `--resume` would run."""

    run_dir: Path
    created: bool = field(metadata={"help": "the run directory did not exist before"})
    previous_job: str | None = field(metadata={
        "help": "the text of `job.json` before (None: there was none)"})

    def undo(self) -> None:
        """Remove the run directory made for this submission, or put `job.json` back."""
        if self.created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self.previous_job is None:
            RunDir(self.run_dir).job.unlink(missing_ok=True)
        else:
            _write_private(RunDir(self.run_dir).job, self.previous_job)


def spec_differences(old: JobSpec, new: JobSpec) -> list[str]:
    """What `new` changes in `old`, one phrase per key (its creation time aside): the payload's
    arguments dropped and added, other values as `old -> new`."""
    before, after = json.loads(old.to_json()), json.loads(new.to_json())
    out = []
    if before.pop("payload") != after.pop("payload"):
        gone = [a for a in old.payload if a not in new.payload]
        added = [a for a in new.payload if a not in old.payload]
        words = ([f"drops {', '.join(f'`{a}`' for a in gone)}"] if gone else []) + (
            [f"adds {', '.join(f'`{a}`' for a in added)}"] if added else []) or ["reorders it"]
        out.append(f"`payload` {' and '.join(words)}")
    flat_old, flat_new = _flatten(before), _flatten(after)
    for key in sorted(set(flat_old) | set(flat_new), key=lambda k: (k.startswith("profile."), k)):
        if key == "created" or flat_old.get(key) == flat_new.get(key):
            continue
        out.append(f"`{key}` {_shown(flat_old.get(key, _ABSENT))} -> "
                   f"{_shown(flat_new.get(key, _ABSENT))}")
    return out


_ABSENT = object()


def _shown(value: Any) -> str:
    return "(absent)" if value is _ABSENT else f"`{json.dumps(value)}`"


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


UPDATE_SPEC = "--update-spec"


def check_resumable(run_dir: Path) -> None:
    """Refuse `--resume` of a run directory that does not exist, naming runs nearby."""
    run_dir = run_dir.expanduser().absolute()
    if not run_dir.is_dir():
        raise RunDirError(
            f"`--resume`: run directory `{run_dir}` does not exist, so there is nothing to "
            f"resume{_nearby_runs(run_dir.parent)}. Check the path, or leave out `--resume` to "
            "start a new run there")


def prepare_run_dir(run_dir: Path, spec: JobSpec, *, resume: bool = False,
                    update_spec: bool = False) -> Prepared:
    """Create `run_dir` (0700) with `logs/` and write `job.json` (0600) atomically.

    An existing non-empty directory is refused unless `resume` is true. When resuming, the
    existing `job.json` is kept if `spec` is the same job; a changed one is refused, naming each
    difference, unless `update_spec` (`--update-spec`) replaces it.
    """
    run_dir = run_dir.expanduser().absolute()
    if resume:
        check_resumable(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise RunDirError(
            f"run directory `{run_dir}` exists and is not empty; it belongs to another job. "
            "Choose a new `--run-dir`, or pass `--resume` to continue that job")
    target = RunDir(run_dir).job
    previous = _kept_job(run_dir, spec, update_spec) if resume and target.exists() else None
    created = not run_dir.exists()
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
    if previous is not None and not update_spec:
        return Prepared(run_dir, created, previous)
    _write_private(target, spec.to_json())
    return Prepared(run_dir, created, previous)


def _kept_job(run_dir: Path, spec: JobSpec, update_spec: bool) -> str:
    """The text of the run's `job.json`, checked against `spec`: refused when damaged, or when
    it is another job and `update_spec` is false."""
    try:  # refuse a damaged job.json before submitting
        old = JobSpec.from_dict(read_job(run_dir, "rewrite it with `hpcrl submit`/`hpcrl render`"))
    except RunFileError as exc:
        raise JobSpecError(str(exc)) from None
    changed = spec_differences(old, spec)
    if changed and not update_spec:
        shown = "; ".join(changed[:12]) + (f"; and {len(changed) - 12} more" if len(changed) > 12
                                           else "")
        raise JobSpecError(
            f"`--resume`: this submission is not the job in `{RunDir(run_dir).job}`: {shown}. "
            "Fix: resume with the job's own site, flags and overrides (no overrides after `--` "
            f"keeps the job's), or pass `{UPDATE_SPEC}` to run the rest of the job with these")
    return RunDir(run_dir).job.read_text()


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
