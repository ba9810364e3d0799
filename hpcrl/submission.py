"""From (site profile, job spec) to a submitted Slurm job.

The spine is a dry run: :func:`build_request` is a pure function returning a :class:`Request`
(the rendered sbatch script, the `sbatch` argv, the submitit parameters and the log paths);
``--dry-run`` prints it; :func:`submit` is the one function that calls `sbatch` or submitit.

The rendered script (``sbatch_templates/job.sbatch.j2``):

- `#SBATCH` lines from the profile plus ``--requeue``, ``--open-mode=append``,
  ``--signal=B:<SIG>@<lead>`` and ``--export=<secret names>`` (or ``NONE``): secrets travel by
  name, the script holds no secret value;
- exports ``SLURM_EXPORT_ENV=ALL`` (so `srun` steps see what the script exports), an absolute
  ``PATH`` and the profile's non-secret environment, every value shell-quoted;
- traps the warning signal and notes it in the run directory for the node agents;
- starts in the run directory (``--chdir``) and runs ``srun --ntasks-per-node=1
  --nodes=$SLURM_JOB_NUM_NODES --kill-on-bad-exit=1 --export=ALL <abs python> -P -m hpcrl.agent
  <RUN_DIR>`` (``-P``: neither the directory the job was submitted from nor the working
  directory is put on ``sys.path``, so no file planted there is imported): one node agent per node, each node's
  output in ``<RUN_DIR>/logs/<jobid>-node<N>.out``, the batch script's in
  ``<RUN_DIR>/logs/slurm-<jobid>.out``.

The warning signal stays in the batch shell (``B:``): its trap writes ``<RUN_DIR>/<restart>/warning``
and the head's node agent asks the payload to checkpoint and stop. It is never sent through
``srun``: Slurm would deliver it to every process of the step, and Ray's processes die of it.

Through submitit the same job runs :func:`hpcrl.agent_entry` (``python -m hpcrl.agent`` in
process) as one task per node, with ``python -P`` and ``--chdir`` likewise. submitit's batch shell waits on ``srun`` in the foreground, so a
trap there could not act before the job ends: it ignores the warning (``--signal=B:SIG@lead``,
``trap '' SIG``) and the head's agent relies on its own clock (end time minus the lead).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets as _secrets
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hpcrl
from hpcrl import rundir, runstate
from hpcrl.agent.rendezvous import CANARY_ENV
from hpcrl.containers import container_command
from hpcrl.jobspec import JobSpec, canary_nonce
from hpcrl.localrun import run_foreground
from hpcrl.profiles import SiteProfile, parse_time_minutes, profile_to_dict
from hpcrl.rundir import JOB_FILE
from hpcrl.slurm import (
    SlurmError,
    SlurmUnavailable,
    parse_sbatch_output,
    queue_entries,
    run_slurm,
)
from hpcrl.templates import render_template

TEMPLATE = "job.sbatch.j2"
LOCAL_TEMPLATE = "local.sh.j2"
VIAS = ("submitit", "sbatch")
LOCAL_VIA = "local"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SAFE_PATH_RE = re.compile(r"^[^%\x00-\x1f\x7f]+$")
BIND_SEPARATORS = ":,"
"""Characters a container runtime reads inside a bind (`SRC:DST:OPTS`, `a,b`)."""


class RequestError(ValueError):
    """The job cannot be rendered as asked (bad value for a Slurm option, bad run directory)."""


@dataclass(frozen=True)
class Request:
    """Everything that would be submitted; printing it is the dry run."""

    via: str = field(metadata={"help": "`sbatch` (the rendered script) or `submitit`"})
    site: str = field(metadata={"help": "site profile name"})
    run_dir: str = field(metadata={"help": "absolute run directory"})
    spec: JobSpec = field(metadata={"help": "the job written to <run_dir>/job.json"})
    script: str = field(metadata={"help": "the batch script sbatch receives"})
    sbatch_argv: tuple[str, ...] = field(metadata={"help": "sbatch command (via sbatch)"})
    submitit_params: Mapping[str, Any] = field(metadata={"help": "SlurmExecutor parameters"})
    python: str = field(metadata={"help": "absolute Python running the node agent"})
    logs: Mapping[str, str] = field(metadata={"help": "log path patterns (%j: job id)"})

    def describe(self) -> str:
        """Human summary printed by `--dry-run` before the script."""
        lines = [f"# site: {self.site}", f"# via: {self.via}", f"# run directory: {self.run_dir}"]
        if self.via in ("sbatch", "local"):
            lines.append(f"# command: {shlex.join(self.sbatch_argv)}")
        else:
            params = json.dumps(dict(self.submitit_params), sort_keys=True)
            lines.append(f"# submitit.SlurmExecutor(folder={self.logs['submitit_folder']!r}, "
                         f"python={submitit_python(self.python)!r}).update_parameters(**{params})")
            lines.append(f"# submitit callable: hpcrl.agent_entry({self.run_dir!r})")
        lines += [f"# log ({k}): {v}" for k, v in job_logs(self).items()]
        lines.append(f"# {JOB_FILE}:")
        lines += ["#   " + ln for ln in self.spec.to_json().splitlines()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- pure parts


def default_run_dir(profile: SiteProfile, now: float | None = None, token: str | None = None
                    ) -> Path:
    """`<run_root>/<site>-<UTC time>-<random>`: unique, never an existing job's directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    token = token or _secrets.token_hex(3)
    return Path(profile.run_root).expanduser() / f"{profile.name}-{stamp}-{token}"


def check_run_dir(run_dir: str) -> str:
    """An absolute run directory usable in Slurm file patterns (no `%`, no control chars)."""
    if not os.path.isabs(run_dir):
        raise RequestError(f"run directory {run_dir!r} must be absolute")
    if not _SAFE_PATH_RE.match(run_dir):
        raise RequestError(f"run directory {run_dir!r} contains `%` or a control character; "
                           "Slurm reads `%` in log paths as a pattern: choose another `--run-dir`")
    bad = sorted({c for c in run_dir if c in BIND_SEPARATORS})
    if bad:
        raise RequestError(
            f"run directory {run_dir!r} contains {' and '.join(f'`{c}`' for c in bad)}: the run "
            "directory is bound into the job's containers as `SRC[:DST[:OPTS]]` (`,` separates "
            "binds), so these would add other bind mounts. Fix: choose a `--run-dir` (or "
            "`run_root` in the site profile) without `:` and `,`")
    return run_dir


def sbatch_option(key: str, value: str | bool | int) -> str:
    """`--key=<quoted value>` for an `#SBATCH` line; refuses values that would break the line."""
    if value is True:
        return f"--{key}"
    text = str(value)
    if re.search(r"[\x00-\x1f\x7f]", text):
        raise RequestError(f"value {text!r} for `--{key}` contains a newline or control "
                           "character; fix it in the site profile or on the command line")
    return f"--{key}={shlex.quote(text)}"


def parse_extra_sbatch(options: Sequence[str]) -> list[tuple[str, str | bool]]:
    """`["--constraint=mi300x", "--exclusive"]` -> [("constraint", "mi300x"), ("exclusive", True)]."""
    out: list[tuple[str, str | bool]] = []
    for opt in options:
        m = re.fullmatch(r"--([A-Za-z][A-Za-z0-9-]*)(?:=(.*))?", opt, flags=re.S)
        if not m:
            raise RequestError(f"extra sbatch option {opt!r} is not `--name` or `--name=value` "
                               "(fix `slurm.extra_sbatch`)")
        out.append((m.group(1), True if m.group(2) is None else m.group(2)))
    return out


def slurm_options(profile: SiteProfile, job_name: str) -> list[tuple[str, str | bool | int]]:
    """The profile's Slurm settings as (option, value), before the hpcrl-fixed ones."""
    s = profile.slurm
    opts: list[tuple[str, str | bool | int]] = [("job-name", job_name), ("nodes", s.nodes),
                                                ("ntasks-per-node", 1)]
    for key, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos),
                       ("cpus-per-task", s.cpus_per_task), ("mem", s.mem)):
        if value is not None:
            opts.append((key, value))
    if s.gpus_per_node:
        opts.append(("gpus-per-node", s.gpus_per_node))
    opts.append(("time", s.time))
    if s.exclusive:
        opts.append(("exclusive", True))
    opts += parse_extra_sbatch(s.extra_sbatch)
    return opts


def export_value(names: Sequence[str]) -> str:
    """`--export` value: the secret names, or `NONE` (only `SLURM_*` variables pass)."""
    return ",".join(names) if names else "NONE"


def job_env(profile: SiteProfile, python: str, spec: JobSpec, run_dir: str) -> dict[str, str]:
    """The non-secret environment the script exports: PATH first, the profile's, and the
    shared-filesystem canary every node checks."""
    path = f"{os.path.dirname(python)}:{BASE_PATH}"
    env = {"PATH": path}
    env.update(profile.env)
    env[CANARY_ENV] = canary_nonce(spec, run_dir)
    return env


IDENTITY_LINES = (
    '# `--export=NONE` can leave USER and HOME unset; take them from the user database.',
    ': "${USER:=$(id -un)}"; export USER',
    ': "${HOME:=$(getent passwd "$USER" | cut -d: -f6)}"; export HOME',
)

STEP_LINES = (
    "# One node agent per node: a job requeued onto fewer nodes (`slurm.min_nodes`) keeps its",
    "# first task count in SLURM_NTASKS, which srun would otherwise spread over the survivors.",
    'export SLURM_NTASKS="$SLURM_JOB_NUM_NODES" SLURM_NPROCS="$SLURM_JOB_NUM_NODES"',
)


def signal_name(profile: SiteProfile) -> str:
    """The warning signal as Slurm and bash both take it (`sigusr1` -> `USR1`)."""
    return profile.slurm.signal.upper().removeprefix("SIG")


SAFE_PATH = "-P"
"""Python's flag keeping the working directory (and a script's directory) off `sys.path`."""


def agent_argv(python: str, run_dir: str) -> list[str]:
    """The node agent's command line."""
    return [python, SAFE_PATH, "-m", "hpcrl.agent", run_dir]


def srun_argv(python: str, run_dir: str, logs: Mapping[str, str]) -> list[str]:
    """The step starting one node agent per node (after `--nodes=$SLURM_JOB_NUM_NODES`)."""
    return ["--kill-on-bad-exit=1", "--export=ALL", "--open-mode=append",
            f"--output={logs['node']}", *agent_argv(python, run_dir)]


RUN_ENV = "HPCRL_RESTART"
"""The run's index in the run directory (`RUN/<N>/`), claimed by the batch script."""


def claim_run_lines(run_dir: str) -> list[str]:
    """Shell lines claiming this run's directory `<run_dir>/<N>/` (`RunPaths.root`) with the
    next free N, exported as `HPCRL_RESTART` to every node agent. Every run of every job claims
    its own: a job resumed with `--resume` (whose `SLURM_RESTART_COUNT` starts at 0 again) never
    meets an earlier job's stop request, warning or rendezvous. `mkdir` is atomic, also on NFS."""
    run = shlex.quote(run_dir) + f'/"${RUN_ENV}"'
    return [
        "# Each run of the job claims the next free run directory (a `--resume`d job too).",
        f"{RUN_ENV}=0",
        f"until mkdir -m 700 {run} 2>/dev/null; do",
        f"    [ -e {run} ] || {{ echo \"hpcrl: cannot create \"{run}; exit 2; }} >&2",
        f"    {RUN_ENV}=$(({RUN_ENV} + 1))",
        "done",
        f"export {RUN_ENV}",
    ]


def warning_dir(run_dir: str) -> str:
    """Shell text for `<run_dir>/<N>` (`RunPaths.root`), where the batch script notes the
    warning signal for the node agents."""
    return shlex.quote(run_dir) + f'/"${RUN_ENV}"'


def container_preview(profile: SiteProfile, spec: JobSpec, python: str, run_dir: str) -> str:
    """The container command the head node's agent runs (comment only, values not expanded)."""
    c = profile.container
    cmd = container_command(c, list(spec.payload), dict(profile.env),
                            passthrough=spec.secrets, workdir=c.workdir or run_dir,
                            binds=[run_dir], environ={})
    return cmd.display()


def comment_lines(text: str) -> list[str]:
    """Each line of `text` as a shell comment (a newline in a value cannot escape the comment)."""
    return ["# " + ln for ln in text.replace("\r", "\n").splitlines()]


def render_script(profile: SiteProfile, spec: JobSpec, run_dir: str, python: str) -> str:
    """The standalone sbatch script (pure: same inputs, same text)."""
    if profile.scheduler == "local":
        return render_local_script(profile, spec, run_dir, python)
    logs = rundir.log_patterns(run_dir)
    sig = signal_name(profile)
    options = slurm_options(profile, f"{profile.slurm.job_name}-{profile.name}")
    options += [("chdir", run_dir), ("requeue", True), ("open-mode", "append"), ("output", logs["batch"]),
                ("signal", f"B:{sig}@{profile.slurm.signal_lead_s}"),
                ("export", export_value(spec.secrets))]
    preview = [] if profile.container.runtime == "none" else comment_lines(
        "container (started on every node by the node agent, shown for the head):\n"
        + container_preview(profile, spec, python, run_dir))
    return render_template(
        TEMPLATE,
        site=profile.name,
        sbatch_options=[sbatch_option(k, v) for k, v in options],
        comments=preview,
        exports=[(k, shlex.quote(v)) for k, v in job_env(profile, python, spec, run_dir).items()],
        identity=[*IDENTITY_LINES, *STEP_LINES],
        claim=claim_run_lines(run_dir),
        run_dir=shlex.quote(run_dir),
        job_file=shlex.quote(rundir.job_file(run_dir)),
        setup=list(profile.slurm.setup),
        signal=sig,
        warning_dir=warning_dir(run_dir),
        srun_args=shlex.join(srun_argv(python, run_dir, logs)),
    )


def render_local_script(profile: SiteProfile, spec: JobSpec, run_dir: str, python: str) -> str:
    """The script running the node agent directly on this machine (`scheduler: local`)."""
    preview = [] if profile.container.runtime == "none" else comment_lines(
        "container:\n" + container_preview(profile, spec, python, run_dir))
    agent = shlex.join(agent_argv(python, run_dir))
    return render_template(
        LOCAL_TEMPLATE,
        site=profile.name,
        comments=preview,
        exports=[(k, shlex.quote(v)) for k, v in job_env(profile, python, spec, run_dir).items()],
        job_file=shlex.quote(rundir.job_file(run_dir)),
        run_dir=shlex.quote(run_dir),
        setup=list(profile.slurm.setup),
        signal=signal_name(profile),
        agent=f"{agent} >> {shlex.quote(rundir.log_patterns(run_dir)['local_node'])} 2>&1",
    )


def submitit_params(profile: SiteProfile, spec: JobSpec, run_dir: str, python: str
                    ) -> dict[str, Any]:
    """`SlurmExecutor.update_parameters` arguments for the same job."""
    s = profile.slurm
    extra: dict[str, Any] = {"chdir": run_dir, "requeue": True,
                             "signal": f"B:{signal_name(profile)}@{s.signal_lead_s}",
                             "export": export_value(spec.secrets)}
    if s.mem is not None:
        extra["mem"] = s.mem
    for key, value in parse_extra_sbatch(s.extra_sbatch):
        extra[key] = value
    params: dict[str, Any] = {
        "job_name": f"{s.job_name}-{profile.name}",
        "nodes": s.nodes,
        "ntasks_per_node": 1,
        "time": parse_time_minutes(s.time),
        "signal_delay_s": s.signal_lead_s,
        "setup": setup_lines(profile, spec, python, run_dir),
        "srun_args": ["--kill-on-bad-exit=1", "--export=ALL"],
        "additional_parameters": extra,
    }
    optional: dict[str, str | int | None] = {"partition": s.partition, "account": s.account,
                                             "qos": s.qos, "cpus_per_task": s.cpus_per_task}
    params.update({k: v for k, v in optional.items() if v is not None})
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.exclusive:
        params["exclusive"] = True
    for key, value in extra.items():
        if isinstance(value, str):
            sbatch_option(key, value)  # same line-safety rule as the rendered script
    return params


def setup_lines(profile: SiteProfile, spec: JobSpec, python: str, run_dir: str) -> list[str]:
    """Shell lines submitit puts before its `srun`: the same environment as the script."""
    lines = ["export SLURM_EXPORT_ENV=ALL"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job_env(profile, python, spec, run_dir).items()]
    lines += IDENTITY_LINES[1:]
    lines += STEP_LINES
    lines += ["# submitit runs srun in the foreground, so this shell could not act on the warning",
              "# signal before the job ends; it ignores it and the node agents keep their own clock",
              f"trap '' {signal_name(profile)}"]
    lines += list(profile.slurm.setup)
    job_file = shlex.quote(rundir.job_file(run_dir))
    lines.append(f'[ -r {job_file} ] || {{ echo "hpcrl: "{job_file}" is missing" >&2; exit 2; }}')
    lines += claim_run_lines(run_dir)
    return lines


def build_request(profile: SiteProfile, spec: JobSpec, run_dir: str, python: str,
                  via: str = "submitit") -> Request:
    """The complete submission, computed without side effects."""
    if profile.scheduler == "local":
        via = LOCAL_VIA
    elif via not in VIAS:
        raise RequestError(f"`--via {via}` is unknown; valid: {', '.join(VIAS)}")
    check_run_dir(run_dir)
    if not os.path.isabs(python):
        raise RequestError(f"python {python!r} must be an absolute path (jobs start with an "
                           "empty PATH); set `python:` in the site profile")
    script = render_script(profile, spec, run_dir, python)
    if via == LOCAL_VIA:
        return Request(via=via, site=profile.name, run_dir=run_dir, spec=spec, script=script,
                       sbatch_argv=("/bin/bash", rundir.script_file(run_dir, local=True)),
                       submitit_params={}, python=python,
                       logs={"node": rundir.log_patterns(run_dir)["local_node"]})
    params = submitit_params(profile, spec, run_dir, python)
    sbatch = ("sbatch", f"--export={export_value(spec.secrets)}",
              rundir.script_file(run_dir, local=False))
    return Request(via=via, site=profile.name, run_dir=run_dir, spec=spec, script=script,
                   sbatch_argv=sbatch, submitit_params=params, python=python,
                   logs=rundir.log_patterns(run_dir))


def make_spec(profile: SiteProfile, payload: Sequence[str], *, nodes: int | None = None,
              created: float | None = None, payload_start: str = "all-joined") -> JobSpec:
    """The job spec for `profile` (fully resolved profile embedded). `payload_start`
    `head-alive` is for a payload that waits for the cluster's nodes itself (the trainer)."""
    kwargs: dict[str, Any] = {"payload_start": payload_start}
    if created is not None:
        kwargs["created"] = created
    return JobSpec(site=profile.name, profile=profile_to_dict(profile), payload=tuple(payload),
                   nodes=nodes or profile.slurm.nodes, max_requeues=profile.slurm.max_requeues,
                   secrets=profile.secrets, **kwargs)


def submitit_script(req: Request) -> str:
    """The batch script submitit writes for this request (what `--via submitit` submits)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([submitit_python(req.python), "-u -m submitit.core._submit",
                        shlex.quote(req.logs["submitit_folder"])])
    return _make_sbatch_string(command=command, folder=req.logs["submitit_folder"],
                               **req.submitit_params)


def submitit_python(python: str) -> str:
    """submitit's command prefix for its entry (`<python> -P -u -m submitit.core._submit`)."""
    return f"{shlex.quote(python)} {SAFE_PATH}"


def dry_run_text(req: Request) -> str:
    """Exactly what would be submitted: summary, then the batch script."""
    script = submitit_script(req) if req.via == "submitit" else req.script
    return f"{req.describe()}\n# ---- batch script ----\n{script}"


# ----------------------------------------------------------------------------- side effects


@dataclass(frozen=True)
class Submitted:
    """A submitted job."""

    job_id: str
    run_dir: str
    via: str
    logs: Mapping[str, str]
    exit_status: int | None = None

    def lines(self) -> list[str]:
        out = [f"job id: {self.job_id}", f"run directory: {self.run_dir}"]
        for key, pattern in self.logs.items():
            path = pattern.replace("%j", self.job_id).replace("%n", "N").replace("%t", "N")
            label = key.replace("node", "node N").replace("_", " ")
            out.append(f"log ({label}): {path}")
        if self.exit_status is not None:
            out.append(f"exit status: {self.exit_status}")
        return out


def job_logs(req: Request) -> dict[str, str]:
    """The log patterns that apply to how `req` is submitted."""
    if req.via == "sbatch":
        return {"batch": req.logs["batch"], "node": req.logs["node"]}
    if req.via == LOCAL_VIA:
        return {"node": req.logs["node"]}
    return {"node": req.logs["submitit_node"], "node_err": req.logs["submitit_node_err"]}


def submit(req: Request) -> Submitted:
    """Submit `req` (its run directory must be prepared): the one place calling sbatch/submitit."""
    run_dir = Path(req.run_dir)
    script_path = Path(req.sbatch_argv[-1])
    script_path.write_text(req.script)
    if req.via == LOCAL_VIA:
        return run_local(req)
    if req.via == "sbatch":
        job_id = parse_sbatch_output(run_slurm(req.sbatch_argv))
    else:
        import submitit

        executor = submitit.SlurmExecutor(folder=req.logs["submitit_folder"],
                                          python=submitit_python(req.python))
        executor.update_parameters(**req.submitit_params)
        try:
            job = executor.submit(hpcrl.agent_entry, req.run_dir)
        except submitit.core.utils.FailedJobError as exc:
            raise SlurmError(sbatch_refusal(str(exc))) from None
        job_id = str(job.job_id)
    done = Submitted(job_id=job_id, run_dir=req.run_dir, via=req.via, logs=job_logs(req))
    rundir.write_submission(run_dir, dataclasses.asdict(done))
    return done


def sbatch_refusal(stderr: str) -> str:
    """One message for sbatch's refusal (its own words, and the usual fix)."""
    said = "; ".join(ln.strip() for ln in stderr.strip().splitlines() if ln.strip())[-600:]
    fix = ("Fix: run on the cluster's login node, or point `SLURM_CONF` at the cluster's "
           "slurm.conf" if "configuration" in said or "config" in said else
           "Fix: adjust the site profile's `slurm:` settings (partition, account, time) "
           "to what the cluster allows")
    return f"sbatch refused the job: {said}. {fix}"


def refuse_if_running(run_dir: Path) -> None:
    """Two runs of one job at once would write the same checkpoints: refuse the second."""
    info = runstate.running_restart(run_dir)
    if info is not None:
        raise RequestError(f"run {info.index} of `{run_dir}` is still running (agent pid "
                           f"{info.head_pid}); stop it first with `hpcrl cancel {run_dir}` or "
                           "Ctrl-C in its terminal, then `--resume`")


def refuse_if_queued(run_dir: Path) -> None:
    """One job per run directory: `--resume` is refused while the run's job (the one submitted
    last, or the one holding the run directory's lease) is still in Slurm's queue."""
    named = (rundir.submitted_job_id(run_dir), (rundir.read_lease(run_dir) or {}).get("job_id"))
    for job in dict.fromkeys(str(j) for j in named if j is not None):
        if not job.split("_")[0].isdigit():  # a local run: `refuse_if_running` on this machine
            continue
        try:
            entries = queue_entries(job)
        except SlurmUnavailable as exc:
            raise RequestError(f"`--resume`: cannot tell whether job {job} of `{run_dir}` still "
                               f"runs: {exc}") from None
        if entries:
            raise RequestError(
                f"`--resume`: job {job} of `{run_dir}` is still {entries[0].state} (`squeue`); "
                f"one job per run directory. Fix: wait until job {job} ends, or stop it with "
                f"`hpcrl cancel {job}`, then `--resume`")


def run_local(req: Request) -> Submitted:
    """Run the job script in the foreground on this machine (`scheduler: local`), following
    its progress (see :mod:`hpcrl.localrun`)."""
    refuse_if_running(Path(req.run_dir))
    hint = f"hpcrl submit --site {req.site} --run-dir {shlex.quote(req.run_dir)} --resume"
    rc = run_foreground(list(req.sbatch_argv), Path(req.run_dir), hint)
    job_id = str(rundir.read_submission(Path(req.run_dir))["job_id"])
    return Submitted(job_id=job_id, run_dir=req.run_dir, via=req.via, logs=job_logs(req),
                     exit_status=rc)


def default_python(profile: SiteProfile) -> str:
    """The Python running the node agent: the profile's, else this interpreter."""
    return profile.python or sys.executable
