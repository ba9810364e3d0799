"""Turn (container settings, command, environment, binds, workdir) into a runtime's argv.

One entry point, :func:`container_command`, for every runtime in :mod:`hpcrl.runtimes`: it
checks what all runtimes share (variable names, binds, the image) once, then asks the runtime
named by `container.runtime`. It returns a :class:`ContainerCommand`: the argv, and the
variables to add to the environment of the process that runs it. Values never appear in the
argv, so logging the argv leaks no secret (how each runtime passes them: see its module).

Run it as ``subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env})``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpcrl.profiles import ENV_NAME_RE, ContainerConfig
from hpcrl.runtimes import get
from hpcrl.runtimes.base import ContainerCommand, ContainerError

__all__ = ["ContainerCommand", "ContainerError", "build_command", "container_command",
           "pull_command"]


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

    runtime = get(c.runtime)
    if not argv:
        raise ContainerError("empty command: give the program to run in the container")
    environ = os.environ if environ is None else environ
    _check_env_names([*env, *passthrough])
    present = [n for n in passthrough if n in environ and n not in env]
    values = {**env, **{n: environ[n] for n in present}}
    if runtime.needs_image and not c.image:
        raise ContainerError(f"runtime `{c.runtime}` needs `container.image`; set it in the "
                             "site profile")
    all_binds = dedupe([_bind_parts(b) for b in (*c.binds, *binds)])
    return runtime.run(c, argv, values, all_binds, workdir or c.workdir, name)


def _with_image(c: ContainerConfig) -> None:
    runtime = get(c.runtime)
    if runtime.needs_image and not c.image:
        raise ContainerError("`container.image` is not set in the site profile")


def pull_command(c: ContainerConfig, source: str | None = None) -> ContainerCommand:
    """The runtime's own pull of the site's image (`source`: where from, where the runtime
    needs one)."""
    _with_image(c)
    return get(c.runtime).pull(c, source)


def build_command(c: ContainerConfig, recipe: str, context: str = ".") -> ContainerCommand:
    """The runtime's own build of the site's image from `recipe` with the profile's
    `build_args` (`context`: the build context, where the runtime has one)."""
    _with_image(c)
    return get(c.runtime).build(c, recipe, context)
