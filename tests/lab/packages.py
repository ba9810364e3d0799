"""Debian packages the lab needs, installed when missing (as root, non-interactively)."""

from __future__ import annotations

import os
import shutil
import subprocess

PACKAGES = (
    "slurm-wlm", "munge", "podman", "runc", "catatonit", "debootstrap", "patchelf",
    "iproute2", "squashfs-tools", "uidmap", "util-linux", "procps", "fuse2fs",
)  # fmt: skip


def missing_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    res = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *packages],
        capture_output=True, text=True,
    )  # fmt: skip
    installed = {line.split()[0] for line in res.stdout.splitlines() if line.endswith(" installed")}
    return [p for p in packages if p not in installed]


def ensure_packages(verbose: bool = False) -> None:
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(
            f"the lab needs Debian packages {', '.join(missing)}; install them as root: "
            f"`apt-get install -y --no-install-recommends {' '.join(missing)}`"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    quiet = [] if verbose else ["-qq"]
    subprocess.run(["apt-get", *quiet, "update"], check=True, env=env, stdin=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", *quiet, "install", "-y", "--no-install-recommends", *missing],
        check=True, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
