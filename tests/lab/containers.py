"""Container runtimes of the lab, for real: Podman (Debian's) and Apptainer 1.4 (Debian sid's,
unpacked into its own prefix with a private newer glibc, never touching the system's apt sources
or libc), plus a test image made without a registry: a debootstrapped minimal Debian with python3,
imported into Podman and built into a SIF. Everything is cached under `CACHE_DIR`; a fresh
machine builds it (about 2 minutes)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from tests.lab.config import APPTAINER_PREFIX, CACHE_DIR, IMAGE, SIF

MIRROR = "http://deb.debian.org/debian"
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
CONF_MARKER = "# written by the hpcrl test lab"
PODMAN_CONF = f"""{CONF_MARKER}
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
ROOTFS = CACHE_DIR / "rootfs"
ROOTFS_TAR = CACHE_DIR / "rootfs.tar"
APPTAINER_BIN = APPTAINER_PREFIX / "bin" / "apptainer"

# Linux capability numbers -> names, for `apptainer capability add`
CAPABILITIES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
    "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
    "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
    "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE"
).split()


def _run(*argv: str | Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], check=True, text=True, capture_output=True,
                          stdin=subprocess.DEVNULL, **kw)  # fmt: skip


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[lab images] {msg}", flush=True)


# ---------------------------------------------------------------- podman


def ensure_podman_config() -> None:
    """Podman as root here needs runc, cgroupfs and explicit ulimits (root lacks CAP_SYS_RESOURCE).
    A containers.conf that is not ours is left alone and used via `CONTAINERS_CONF`."""
    if CONTAINERS_CONF.exists() and CONF_MARKER not in CONTAINERS_CONF.read_text():
        ours = CACHE_DIR / "containers.conf"
        ours.write_text(PODMAN_CONF)
        os.environ["CONTAINERS_CONF"] = str(ours)
        return
    if not CONTAINERS_CONF.exists() or CONTAINERS_CONF.read_text() != PODMAN_CONF:
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(PODMAN_CONF)


def podman_image_exists() -> bool:
    return subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True).returncode == 0


def ensure_podman_image(verbose: bool = False) -> None:
    ensure_podman_config()
    if podman_image_exists():
        return
    ensure_rootfs(verbose)
    _log(verbose, f"podman import {ROOTFS_TAR} {IMAGE}")
    _run("podman", "import", ROOTFS_TAR, IMAGE)


# ---------------------------------------------------------------- root filesystem


def ensure_rootfs(verbose: bool = False) -> None:
    if ROOTFS_TAR.exists() and (ROOTFS / "usr" / "bin" / "python3").exists():
        return
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_DIR / "rootfs.tmp"
    _umount_below(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    _log(verbose, "debootstrap --variant=minbase --include=python3 bookworm (about 80 s)")
    t0 = time.monotonic()
    try:
        _run("debootstrap", "--variant=minbase", "--include=python3", "bookworm", tmp, MIRROR)
    finally:
        _umount_below(tmp)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (tmp / junk).glob("*"):
            if f.is_file():
                f.unlink()
    shutil.rmtree(ROOTFS, ignore_errors=True)
    tmp.rename(ROOTFS)
    tar_tmp = ROOTFS_TAR.with_suffix(".tmp")
    with tarfile.open(tar_tmp, "w") as tar:
        tar.add(ROOTFS, arcname=".")
    tar_tmp.rename(ROOTFS_TAR)
    _log(verbose, f"root filesystem ready in {time.monotonic() - t0:.0f} s")


def _umount_below(path: Path) -> None:
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(path) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


# ---------------------------------------------------------------- apptainer


def _apt_download(suite: str, package: str, dest: Path) -> Path:
    """Download one .deb of `suite` with a private apt configuration (system sources untouched)."""
    state = CACHE_DIR / f"apt-{suite}"
    (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    sources = state / "sources.list"
    sources.write_text(f"deb {MIRROR} {suite} main\n")
    opts = [
        f"-oDir::Etc::sourcelist={sources}", "-oDir::Etc::sourceparts=/dev/null",
        f"-oDir::State::Lists={state / 'lists'}", f"-oDir::Cache={state / 'cache'}",
        "-oAPT::Get::List-Cleanup=0", "-qq",
    ]  # fmt: skip
    _run("apt-get", *opts, "update")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{package}_*.deb"):
        old.unlink()
    _run("apt-get", *opts, "download", package, cwd=dest)
    return next(dest.glob(f"{package}_*.deb"))


def held_capabilities() -> list[str]:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            mask = int(line.split()[1], 16)
            return [f"CAP_{name}" for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1]
    return []


def apptainer_env() -> dict[str, str]:
    """Apptainer keeps its cache and its per-user directory (`$HOME/.apptainer`, made by any
    command, `apptainer version` included) in the lab's cache, never in the user's home: the
    images are also built outside pytest's private HOME (`make test` starts them early)."""
    home = CACHE_DIR / "apptainer-home"
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "APPTAINER_CACHEDIR": str(CACHE_DIR / "apptainer-cache"), "HOME": str(home)}


def apptainer_works() -> bool:
    if not APPTAINER_BIN.exists():
        return False
    res = subprocess.run([APPTAINER_BIN, "version"], capture_output=True, text=True, env=apptainer_env())
    return res.returncode == 0 and res.stdout.startswith("1.4")


def ensure_apptainer(verbose: bool = False) -> None:
    if apptainer_works():
        return
    _log(verbose, "installing apptainer (Debian sid) with a private glibc (trixie)")
    debs = CACHE_DIR / "debs"
    app_deb = _apt_download("sid", "apptainer", debs)
    libc_deb = _apt_download("trixie", "libc6", debs)
    tmp = APPTAINER_PREFIX.with_name(APPTAINER_PREFIX.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    root, glibc = tmp / "root", tmp / "glibc"
    root.mkdir(parents=True)
    glibc.mkdir()
    _run("dpkg-deb", "-x", app_deb, root)
    _run("dpkg-deb", "-x", libc_deb, glibc)
    libdir = glibc / "usr" / "lib" / "x86_64-linux-gnu"
    final_libdir = APPTAINER_PREFIX / "glibc" / "usr" / "lib" / "x86_64-linux-gnu"
    rpath = f"{final_libdir}:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"
    interp = final_libdir / "ld-linux-x86-64.so.2"
    assert (libdir / "ld-linux-x86-64.so.2").exists(), f"no dynamic loader in {libc_deb}"
    for binary in ("usr/bin/apptainer", "usr/lib/x86_64-linux-gnu/apptainer/bin/starter"):
        _run("patchelf", "--set-interpreter", interp, "--force-rpath", "--set-rpath", rpath, root / binary)
    for link, target in (("usr/etc", "../etc"), ("usr/var", "../var"),
                         ("usr/lib/etc", "../../etc"), ("usr/lib/var", "../../var")):  # fmt: skip
        (root / link).unlink(missing_ok=True)
        (root / link).symlink_to(target)
    conf = root / "etc" / "apptainer" / "apptainer.conf"
    text = conf.read_text()
    text = _set_conf(text, "root default capabilities", "file")
    text = _set_conf(text, "systemd cgroups", "no")
    conf.write_text(text)
    (tmp / "bin").mkdir()
    wrapper = tmp / "bin" / "apptainer"
    wrapper.write_text(f'#!/bin/sh\nexec {APPTAINER_PREFIX}/root/usr/bin/apptainer "$@"\n')
    wrapper.chmod(0o755)
    shutil.rmtree(APPTAINER_PREFIX, ignore_errors=True)
    APPTAINER_PREFIX.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(APPTAINER_PREFIX)
    _run(APPTAINER_BIN, "capability", "add", "--user", "root", ",".join(held_capabilities()),
         env=apptainer_env())
    if not apptainer_works():
        raise RuntimeError(f"apptainer installed in {APPTAINER_PREFIX} but `apptainer version` fails")


def _set_conf(text: str, key: str, value: str) -> str:
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith(f"{key} =")]
    return "\n".join(lines + [f"{key} = {value}"]) + "\n"


def ensure_sif(verbose: bool = False) -> None:
    if SIF.exists():
        return
    ensure_rootfs(verbose)
    _log(verbose, f"apptainer build {SIF} (about 25 s)")
    tmp = SIF.with_suffix(".tmp.sif")
    tmp.unlink(missing_ok=True)
    _run(APPTAINER_BIN, "build", "--force", tmp, ROOTFS, env=apptainer_env())
    tmp.rename(SIF)


def ensure_images(verbose: bool = False) -> None:
    """Build whatever is missing of the Podman image, Apptainer and the SIF. One process builds at a
    time (a lock file in CACHE_DIR): a second pytest, or a second lab instance, waits for the first
    one's build and then finds everything ready."""
    t0 = time.monotonic()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_podman_image(verbose)
        ensure_apptainer(verbose)
        ensure_sif(verbose)
    _log(verbose, f"images ready in {time.monotonic() - t0:.1f} s")


def host_python_binds() -> list[str]:
    """Paths a container needs bound at the same place to run this Python environment: the
    venv (sys.prefix), the interpreter it was made from (sys.base_prefix) and the checkout."""
    import sys

    repo = Path(__file__).resolve().parents[2]
    paths = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), repo}
    return sorted(str(p) for p in paths)
