"""Runtime `enroot` (NVIDIA; the runtime behind Slurm's pyxis plugin).

`container.image` is what `enroot start` runs: a squashfs image (`FILE.sqsh`, started
directly on Linux >= 4.18 with fuse-overlayfs and squashfuse) or the name of a container made
beforehand with `enroot create --name NAME FILE.sqsh`. The commands follow enroot's CLI:

- run: `enroot start --rw [--env NAME]... [--mount SRC:DST]... IMAGE COMMAND...`; `--env NAME`
  without a value exports the client's own value, so values never appear in the argv. Enroot
  has no working-directory flag: the command runs through `sh -c 'cd "$1" && shift && exec "$@"'`;
- pull: `enroot import --output IMAGE.sqsh SOURCE` (`docker://[REGISTRY#]IMAGE[:TAG]`);
- build: `enroot create --name NAME RECIPE.sqsh` unpacks a squashfs image into container NAME.

Mounts are fstab lines with colons (`SRC:DST[:TYPE:OPTIONS]`): a bind `SRC:DST:OPTS` becomes
`SRC:DST:none:x-create=dir,bind,OPTS`. GPUs come through enroot's hooks
(`NVIDIA_VISIBLE_DEVICES`), not flags, so the OCI and apptainer GPU settings do not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from hpcrl.runtimes.base import (
    ContainerCommand,
    ContainerError,
    Runtime,
    binary_of,
    local_file_problem,
)

if TYPE_CHECKING:
    from hpcrl.profiles import ContainerConfig

CHDIR = 'cd "$1" && shift && exec "$@"'
"""Runs `"$@"` in directory `$1`: enroot's stand-in for a working-directory flag."""


def mount_of(bind: str) -> str:
    """A bind `SRC[:DST[:OPTS]]` as an enroot `--mount` value."""
    src, _, rest = bind.partition(":")
    dst, _, opts = rest.partition(":")
    if not opts:
        return f"{src}:{dst or src}"
    return f"{src}:{dst}:none:x-create=dir,bind,{opts}"


class Enroot(Runtime):
    name = "enroot"
    image_help = "`.sqsh` path or `enroot create` container name"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        out = [binary_of(c), "start", "--rw"]
        for n in values:
            out += ["--env", n]
        for b in binds:
            out += ["--mount", mount_of(b)]
        inner = ["sh", "-c", CHDIR, "sh", workdir, *argv] if workdir else list(argv)
        return ContainerCommand((*out, *c.extra_flags, str(c.image), *inner), dict(values))

    def image_problem(self, c: ContainerConfig, run: Callable[[Sequence[str]], int]) -> str | None:
        """A `.sqsh` path must be there and readable (a container name is enroot's to find)."""
        return local_file_problem(str(c.image)) if str(c.image).endswith(".sqsh") else None

    def pull(self, c: ContainerConfig, source: str | None) -> ContainerCommand:
        image = str(c.image)
        if not source or not image.endswith(".sqsh"):
            raise ContainerError(
                f"enroot pull writes `container.image` ({image!r}) from `--from SOURCE`: give "
                "a source (`--from docker://REGISTRY#IMAGE:TAG`) and an image path ending in "
                "`.sqsh`")
        return ContainerCommand((binary_of(c), "import", "--output", image, source), {})

    def build(self, c: ContainerConfig, recipe: str, context: str) -> ContainerCommand:
        if not recipe.endswith(".sqsh") or c.build_args:
            raise ContainerError(
                f"enroot builds container `{c.image}` by unpacking a squashfs image (`enroot "
                f"create`); received recipe `{recipe}` and build_args "
                f"{dict(c.build_args)}: give `--recipe FILE.sqsh` and no `build_args` (build "
                "other recipes with podman/docker, then `enroot import`)")
        return ContainerCommand((binary_of(c), "create", "--name", str(c.image), recipe), {})


RUNTIME = Enroot()
