"""Runtime `none`: the command runs on the host as is, with its variables in its environment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hpcrl.runtimes.base import ContainerCommand, ContainerError, Runtime

if TYPE_CHECKING:
    from hpcrl.profiles import ContainerConfig


class NoContainer(Runtime):
    name = "none"
    needs_image = False
    relays_signals = False  # the payload is the process itself: the agent checks its handlers
    image_help = "nothing (no image)"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        return ContainerCommand(tuple(argv), dict(values))

    def pull(self, c: ContainerConfig, source: str | None) -> ContainerCommand:
        raise ContainerError("site has `container.runtime: none`; there is no image to pull")

    def build(self, c: ContainerConfig, recipe: str, context: str) -> ContainerCommand:
        raise ContainerError("site has `container.runtime: none`; there is no image to build")


RUNTIME = NoContainer()
