"""Runtime `apptainer`: the head of each command comes from spython's command builder.

Variables travel as ``APPTAINERENV_NAME=value`` in the client's environment (they arrive even
with ``--cleanenv``). Apptainer evaluates these values as if inside double quotes (``$(...)``,
backticks and ``$NAME`` would expand), so :func:`apptainer_env_value` escapes ``\\``, ``$`` and
backticks: the container sees each value exactly as given. ``HOME`` is the exception Apptainer
makes (it ignores ``APPTAINERENV_HOME``): it travels as ``--home PATH``, which also binds it. Apptainer shares the host's /dev,
network and /dev/shm, so the OCI-only settings do not apply; ``gpu`` and ``cleanenv`` do.

GPUs (``container.gpu``): ``nv`` is ``--nv`` (the host's driver libraries, which must match its
kernel module, bound in). ``rocm`` uses the image's own ROCm: Apptainer's ``--rocm`` binds the
host's ROCm libraries ahead of the image's (Apptainer's GPU docs: "Locate and bind the basic ROCm
libraries from the host", ``LD_LIBRARY_PATH`` set to them), which breaks PyTorch and vLLM when the
two ROCm versions differ; the kernel driver (amdgpu) is all the image needs from the host, so
only the devices are bound (``--bind /dev/kfd --bind /dev/dri``: present even under ``--contain``
or ``mount dev = minimal``). ``rocm-host`` is ``--rocm`` itself, for an image without ROCm.
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


def apptainer_env_value(value: str) -> str:
    """Escape `value` so that Apptainer's evaluation of `APPTAINERENV_*` gives it back verbatim."""
    return value.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")


def _head(c: ContainerConfig, command: str) -> list[str]:
    """spython's `[singularity|apptainer, COMMAND]`, with the profile's binary."""
    from spython.main import Client

    head = list(Client._init_command(command))
    head[0] = binary_of(c)
    return head


GPU_FLAGS: dict[str, list[str]] = {
    "none": [],
    "nv": ["--nv"],
    "rocm": ["--bind", "/dev/kfd", "--bind", "/dev/dri"],
    "rocm-host": ["--rocm"],
}
"""`container.gpu` -> Apptainer's flags (see the module's docstring)."""


class Apptainer(Runtime):
    name = "apptainer"
    image_help = "`.sif` path"

    def run(self, c: ContainerConfig, argv: Sequence[str], values: Mapping[str, str],
            binds: Sequence[str], workdir: str | None, name: str | None) -> ContainerCommand:
        flags: list[str] = []
        if c.cleanenv:
            flags.append("--cleanenv")
        flags += GPU_FLAGS[c.gpu]
        for b in binds:
            flags += ["--bind", b]
        if workdir:
            flags += ["--pwd", workdir]
        if "HOME" in values:  # Apptainer refuses APPTAINERENV_HOME; `--home` sets and binds it
            flags += ["--home", values["HOME"]]
        child = {f"APPTAINERENV_{k}": apptainer_env_value(v) for k, v in values.items() if k != "HOME"}
        return ContainerCommand(
            (*_head(c, "exec"), *flags, *c.extra_flags, str(c.image), *argv), child)

    def pull(self, c: ContainerConfig, source: str | None) -> ContainerCommand:
        """`pull SIF SOURCE`: a registry reference (`docker://...`, `oras://...`) or a docker
        archive (`docker-archive://file.tar`); the SIF is written to `container.image`."""
        if not source:
            raise ContainerError("apptainer pull needs a source: `--from docker://REF` or "
                                 "`--from docker-archive://FILE.tar`")
        return ContainerCommand((*_head(c, "pull"), str(c.image), source), {})

    def build(self, c: ContainerConfig, recipe: str, context: str) -> ContainerCommand:
        """`build SIF RECIPE` (a `.def` file, `docker-archive://FILE.tar` or `docker://REF`)."""
        args = [a for k, v in c.build_args.items() for a in ("--build-arg", f"{k}={v}")]
        return ContainerCommand((*_head(c, "build"), *args, str(c.image), recipe), {})

    def image_problem(self, c: ContainerConfig, run: Callable[[Sequence[str]], int]) -> str | None:
        """A `.sif` or sandbox path must be there and readable; a URI (`docker://...`,
        `oras://...`) is pulled by Apptainer itself."""
        return None if "://" in str(c.image) else local_file_problem(str(c.image))

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Apptainer sets `APPTAINER_CONTAINER` in every container."""
        return bool(environ.get("APPTAINER_CONTAINER"))


RUNTIME = Apptainer()
