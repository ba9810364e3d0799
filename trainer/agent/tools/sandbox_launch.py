"""The sandbox's launcher: a program of the standard library alone, run as
`python -I -c <this file's source> SPEC` in the run's working directory (which holds `main.py`).
It never runs in the trainer's process; :mod:`trainer.agent.tools.sandbox` starts it.

Mode `strict` (the default), built with only what an ordinary user may do:

1. As root, drop to the tool's `user` first (`nobody`): the sandbox is always built by an
   unprivileged user, so root and ordinary trainers take one path.
2. `unshare` new user, mount, pid, IPC, UTS, cgroup and (unless the network is allowed) network
   namespaces. The user namespace maps only the launcher's own uid and gid to themselves: the
   code has no other identity to become, and files owned by anyone else stay theirs.
   `max_user_namespaces` is set to 0 inside it: the code cannot create nested namespaces.
3. Fork: the child is pid 1 of the new pid namespace. It builds a new root on a small tmpfs:
   read-only binds of the system directories (`/usr`, `/bin`, `/lib*`, `/sbin`) and of the
   interpreter's own prefix and import path, a synthesised `/etc` (a `passwd` and `group` naming
   only root, the code's user and nobody; the dynamic linker's cache, time zone and certificates
   bound read-only), a `/dev` of `null`, `zero`, `full`, `random`, `urandom`, a fresh `/proc` of
   the new pid namespace, and one scratch tmpfs of `tmp_bytes` that holds `/tmp`, `/var/tmp`,
   `/dev/shm` and the working directory together. `pivot_root` into it and detach the old root:
   the job's home, run directory, checkpoints, virtualenv (but for the interpreter's paths,
   read-only), sockets (Ray's, vLLM's, munge's) and other jobs' files are not there to reach.
   The root is then remounted read-only; loopback is brought up inside the empty network
   namespace.
4. pid 1 forks the code's process, which drops every capability (effective, permitted,
   inheritable, ambient and the bounding set), sets `no_new_privs`, applies the rlimits, empties
   its environment and runs the code. Without capabilities it cannot mount, unmount or remount
   anything, nor raise `max_user_namespaces` back.
5. pid 1 stays, holding only CAP_SYS_PTRACE (to read the memory of the code's processes, also
   of one that made itself undumpable) and undumpable itself (the code cannot attach to it or
   read its memory; in a pid namespace, its own processes cannot kill it either). It reaps
   orphans and, every 20 ms, sums the memory the whole call holds: proportional set size of
   every process, memfd files and System V shared memory. Past the call's `memory_bytes` it
   kills every process of the namespace and says so on the status pipe. When the code's process
   ends, pid 1 exits with its status and the kernel ends whatever the code left running.

Mode `rlimits` (a site opts into it by name, where the node grants no unprivileged user
namespaces): no namespaces; as root the code runs as `user`; rlimits per process.

Setup failures and pid 1's findings are written as JSON lines to the status pipe (`status_fd`);
the launcher exits 125 when the sandbox could not be built.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys
import traceback

spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
STATUS = spec["status_fd"]

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
ST_TO_MS = ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
            (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
            (os.ST_RELATIME, MS_RELATIME))
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAP_SYS_PTRACE = 19
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "riscv64": 41}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "riscv64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FROM_HOST = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "ssl",
                 "ca-certificates", "ca-certificates.conf", "alternatives", "mime.types",
                 "protocols", "services", "python3", "python3.9", "python3.10", "python3.11",
                 "python3.12", "python3.13", "python3.14")
DEVICES = ("null", "zero", "full", "random", "urandom")


class SetupError(Exception):
    pass


def report(**record):
    try:
        os.write(STATUS, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def prctl(option, arg, what):
    check(libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)), what)


def mount(source, target, fstype, flags, data, what=None):
    def enc(s):
        return (None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          what or f"mount {fstype or source} on {target}")


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def limit(res, soft, hard):  # never above the hard limit the node already set
    now = resource.getrlimit(res)[1]
    if now != resource.RLIM_INFINITY:
        soft, hard = min(soft, now), min(hard, now)
    resource.setrlimit(res, (soft, hard))


def user_tasks(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == uid:
                    n += len(os.listdir("/proc/" + pid + "/task"))
            except OSError:
                pass
    return n


def drop_capabilities(keep=0):
    """Every capability but `keep` (a mask) gone from every set; `no_new_privs` on."""
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
    for cap in range(spec["cap_last_cap"] + 1):
        if not keep >> cap & 1:
            prctl(PR_CAPBSET_DROP, cap, f"prctl(PR_CAPBSET_DROP, {cap})")
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    low, high = keep & 0xFFFFFFFF, keep >> 32
    data = (ctypes.c_uint32 * 6)(low, low, 0, high, high, 0)  # effective, permitted, inheritable
    check(libc.capset(header, data), "capset")


# -- the new root --------------------------------------------------------------------------------

def mounts_under(path):
    """Mount points at or below `path` (relative to the working directory, as every path of the
    new root is: the drop user may not traverse the directories above it), as
    /proc/self/mountinfo lists them, shallowest first, relative again."""
    here = os.getcwd()
    path = os.path.join(here, path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                point = point.replace(esc, ch)
            if point == path or point.startswith(path.rstrip("/") + "/"):
                found.append(os.path.relpath(point, here))
    return sorted(set(found), key=len)


def remount_readonly(point):
    """Read-only, keeping the flags the source mount holds (a user namespace may not clear them)."""
    have = os.statvfs(point).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    for st, ms in ST_TO_MS:
        if have & st:
            flags |= ms
    mount(None, point, None, flags, None, f"remount {point} read-only")


def bind(source, target, readonly=True):
    mount(source, target, None, MS_BIND | MS_REC, None, f"bind {source} on {target}")
    if readonly:
        for point in mounts_under(target):
            remount_readonly(point)


def make_like(source, target):
    """An empty file or directory at `target` to bind `source` on, or the same symlink."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return False
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    return True


def inside(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def build_root(uid, gid):
    """The new root, built at `stage` in the working directory, every path relative to it (a
    trainer's temporary directory may sit below directories its drop user cannot traverse)."""
    root = "stage"
    os.mkdir(root, 0o700)
    mount(None, "/", None, MS_REC | MS_PRIVATE, None, "make the mounts private")
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    scratch = root + "/.scratch"
    os.mkdir(scratch)
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_bytes']},mode=0755")
    for name, mode in (("tmp", 0o1777), ("var-tmp", 0o1777), ("shm", 0o1777), ("work", 0o700)):
        os.mkdir(scratch + "/" + name)
        os.chmod(scratch + "/" + name, mode)
    bound = []
    for d in SYSTEM_DIRS:
        if os.path.lexists(d) and make_like(d, root + d):
            bind(d, root + d)
            bound.append(d)
    for target, name in (("/tmp", "tmp"), ("/var/tmp", "var-tmp"), ("/dev/shm", "shm")):
        os.makedirs(root + target, exist_ok=True)
        bind(scratch + "/" + name, root + target, readonly=False)
    for d in DEVICES:
        if os.path.exists("/dev/" + d):
            make_like("/dev/" + d, root + "/dev/" + d)
            bind("/dev/" + d, root + "/dev/" + d, readonly=False)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(to, root + "/dev/" + name)
    os.makedirs(root + "/etc")
    for name in ETC_FROM_HOST:
        src = "/etc/" + name
        if os.path.lexists(src) and make_like(src, root + src):
            bind(src, root + src)
    users = ["root:x:0:0:root:/root:/bin/sh", "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"]
    groups = ["root:x:0:", "nogroup:x:65534:"]
    if uid not in (0, 65534):
        users.insert(1, f"sandbox:x:{uid}:{gid}::{spec['workdir']}:/bin/sh")
    if gid not in (0, 65534):
        groups.insert(1, f"sandbox:x:{gid}:")
    write(root + "/etc/passwd", "\n".join(users) + "\n")
    write(root + "/etc/group", "\n".join(groups) + "\n")
    write(root + "/etc/hosts", "127.0.0.1 localhost sandbox\n::1 localhost sandbox\n")
    write(root + "/etc/hostname", "sandbox\n")
    write(root + "/etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    for path in spec["ro_paths"]:  # the interpreter's prefix and import path
        real = os.path.realpath(path)
        if os.path.exists(real) and not inside(real, bound):
            make_like(real, root + real)
            bind(real, root + real)
            bound.append(real)
    work = root + spec["workdir"]
    os.makedirs(work, exist_ok=True)
    bind(scratch + "/work", work, readonly=False)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None,
          "mount a /proc of the sandbox's pid namespace")
    check(libc.umount2((scratch).encode(), MNT_DETACH), "detach the scratch tmpfs's staging mount")
    os.rmdir(scratch)
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {platform.machine()}")
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the node's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None,
          "remount the new root read-only")


def loopback_up():
    import fcntl
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP


# -- pid 1: the whole call's memory --------------------------------------------------------------

def held_bytes():
    """Proportional set size of every process but pid 1, plus memfd files and System V shared
    memory of the namespace (neither is counted in a process's set once unmapped)."""
    total, files = 0, set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == "1":
            continue
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) << 10
                        break
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("/memfd:"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    files.add((st.st_dev, st.st_ino, st.st_blocks * 512))
        except OSError:
            continue
    total += sum(size for _, _, size in files)
    try:
        with open("/proc/sysvipc/shm") as f:
            next(f)
            total += sum(int(line.split()[14]) for line in f)
    except (OSError, IndexError, ValueError, StopIteration):
        pass
    return total


def watch(code_pid):
    """Reap, and kill the namespace past the call's memory; the code's exit status."""
    peak, status = 0, None
    while status is None:
        signal.sigtimedwait([signal.SIGCHLD], 0.02)
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == code_pid:
                status = st
        if status is not None:
            break
        used = held_bytes()
        peak = max(peak, used)
        if used > spec["memory_bytes"]:
            os.kill(-1, signal.SIGKILL)
            report(killed="memory", held_bytes=used, limit_bytes=spec["memory_bytes"])
            os._exit(128 + signal.SIGKILL)
    report(peak_bytes=peak)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


# -- the code's process --------------------------------------------------------------------------

def nproc_bound(userns):
    """RLIMIT_NPROC for the code: in a user namespace on Linux >= 5.14 it counts that namespace's
    tasks of the user alone (the launcher, pid 1 and the code's); elsewhere every task of the
    user on the node, so the bound is those running now plus `max_processes`."""
    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if userns and release >= (5, 14):
        return 2 + spec["max_processes"]
    return user_tasks(os.getuid()) + spec["max_processes"]


def run_code(source, strict, nproc):
    os.close(STATUS)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name, (soft, hard) in spec["rlimits"].items():
        limit(getattr(resource, "RLIMIT_" + name), soft, hard)
    limit(resource.RLIMIT_NPROC, nproc, nproc)
    if strict:
        drop_capabilities()
        prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")
        os.chdir(spec["workdir"])
    os.umask(0o077)
    os.environ.clear()
    sys.argv = ["main.py"]
    sys.stdout.reconfigure(line_buffering=True)
    code_globals = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), code_globals)
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


def new_session_keyring():
    """A new, empty session keyring: the trainer's (Kerberos or AFS tickets on many clusters)
    stays out of the code's reach."""
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise SetupError(f"keyctl: unknown system call number on {platform.machine()}")
    if libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        if err != 38:  # ENOSYS: a kernel without keys has no keyring to leave
            raise SetupError(f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)} (errno {err})")


def drop_user():
    if spec["uid"] is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
        # a change of user leaves the process undumpable, its /proc files root's: own them again
        prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")


def strict():
    drop_user()
    new_session_keyring()
    uid, gid = os.getuid(), os.getgid()
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    nproc = nproc_bound(userns=True)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if not spec["allow_network"]:
        flags |= CLONE_NEWNET
    check(libc.unshare(flags), "unshare(user, mount, pid, ipc, uts, cgroup%s namespaces)"
          % ("" if spec["allow_network"] else ", network"))
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{uid} {uid} 1")
    write("/proc/self/gid_map", f"{gid} {gid} 1")
    try:
        write("/proc/sys/user/max_user_namespaces", "0")
        nested_blocked = True
    except OSError:  # a container runtime's read-only /proc/sys: through the sandbox's own /proc
        nested_blocked = False
    prctl(PR_SET_DUMPABLE, 0, "prctl(PR_SET_DUMPABLE)")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    init = os.fork()
    if init:  # outside the pid namespace: wait for its pid 1 and pass its status on
        code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
        os._exit(code if code >= 0 else 128 - code)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pid 1 gets no signal it has not asked for
    build_root(uid, gid)
    if not nested_blocked:
        write("/proc/sys/user/max_user_namespaces", "0")
    libc.sethostname(b"sandbox", 7)
    if not spec["allow_network"]:
        loopback_up()
    code_pid = os.fork()
    if code_pid == 0:
        run_code(source, strict=True, nproc=nproc)
        sys.exit(0)
    drop_capabilities(keep=1 << CAP_SYS_PTRACE)
    watch(code_pid)


def rlimits_only():
    drop_user()
    new_session_keyring()
    nproc = nproc_bound(userns=False)  # the launcher, counted there, waits beside the code
    pid = os.fork()
    if pid:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os._exit(code if code >= 0 else 128 - code)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    run_code(source, strict=False, nproc=nproc)


if spec["mode"] == "strict":
    try:
        strict()
    except (SetupError, OSError) as e:
        report(setup_error=str(e))
        os._exit(125)
else:
    try:
        rlimits_only()
    except SetupError as e:
        report(setup_error=str(e))
        os._exit(125)
