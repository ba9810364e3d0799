"""Runtime `docker`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hpcrl.runtimes.oci import OciRuntime


class Docker(OciRuntime):
    name = "docker"

    def running_in(self, environ: Mapping[str, str], exists: Callable[[str], bool]) -> bool:
        """Docker writes `/.dockerenv` into every container."""
        return exists("/.dockerenv")


RUNTIME = Docker()
