"""What a container runtime must say, and the command type every runtime returns.

A runtime module defines one :class:`Runtime` subclass and one instance `RUNTIME`; the table in
:mod:`hpcrl.runtimes` lists them. Shared checks (variable names, binds, the image being set)
happen once in :func:`hpcrl.containers.container_command` before a runtime is asked.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # profiles imports this package for its runtime choices
    from hpcrl.profiles import ContainerConfig


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


class Runtime:
    """One container runtime. Subclasses set the attributes and override what applies."""

    name: str = ""
    """The value of `container.runtime` that selects this runtime."""
    needs_image: bool = True
    """Whether `container.image` must be set (every runtime but `none`)."""
    relays_signals: bool = True
    """Whether a signal sent to the runtime's client process reaches the command inside."""
    image_help: str = ""
    """What `container.image` names for this runtime (shown in errors and docs)."""

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        """The command running `argv` in the container with the variables `values` (never in
        the argv: they go to the runtime's process environment), `binds` (`SRC[:DST[:OPTS]]`,
        already checked), working directory `workdir` and container name `name`."""
        raise NotImplementedError

    def pull(self, c: ContainerConfig, source: str | None) -> ContainerCommand:
        """The runtime's own command fetching the site's image (`source`: where from)."""
        raise ContainerError(f"runtime `{self.name}` has no image to pull")

    def build(self, c: ContainerConfig, recipe: str, context: str) -> ContainerCommand:
        """The runtime's own command building the site's image from `recipe`."""
        raise ContainerError(f"runtime `{self.name}` has no image to build")

    def remove(self, binary: str, name: str) -> list[str] | None:
        """The command (with executable `binary`) removing container `name` left running after
        its client was killed; None where a killed client leaves no container behind."""
        return None

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Whether the current process runs in one of this runtime's containers."""
        return False

    def image_problem(self, c: ContainerConfig, run: Callable[[Sequence[str]], int]) -> str | None:
        """Why this node cannot start `container.image` (missing, unreadable), or None when it
        can or cannot tell (an image the runtime would pull on first use). `run` runs a command
        and returns its exit status (the one side effect, replaced in tests)."""
        return None


def local_file_problem(image: str) -> str | None:
    """A file or directory image (`.sif`, `.sqsh`, a sandbox) that is missing or unreadable."""
    path = Path(image)
    if not path.exists():
        return f"the container image `{image}` does not exist on this node"
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        return f"the container image `{image}` is not readable here (permissions of {path})"
    return None

