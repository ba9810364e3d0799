"""Container runtimes, one module each, found in :data:`TABLE`.

Adding a runtime is one module defining a :class:`~hpcrl.runtimes.base.Runtime` subclass and
`RUNTIME`, one line in :data:`TABLE`, and its tests (see CONTRIBUTING.md). Everything else (the
profile's `container.runtime` choices, the agent's container clean-up and signal handling, the
trainer's report of where it runs) asks this table. Importing it imports no runtime client.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from hpcrl.runtimes import apptainer, docker, enroot, none, podman
from hpcrl.runtimes.base import ContainerCommand, ContainerError, Runtime

TABLE: dict[str, Runtime] = {
    none.RUNTIME.name: none.RUNTIME,
    podman.RUNTIME.name: podman.RUNTIME,
    docker.RUNTIME.name: docker.RUNTIME,
    apptainer.RUNTIME.name: apptainer.RUNTIME,
    enroot.RUNTIME.name: enroot.RUNTIME,
}
NAMES: tuple[str, ...] = tuple(TABLE)

__all__ = ["NAMES", "TABLE", "ContainerCommand", "ContainerError", "Runtime", "get",
           "running_in"]


def get(name: str) -> Runtime:
    """The runtime called `name`, or an error listing the valid names."""
    try:
        return TABLE[name]
    except KeyError:
        raise ContainerError(f"container runtime `{name}` is unknown; valid: "
                             f"{', '.join(NAMES)}") from None


def running_in(environ: Mapping[str, str] | None = None,
               exists: Callable[[str], bool] = os.path.exists) -> str:
    """The name of the runtime whose container runs this process; `none` on the host."""
    env = os.environ if environ is None else environ
    return next((n for n, r in TABLE.items() if r.running_in(env, exists)), "none")
