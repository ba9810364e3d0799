"""Runtime `podman`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hpcrl.runtimes.oci import OciRuntime


class Podman(OciRuntime):
    name = "podman"

    def remove(self, binary: str, name: str) -> list[str] | None:
        """At once (`-t 0`): Ray's processes in it block SIGTERM (the agent's `ray_launch.py`),
        so podman's default stop (SIGTERM, SIGKILL 10 s later) would only wait."""
        return [binary, "rm", "-f", "-t", "0", "--ignore", name]

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Podman writes `/run/.containerenv` into every container."""
        return exists("/run/.containerenv")


RUNTIME = Podman()
