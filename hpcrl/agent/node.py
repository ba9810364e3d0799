"""What every part of the node agent shares: the node's identity, its log, its heartbeat file,
and the one way its processes enter the job's container.

`Node` exists only once the job file is read, so nothing that holds one checks for the job.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl import runtimes
from hpcrl.agent import rendezvous as rdv
from hpcrl.agent.jobfile import AgentJob
from hpcrl.agent.procs import Child
from hpcrl.containers import container_command
from hpcrl.devices import DEVICE_VARS
from hpcrl.profile_load import container_from_dict, profile_from_dict
from hpcrl.rundir import RunPaths
from hpcrl.runstate import Retrying, StateWriter
from hpcrl.slurm_env import JobContext

ContainerWrap = Callable[
    [AgentJob, Sequence[str], Mapping[str, str], Sequence[str], str, str],
    tuple[list[str], dict[str, str]],
]
"""(job, argv, env for the container, binds, workdir, container name) -> (argv that runs `argv`
in the job's container, variables to add to that command's own environment)."""

TICK_S = 0.1
"""How often every loop of the agent looks again."""
BEAT_S = 2.0
"""How often a node rewrites its heartbeat file, and how often the others read it."""


class AgentError(RuntimeError):
    """The job cannot go on; the message names the node and the cause."""


@dataclass
class Outcome:
    """Why the node's part of the job ended, with what status, and what is left to do once the
    node is torn down (`then`: the deferred requeue, returning what happened)."""

    cause: str
    exit_code: int
    node: str
    then: Callable[[], str] | None = None
    announce: bool = True
    """Whether the teardown tells every node the job ends (a stop request). Not when this node
    leaves the job's end to another: a worker that defers the requeue after the head's loss to a
    lower-ranked one must not stop it before it has noticed the loss itself."""


def container_wrap(
    job: AgentJob,
    argv: Sequence[str],
    env: Mapping[str, str],
    binds: Sequence[str],
    workdir: str,
    name: str,
) -> tuple[list[str], dict[str, str]]:
    """Runtime `none` runs `argv` as is; the others through `hpcrl.containers`."""
    if job.runtime == "none":
        return list(argv), dict(env)
    profile = profile_from_dict(job.profile)
    cmd = container_command(
        profile.container,
        argv,
        env,
        passthrough=job.secrets,
        binds=binds,
        workdir=workdir,
        name=name,
    )
    return list(cmd.argv), dict(cmd.env)


def exit_status(argv: Sequence[str]) -> int:
    """Run `argv` quietly and return its exit status (127 when the program is not installed)."""
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=120, check=False).returncode
    except FileNotFoundError:
        return 127
    except subprocess.TimeoutExpired:
        return 0  # the runtime is slow to answer, not proof of a missing image: go on


def check_image(job: AgentJob, hostname: str, run: Callable[[Sequence[str]], int] = exit_status) -> None:
    """Fail within seconds, naming this node and the image, when the node cannot start the
    job's container image (rather than when Ray never joins, minutes later)."""
    if job.runtime == "none":
        return
    container = container_from_dict(job.profile.get("container") or {})
    problem = runtimes.get(job.runtime).image_problem(container, run)
    if problem is not None:
        raise AgentError(f"node {hostname}: {problem}")


def node_tag(ctx: JobContext) -> str:
    """`RANK-HOST`: names this node's logger."""
    return f"{ctx.node_rank}-{ctx.hostname}"


TMP_BASE_MAX = 40
"""Longest temp base taken from `TMPDIR`: Ray's Unix sockets lie about 70 characters below its
temp dir, and a socket path holds at most 107."""


def temp_base(environ: Mapping[str, str]) -> Path:
    """Where this node's temp dir goes: the job's `TMPDIR` (Slurm sites point it at the job's
    own space) when it is an existing absolute directory short enough for Ray's sockets, else
    `/tmp`."""
    base = environ.get("TMPDIR", "")
    if base and os.path.isabs(base) and os.path.isdir(base) and len(base) <= TMP_BASE_MAX:
        return Path(base)
    return Path("/tmp")


def tmp_prefix(ctx: JobContext) -> str:
    """The name of this run's temp dir on this node, before its random part."""
    return f"hr-{ctx.job_id}-{ctx.restart}-{ctx.node_rank}-"


def make_node_tmp(ctx: JobContext, environ: Mapping[str, str]) -> Path:
    """This run's private temp dir on this node (Ray's `--temp-dir`, bound into containers):
    created by `mkdtemp` (mode 0700, a random name no other user can guess or create first)."""
    return Path(tempfile.mkdtemp(prefix=tmp_prefix(ctx), dir=temp_base(environ)))


def container_name(ctx: JobContext, role: str) -> str:
    """The name of the container running `role` (ray, watch, payload, version) on this node."""
    return f"hr-{ctx.job_id}-{ctx.restart}-{ctx.node_rank}-{role}"


def state_writer(run_dir: Path, ctx: JobContext, retry: Retrying | None = None) -> StateWriter:
    """This node's voice in the job's state file (what `hpcrl status` and `--follow` read);
    `retry`: how a transient file-system error is retried (default: `heartbeat_timeout_s`'s
    default, said on stderr)."""
    return StateWriter(run_dir, ctx.run, ctx.node_rank, ctx.hostname, retry or Retrying())


def open_log(paths: RunPaths, ctx: JobContext) -> logging.Logger:
    """Create the run's per-restart directories and the node's logger (file and stderr)."""
    rdv.create_run_dirs(paths, ctx.hostname)
    log = logging.getLogger(f"hpcrl.agent.{node_tag(ctx)}")
    fmt = logging.Formatter(
        f"%(asctime)s hpcrl-agent[{ctx.hostname} rank {ctx.node_rank}] %(message)s"
    )
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in (
        logging.FileHandler(paths.agent_log(ctx.node_rank, ctx.hostname)),
        logging.StreamHandler(sys.stderr),
    ):
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log


def close_log(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)


@dataclass
class Heartbeat:
    """This node's file in the run directory: its state, what the others need to know of it
    (address, ports, Ray's pid), rewritten in place every `BEAT_S` while it lives with one more
    `beat`; and its view of the other nodes' files (`peers`).

    A transient file-system error (`runstate.TRANSIENT_ERRNOS`) does not end the job: a beat is
    tried again at the next looks, a state change until it is written, both for up to
    `retry.patience_s` (the job's `heartbeat_timeout_s`: past it the others count this node as
    dead anyway)."""

    paths: RunPaths
    ctx: JobContext
    info: dict[str, Any] = field(default_factory=dict)
    last: float = -BEAT_S
    retry: Retrying = field(default_factory=Retrying)
    count: int = 0
    _file: rdv.NodeFileWriter | None = None
    _peers: rdv.Peers | None = None

    @property
    def peers(self) -> rdv.Peers:
        """The node files as this node reads them, and which nodes went silent."""
        if self._peers is None:
            self._peers = rdv.Peers(self.paths, expected=self.ctx.num_nodes)
        return self._peers

    def _put(self, state: str, extra: dict[str, Any], sync: bool) -> None:
        if self._file is None:
            nfs = rdv.fs_type(self.paths.run_dir).startswith("nfs")
            self._file = rdv.NodeFileWriter(self.paths.node_file(self.ctx.node_rank), nfs)
        record = rdv.node_record(self.ctx.node_rank, self.count + 1,
                                 {"host": self.ctx.hostname, "state": state, **self.info, **extra})
        self._file.write(record, sync)
        self.count += 1
        self.last = time.monotonic()

    @property
    def _what(self) -> str:
        return f"the heartbeat `{self.paths.node_file(self.ctx.node_rank)}`"

    def write(self, state: str, **extra: Any) -> None:
        """Write a new state now (retried until written, within the patience)."""
        self.retry.run(lambda: self._put(state, extra, True), self._what)

    def beat(self, state: str) -> None:
        """Rewrite the file every `BEAT_S`: the heartbeat the other nodes watch."""
        if time.monotonic() - self.last >= BEAT_S and self.retry.due():
            self.retry.attempt(lambda: self._put(state, {}, False), self._what)


@dataclass
class Node:
    """One node of a job whose job file was read: who it is, where it logs, and how it starts
    its processes (in the job's container, recorded in `children` for the teardown)."""

    run_dir: Path
    env: dict[str, str]
    ctx: JobContext
    paths: RunPaths
    job: AgentJob
    log: logging.Logger
    wrap: ContainerWrap
    children: dict[str, Child]
    tmp: Path
    """This run's private temp dir on this node (`make_node_tmp`)."""

    @property
    def retry(self) -> Retrying:
        """How this node retries a write the file system refused for a while: for up to the
        job's `heartbeat_timeout_s`, said in its log."""
        return Retrying(self.job.heartbeat_timeout_s, self.log.warning)

    @property
    def state(self) -> StateWriter:
        return state_writer(self.run_dir, self.ctx, self.retry)

    @property
    def python(self) -> str:
        """The Python that runs Ray, the watcher and the payload (in the container)."""
        return self.job.python or sys.executable

    def in_container(
        self, role: str, argv: Sequence[str], env: Mapping[str, str], workdir: str
    ) -> tuple[list[str], dict[str, str]]:
        """The command running `argv` in the job's container, and its process environment."""
        # the container gets what the agent adds and, always, the profile's environment (the batch
        # script exported it to the agent too, but a container starts from a clean environment),
        # and the devices of the job's allocation (Slurm set them for the agent's step)
        extra = {k: v for k, v in env.items()
                 if k in self.job.env or k in DEVICE_VARS or self.env.get(k) != v}
        binds = [str(self.run_dir), str(self.tmp)]
        name = container_name(self.ctx, role)
        wrapped, add = self.wrap(self.job, argv, extra, binds, workdir, name)
        return wrapped, {**env, **add}

    def start(
        self, role: str, label: str, argv: Sequence[str], env: Mapping[str, str], workdir: str,
        log: Path, cwd: str, **child_args: Any,
    ) -> Child:
        """Start `argv` as `role` in the container; the teardown stops and removes it."""
        wrapped, proc_env = self.in_container(role, argv, env, workdir)
        child = Child(label, wrapped, proc_env, log, cwd=cwd, **child_args)
        self.children[role] = child
        return child

