"""Runtime `docker`: the OCI client CLI (see :mod:`hpcrl.runtimes.oci`)."""

from __future__ import annotations

from hpcrl.runtimes.oci import OciRuntime


class Docker(OciRuntime):
    """`running_in` stays False: Docker's marker `/.dockerenv` is also on machines that are
    themselves Docker containers (CI runners, the lab's host), where a job without a container
    would be reported as running in Docker."""

    name = "docker"


RUNTIME = Docker()
