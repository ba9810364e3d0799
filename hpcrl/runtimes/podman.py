"""Runtime `podman`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hpcrl.runtimes.oci import OciRuntime


class Podman(OciRuntime):
    name = "podman"

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Podman writes `/run/.containerenv` into every container."""
        return exists("/run/.containerenv")


RUNTIME = Podman()
