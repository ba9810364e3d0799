"""Runtime `podman`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`).

Rootless Podman (the usual case on HPC sites) runs the container in a user namespace: a
`--group-add video` there adds the *container's* `video` group, not the host's, and the host's
`/dev/kfd` and `/dev/dri/renderD*` (`root:render` or `root:video`, mode 0660) cannot be opened.
Its documented value `--group-add keep-groups` keeps the user's own supplementary groups (the
host's `render`/`video` membership) instead; it excludes every other group and needs the crun
OCI runtime (podman's `--group-add` docs). Rootless is Podman's own rule
(`pkg/rootless.IsRootless`): the client runs with an effective uid other than 0, or inside a user
namespace Podman configured (`_CONTAINERS_USERNS_CONFIGURED`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from hpcrl.runtimes.base import ContainerCommand
from hpcrl.runtimes.oci import OciRuntime

if TYPE_CHECKING:
    from hpcrl.profiles import ContainerConfig

KEEP_GROUPS = "keep-groups"


def rootless() -> bool:
    """Whether Podman run by this process runs rootless (the seam tests replace)."""
    return os.geteuid() != 0 or bool(os.environ.get("_CONTAINERS_USERNS_CONFIGURED"))


def groups_for(group_add: Sequence[str], is_rootless: bool) -> tuple[str, ...]:
    """The `--group-add` values Podman gets: the profile's groups when rootful; rootless, a
    profile asking for groups (the devices' owners) gets `keep-groups` alone."""
    if is_rootless and group_add:
        return (KEEP_GROUPS,)
    return tuple(group_add)


class Podman(OciRuntime):
    name = "podman"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        c = dataclasses.replace(c, group_add=groups_for(c.group_add, rootless()))
        return super().run(c, argv, values, binds, workdir, name)

    def remove(self, binary: str, name: str) -> list[str] | None:
        """At once (`-t 0`): Ray's processes in it block SIGTERM (the agent's `ray_launch.py`),
        so podman's default stop (SIGTERM, SIGKILL 10 s later) would only wait."""
        return [binary, "rm", "-f", "-t", "0", "--ignore", name]

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Podman writes `/run/.containerenv` into every container."""
        return exists("/run/.containerenv")


RUNTIME = Podman()
