"""Runtime `docker`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`).

Docker's daemon runs containers as root unless told otherwise (rootful Docker is the common
install on clusters that have it), and with the host's PID namespace (`container.pid_host`,
which Ray needs) a root process there could signal or trace anything on the node. So every
container runs as the submitting user (`--user=UID:GID` of the node agent, the job's user):
files in the run directory and checkpoints are theirs, and the processes hold no more rights
than the user's own. Podman needs no flag: rootless Podman runs as the user already.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hpcrl.runtimes.base import ContainerCommand
from hpcrl.runtimes.oci import OciRuntime

if TYPE_CHECKING:
    from hpcrl.profiles import ContainerConfig


def user_flag() -> str:
    """`--user=UID:GID` of this process (the job's user on the node)."""
    return f"--user={os.getuid()}:{os.getgid()}"


class Docker(OciRuntime):
    """`running_in` stays False: Docker's marker `/.dockerenv` is also on machines that are
    themselves Docker containers (CI runners, the lab's host), where a job without a container
    would be reported as running in Docker."""

    name = "docker"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        cmd = super().run(c, argv, values, binds, workdir, name)
        head, rest = cmd.argv[:3], cmd.argv[3:]  # `docker run --rm`
        return ContainerCommand((*head, user_flag(), *rest), cmd.env)


RUNTIME = Docker()
