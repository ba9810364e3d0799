"""Turn (container settings, command, environment, binds, workdir) into a runtime's argv.

One entry point, :func:`container_command`, for every runtime: ``podman``, ``docker``,
``apptainer`` (the head of the command comes from spython's command builder) and ``none`` (the
command runs as is). It returns a :class:`ContainerCommand`: the argv, and the variables to add to
the environment of the process that runs it. Values never appear in the argv, so logging the argv
leaks no secret:

- podman/docker: ``-e NAME`` (the runtime reads the value from its own environment);
- apptainer: ``APPTAINERENV_NAME=value`` in the runtime's environment (arrives even with
  ``--cleanenv``). Apptainer evaluates these values as if inside double quotes (``$(...)``,
  backticks and ``$NAME`` would expand), so :func:`apptainer_env_value` escapes ``\\``, ``$``
  and backticks: the container sees the value exactly as given;
- none: the variables themselves.

Run it as ``subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env})``.

Per-runtime notes: apptainer shares the host's /dev, network and /dev/shm, so ``devices``,
``network_host``, ``pid_host``, ``shm_size``, ``cap_add``, ``security_opt``, ``group_add`` and ``privileged``
apply to podman/docker only; ``gpu`` (``--rocm``/``--nv``) and ``cleanenv`` apply to apptainer
only. ``extra_flags`` go, for every runtime, right before the image.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpcrl.profiles import ENV_NAME_RE, ContainerConfig

RUNTIMES = ("none", "podman", "docker", "apptainer")


class ContainerError(ValueError):
    """The container settings cannot produce a command."""


@dataclass(frozen=True)
class ContainerCommand:
    """A command ready to run: argv plus the variables to add to its process environment."""

    argv: tuple[str, ...] = field(metadata={"help": "program and arguments (no secret values)"})
    env: Mapping[str, str] = field(metadata={"help": "add to the runtime process environment"})

    def display(self) -> str:
        """The argv as one shell-quoted line (safe to log)."""
        return shlex.join(self.argv)


def binary_of(c: ContainerConfig) -> str:
    """The runtime executable (profile `container.binary`, else the runtime's name)."""
    return c.binary or c.runtime


def _check_env_names(names: Sequence[str]) -> None:
    for name in names:
        if not ENV_NAME_RE.match(name):
            raise ContainerError(f"environment variable name {name!r} is not valid (letters, "
                                 "digits, `_`, not starting with a digit)")


def _bind_parts(bind: str) -> str:
    if not bind or bind.startswith(":") or "\n" in bind:
        raise ContainerError(f"bind {bind!r} is not `SRC[:DST[:OPTS]]`; fix `container.binds`")
    return bind


def dedupe(items: Sequence[str]) -> list[str]:
    """Keep the first of equal items, in order."""
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


def _oci_argv(c: ContainerConfig, argv: Sequence[str], names: Sequence[str],
              binds: Sequence[str], workdir: str | None, name: str | None) -> list[str]:
    out = [binary_of(c), "run", "--rm"]
    if name:
        out += ["--name", name]
    if c.network_host:
        out.append("--network=host")
    if c.pid_host:
        out.append("--pid=host")
    if c.ipc_host:
        out.append("--ipc=host")
    if c.shm_size:
        out.append(f"--shm-size={c.shm_size}")
    if c.privileged:
        out.append("--privileged")
    out += [f"--device={d}" for d in c.devices]
    out += [f"--group-add={g}" for g in c.group_add]
    out += [f"--cap-add={cap}" for cap in c.cap_add]
    out += [f"--security-opt={s}" for s in c.security_opt]
    for b in binds:
        out += ["-v", b if ":" in b else f"{b}:{b}"]
    if workdir:
        out += ["-w", workdir]
    for n in names:
        out += ["-e", n]
    return [*out, *c.extra_flags, str(c.image), *argv]


def apptainer_env_value(value: str) -> str:
    """Escape `value` so that Apptainer's evaluation of `APPTAINERENV_*` gives it back verbatim."""
    return value.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")


def _apptainer_argv(c: ContainerConfig, argv: Sequence[str], binds: Sequence[str],
                    workdir: str | None) -> list[str]:
    from spython.main import Client  # spython's command builder: [singularity, flags.., exec]

    flags: list[str] = []
    if c.cleanenv:
        flags.append("--cleanenv")
    if c.gpu != "none":
        flags.append(f"--{c.gpu}")
    for b in binds:
        flags += ["--bind", b]
    if workdir:
        flags += ["--pwd", workdir]
    head = list(Client._init_command("exec"))
    head[0] = binary_of(c)
    return [*head, *flags, *c.extra_flags, str(c.image), *argv]


def container_command(c: ContainerConfig, argv: Sequence[str], env: Mapping[str, str], *,
                      passthrough: Sequence[str] = (), binds: Sequence[str] = (),
                      workdir: str | None = None, name: str | None = None,
                      environ: Mapping[str, str] | None = None) -> ContainerCommand:
    """Build the command running `argv` in the container described by `c`.

    `env` holds variables with their values (the profile's environment and per-node values);
    `passthrough` names variables whose values come from `environ` (the current process
    environment, e.g. secrets). `binds` are added to the profile's binds (duplicates dropped);
    `workdir` overrides the profile's `container.workdir`.
    """
    import os

    if c.runtime not in RUNTIMES:
        raise ContainerError(f"container runtime `{c.runtime}` is unknown; valid: "
                             f"{', '.join(RUNTIMES)}")
    if not argv:
        raise ContainerError("empty command: give the program to run in the container")
    environ = os.environ if environ is None else environ
    _check_env_names([*env, *passthrough])
    present = [n for n in passthrough if n in environ and n not in env]
    if c.runtime == "none":
        values = {**{n: environ[n] for n in present}, **env}
        return ContainerCommand(tuple(argv), values)
    if not c.image:
        raise ContainerError(f"runtime `{c.runtime}` needs `container.image`; set it in the "
                             "site profile")
    all_binds = dedupe([_bind_parts(b) for b in (*c.binds, *binds)])
    wd = workdir or c.workdir
    if c.runtime == "apptainer":
        values = {**{n: environ[n] for n in present}, **env}
        child = {f"APPTAINERENV_{k}": apptainer_env_value(v) for k, v in values.items()}
        return ContainerCommand(tuple(_apptainer_argv(c, argv, all_binds, wd)), child)
    names = [*env, *present]
    child = {**{n: environ[n] for n in present}, **env}
    return ContainerCommand(tuple(_oci_argv(c, argv, names, all_binds, wd, name)), child)


def pull_command(c: ContainerConfig, source: str | None = None) -> ContainerCommand:
    """The runtime's own pull: podman/docker `pull IMAGE`; apptainer `pull SIF SOURCE`.

    For apptainer, `source` is a registry reference (`docker://...`, `oras://...`) or a docker
    archive (`docker-archive://file.tar`); the SIF is written to `container.image`.
    """
    if c.runtime == "none":
        raise ContainerError("site has `container.runtime: none`; there is no image to pull")
    if not c.image:
        raise ContainerError("`container.image` is not set in the site profile")
    if c.runtime == "apptainer":
        if not source:
            raise ContainerError("apptainer pull needs a source: `--from docker://REF` or "
                                 "`--from docker-archive://FILE.tar`")
        from spython.main import Client

        head = list(Client._init_command("pull"))
        head[0] = binary_of(c)
        return ContainerCommand((*head, c.image, source), {})
    return ContainerCommand((binary_of(c), "pull", source or c.image), {})


def build_command(c: ContainerConfig, recipe: str, context: str = ".") -> ContainerCommand:
    """The runtime's own build with the profile's `build_args`: podman/docker
    `build -f RECIPE -t IMAGE CONTEXT`; apptainer `build SIF RECIPE` (RECIPE: a `.def` file,
    `docker-archive://FILE.tar` or `docker://REF`)."""
    if c.runtime == "none":
        raise ContainerError("site has `container.runtime: none`; there is no image to build")
    if not c.image:
        raise ContainerError("`container.image` is not set in the site profile")
    args: list[str] = []
    for k, v in c.build_args.items():
        args += ["--build-arg", f"{k}={v}"]
    if c.runtime == "apptainer":
        from spython.main import Client

        head = list(Client._init_command("build"))
        head[0] = binary_of(c)
        return ContainerCommand((*head, *args, c.image, recipe), {})
    return ContainerCommand((binary_of(c), "build", *args, "-f", recipe, "-t", c.image, context),
                            {})
