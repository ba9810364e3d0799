"""The sandbox of the `python` tool against hostile code, with the trainer as root and as an
ordinary user (as nearly every Slurm job runs), in mode `strict` (the default) and, where a
site names it, `rlimits`. Each case ends within its bounds, the trainer's process, environment
and files stay untouched, and nothing of a run is left behind. No case skips under CI=true."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.trainer.agent.sandbox_support import (
    ORDINARY_UID,
    ROOT,
    Trainer,
    make_trainer,
    needs,
    processes_mentioning,
    small_limits,
    wait_until,
)
from trainer.agent.tools import sandbox
from trainer.agent.tools.sandbox import SandboxError, SandboxResult, probe, run_python

KINDS = ("root", "ordinary")


@pytest.fixture(params=[f"{k}-{m}" for m in ("strict", "rlimits") for k in KINDS])
def sb(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Trainer]:
    """Each kind of trainer, in each mode."""
    kind, mode = str(request.param).split("-")
    with make_trainer(kind, tmp_path, mode) as trainer:
        yield trainer


@pytest.fixture(params=KINDS)
def strict(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Trainer]:
    """Each kind of trainer, in mode `strict`: the hostile cases it must contain."""
    with make_trainer(str(request.param), tmp_path) as trainer:
        yield trainer


def run(code: str, tmp_path: Path, **limits: object) -> SandboxResult:
    return asyncio.run(run_python(code, small_limits(tmp_path, **limits)))


def out(res: SandboxResult) -> str:
    return res.stdout.decode()


# -- what every mode gives -----------------------------------------------------------------------

def test_plain_code_runs_in_a_private_directory_that_is_removed(sb: Trainer) -> None:
    res = sb.run("import os\nprint('hi', os.getcwd())\nopen('left.txt', 'w').write('x')")
    assert res.returncode == 0 and not res.timed_out, res
    word, cwd = out(res).split()
    assert word == "hi" and cwd == res.workdir and Path(cwd).parent == sb.work
    assert not Path(res.workdir).exists()
    assert list(sb.work.iterdir()) == []


def test_a_strict_umask_of_the_trainer_does_not_lock_the_code_out(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        res = run("print('read')", tmp_path)
    finally:
        os.umask(old)
    assert out(res) == "read\n", res


def test_the_environment_is_empty(sb: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_TEST_SECRET", "s3cret")
    res = sb.run("import os, json\nprint(json.dumps(dict(os.environ)))\n"
                 "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
                 "'import os; print(sorted(k for k in os.environ if k != \"LC_CTYPE\"))'])")
    assert res.returncode == 0, res
    first, second = out(res).splitlines()
    assert json.loads(first) == {}
    assert second == "[]"  # a child of the code inherits nothing either (bar its own locale)


def test_limits_stay_under_the_hard_limits_the_node_set(tmp_path: Path) -> None:
    # a trainer under a hard RLIMIT_NOFILE of 200 (set in a child process of the test) asks for 500
    limits = small_limits(tmp_path, max_open_files=500)
    script = (
        "import asyncio, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))\n"
        "from trainer.agent.tools.sandbox import SandboxLimits, run_python\n"
        f"limits = SandboxLimits(**{dataclasses.asdict(limits)!r})\n"
        "code = 'import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))'\n"
        "res = asyncio.run(run_python(code, limits))\n"
        "sys.stdout.write(res.stdout.decode() + res.stderr.decode())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout == "200 200\n", proc.stdout + proc.stderr


def test_stdin_is_closed(tmp_path: Path) -> None:
    res = run("import sys\nprint(repr(sys.stdin.read()))", tmp_path)
    assert out(res) == "''\n"


def test_an_infinite_loop_ends_at_the_timeout(sb: Trainer) -> None:
    res = sb.run("while True:\n    pass", timeout=1.0)
    assert res.timed_out and res.signal == signal.SIGKILL, res
    assert res.wall_s < 10


def test_cpu_time_is_limited(tmp_path: Path) -> None:
    res = run("while True:\n    pass", tmp_path, cpu_time=1, timeout=30)
    assert not res.timed_out
    assert res.signal in (signal.SIGXCPU, signal.SIGKILL), res
    assert res.wall_s < 15


def test_a_memory_bomb_gets_memory_error(tmp_path: Path) -> None:
    res = run("a = []\nwhile True:\n    a.append(bytearray(10 << 20))", tmp_path, memory_limit_mb=200)
    assert res.returncode == 1 and b"MemoryError" in res.stderr, res
    assert b'File "main.py", line 3' in res.stderr  # the traceback is the code's, not the launcher's


def test_a_huge_file_is_cut_at_the_file_size_limit(tmp_path: Path) -> None:
    res = run("f = open('big', 'wb')\nf.write(b'x' * (4 << 20))", tmp_path, max_file_bytes=1 << 20)
    assert res.returncode == 1 and b"File too large" in res.stderr, res


def test_open_files_are_limited(tmp_path: Path) -> None:
    res = run("fs = []\ntry:\n    while True:\n        fs.append(open('f', 'w'))\n"
              "except OSError as e:\n    print(len(fs), e.errno)", tmp_path, max_open_files=16)
    count, errno = out(res).split()
    assert int(count) < 16 and int(errno) == 24, res  # EMFILE


def test_huge_stdout_is_capped_and_stops_the_process(sb: Trainer) -> None:
    res = sb.run("while True:\n    print('x' * 1000)", max_output_bytes=10_000, timeout=60)
    assert res.output_truncated and not res.timed_out, res
    assert len(res.stdout) == 10_000
    assert res.wall_s < 30


def test_stderr_is_capped_too(tmp_path: Path) -> None:
    res = run("import sys\nsys.stderr.write('e' * 50_000)\nsys.stderr.flush()", tmp_path,
              max_output_bytes=1000)
    assert res.output_truncated and res.stderr == b"e" * 1000


FORK_BOMB = """\
import os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    n += 1
print('forked', n, flush=True)
"""


def test_a_fork_bomb_is_bounded_and_leaves_nothing(sb: Trainer) -> None:
    res = sb.run(FORK_BOMB, max_processes=8)
    assert res.returncode == 0 and not res.timed_out, res
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"
    forked = int(out(res).split()[1])
    assert forked < 8, forked  # the code never runs as root, which RLIMIT_NPROC would not bind


def test_a_resilient_fork_bomb_ends_at_the_timeout(sb: Trainer) -> None:
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    res = sb.run(code, max_processes=8, timeout=2.0)
    assert res.timed_out, res
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"


def test_a_daemon_that_leaves_the_session_is_killed(sb: Trainer) -> None:
    # in a pid namespace the kernel ends it; without one, it is found by its command line
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(600)\n    os._exit(0)\nprint('parent done')")
    res = sb.run(code)
    assert out(res) == "parent done\n"
    assert res.wall_s < 10  # the daemon holds stdout open: the run still ends when its code does
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"


def test_killing_its_parent_does_not_reach_the_trainer(sb: Trainer) -> None:
    res = sb.run("import os, signal\nprint(os.getppid(), flush=True)\n"
                 "os.kill(os.getppid(), signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGTERM)")
    assert int(out(res).split()[0]) != os.getpid()
    assert res.returncode is not None
    # this process is alive to read the result: the code's parent is the sandbox's launcher


def test_the_trainers_keyrings_are_out_of_reach(sb: Trainer) -> None:
    """A key in the trainer's session keyring (Kerberos or AFS tickets on many clusters): the
    code finds it neither in its session keyring nor its user keyring (ENOKEY)."""
    code = ("import ctypes, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "request_key = {'x86_64': 249, 'aarch64': 218}[platform.machine()]\n"
            "for ring in (0, -3, -4):\n"
            "    print(libc.syscall(request_key, b'user', b'hpcrl-test-secret', None, ctypes.c_long(ring)),"
            " ctypes.get_errno())")
    res = sb.run(code, session_key=True)
    assert out(res) == "-1 126\n" * 3, out(res) + res.stderr.decode()


def test_a_directory_the_code_locked_is_still_removed(sb: Trainer) -> None:
    res = sb.run("import os\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.chmod('d', 0)\n"
                 "os.chmod('.', 0o500)")
    assert res.returncode == 0, res
    assert not Path(res.workdir).exists()


def test_runs_do_not_block_the_event_loop(tmp_path: Path) -> None:
    limits = small_limits(tmp_path, timeout=30)

    async def go() -> int:
        task = asyncio.create_task(run_python("import time\ntime.sleep(1)", limits))
        ticks = 0
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        assert (await task).returncode == 0
        return ticks

    assert asyncio.run(go()) > 10


def test_removal_never_follows_a_link_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    outside.chmod(0o755)
    work = tmp_path / "run"
    (work / "locked" / "deep").mkdir(parents=True)
    (work / "link").symlink_to(outside)
    (work / "locked").chmod(0)
    sandbox._remove(str(work))
    assert not work.exists()
    assert (outside / "keep").is_dir() and outside.stat().st_mode & 0o777 == 0o755


# -- what `strict` contains, the trainer root or an ordinary user --------------------------------

STATUS = """\
import os
fields = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
print(os.getuid(), os.getgid(), os.getgroups(), *(fields[k].strip() for k in
      ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')))
"""


def test_the_code_holds_no_capability_and_no_new_privileges(strict: Trainer) -> None:
    res = strict.run(STATUS)
    uid, gid, groups, *caps, nnp = out(res).split(maxsplit=2)[:2] + out(res).split(maxsplit=2)[2].rsplit(maxsplit=6)
    assert int(uid) != 0 and int(uid) == (65534 if strict.kind == "root" else strict.uid), out(res)
    assert caps == ["0000000000000000"] * 5 and nnp == "1", out(res)
    assert groups == "[]", out(res)


MOUNTS = """\
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, ret):
    print(name, 'ok' if ret == 0 else os.strerror(ctypes.get_errno()))
tried('umount /tmp', libc.umount2(b'/tmp', 2))
tried('umount /', libc.umount2(b'/', 2))
tried('mount tmpfs', libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, b'size=1g'))
tried('remount / rw', libc.mount(None, b'/', None, 32 | 4096, None))
tried('remount /usr rw', libc.mount(None, b'/usr', None, 32 | 4096, None))
tried('mount proc', libc.mount(b'proc', b'/tmp', b'proc', 0, None))
for path in ('/escape.txt', '/usr/escape.txt', '/etc/escape.txt', '/tmp/{name}'):
    try:
        open(path, 'w').write('x'); print('wrote', path)
    except OSError as e:
        print('refused', path, e.strerror)
"""


def test_the_code_cannot_undo_or_add_mounts(strict: Trainer) -> None:
    name = f"hpcrl-escape-{os.getpid()}-{strict.kind}"
    res = strict.run(MOUNTS.replace("{name}", name))
    lines = out(res).splitlines()
    assert lines[:6] == ["umount /tmp Operation not permitted", "umount / Operation not permitted",
                         "mount tmpfs Operation not permitted", "remount / rw Operation not permitted",
                         "remount /usr rw Operation not permitted",
                         "mount proc Operation not permitted"], out(res) + res.stderr.decode()
    assert lines[6:9] == ["refused /escape.txt Read-only file system",
                          "refused /usr/escape.txt Read-only file system",
                          "refused /etc/escape.txt Read-only file system"], out(res)
    assert lines[9] == f"wrote /tmp/{name}"  # its own /tmp, which vanishes with it
    assert not Path("/tmp", name).exists() and not Path("/escape.txt").exists()


def test_the_scratch_space_is_one_bounded_tmpfs_gone_after_the_run(strict: Trainer) -> None:
    """`/tmp`, `/var/tmp`, `/dev/shm` and the working directory share one tmpfs of
    `max_tmp_bytes`: 300 MiB written across them stops at the bound (ENOSPC), never on a disk."""
    name = f"hpcrl-sandbox-{os.getpid()}-{strict.kind}"
    code = ("import os\nwrote = 0\n"
            "for d in ['/tmp', '/var/tmp', '/dev/shm', '.']:\n"
            "    try:\n"
            f"        with open(os.path.join(d, {name!r}), 'wb') as f:\n"
            "            for _ in range(75):\n                f.write(b'x' * (1 << 20)); wrote += 1\n"
            "    except OSError as e:\n        print('full at', wrote, 'MiB', e.errno); break\n"
            "else:\n    print('wrote', wrote)")
    res = strict.run(code, max_tmp_bytes=4 << 20, max_file_bytes=100 << 20)
    assert res.returncode == 0, res
    assert out(res) == "full at 4 MiB 28\n", out(res)  # ENOSPC
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not (Path(d) / name).exists(), d


def test_the_trainers_files_home_and_checkout_are_out_of_sight(strict: Trainer) -> None:
    targets = [str(strict.secret), str(strict.home), str(REPO / "README.md"), "/root", "/home",
               "/etc/shadow", "/run", "/sys/kernel", str(Path(sys.executable).parent.parent / "pyvenv.cfg")]
    code = ("import os\n"
            f"for t in {targets!r}:\n"
            "    print(t, os.path.exists(t))\n"
            "import sys\n"
            "try:\n    open(os.path.join(sys.prefix, 'escape.txt'), 'w')\n    print('wrote prefix')\n"
            "except OSError as e:\n    print('prefix', e.strerror)\n")
    res = strict.run(code)
    seen = dict(line.rsplit(" ", 1) for line in out(res).splitlines()[:-1])
    visible = {t for t, there in seen.items() if there == "True"}
    # the interpreter's own prefix is there, read-only; nothing else of the node's files above
    assert visible <= {str(Path(sys.executable).parent.parent / "pyvenv.cfg")}, out(res)
    assert str(strict.secret) not in visible and str(REPO / "README.md") not in visible
    assert out(res).splitlines()[-1] == "prefix Read-only file system", out(res)


def test_host_sockets_are_out_of_reach(strict: Trainer) -> None:
    """A Unix socket of the trainer's user in a shared directory (Ray's and vLLM's live under
    /tmp) and an abstract one: neither answers."""
    path = strict.base / "trainer.sock"
    abstract = f"\0hpcrl-test-{os.getpid()}-{strict.kind}"
    with socket.socket(socket.AF_UNIX) as on_disk, socket.socket(socket.AF_UNIX) as hidden:
        on_disk.bind(str(path))
        path.chmod(0o777)
        os.chown(path, strict.uid, strict.gid) if ROOT else None
        on_disk.listen(1)
        hidden.bind(abstract)
        hidden.listen(1)
        code = ("import socket\n"
                f"for address in [{str(path)!r}, {abstract!r}]:\n"
                "    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n        s.connect(address)\n        print('connected')\n"
                "    except OSError as e:\n        print('refused', e.strerror)\n")
        res = strict.run(code)
    assert out(res) == "refused No such file or directory\nrefused Connection refused\n", out(res)


def test_only_the_calls_own_processes_are_visible(strict: Trainer) -> None:
    code = ("import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(pids, os.getpid())\n"
            "for p in pids:\n    try:\n        open(f'/proc/{p}/environ').read(); print('environ', p)\n"
            "    except OSError as e:\n        pass\n")
    res = strict.run(code)
    first = out(res).splitlines()[0]
    assert first == "[1, 2] 2", out(res)  # its pid 1 and itself: nothing of the node's
    assert "environ 1" not in out(res)  # pid 1 is undumpable: its memory and environment are closed


def test_no_nested_namespaces(strict: Trainer) -> None:
    code = ("import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for name, flag in [('user', 0x10000000), ('mount', 0x20000), ('net', 0x40000000), "
            "('pid', 0x20000000)]:\n"
            "    print(name, libc.unshare(flag), os.strerror(ctypes.get_errno()))\n"
            "p = subprocess.run(['unshare', '--user', '--map-root-user', 'true'], capture_output=True)\n"
            "print('unshare(1)', p.returncode)\n")
    res = strict.run(code)
    assert out(res) == ("user -1 No space left on device\nmount -1 Operation not permitted\n"
                        "net -1 Operation not permitted\npid -1 Operation not permitted\n"
                        "unshare(1) 1\n"), out(res) + res.stderr.decode()


def test_the_whole_calls_memory_is_bounded(strict: Trainer) -> None:
    """6 children of 180 MiB each, under 256 MiB for the call: each is under its own RLIMIT_AS,
    together they are not, and pid 1 stops them all."""
    code = ("import os, time\n"
            "for _ in range(6):\n"
            "    if os.fork() == 0:\n"
            "        b = bytearray(180 << 20)\n"
            "        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
            "        time.sleep(30); os._exit(0)\n"
            "for _ in range(6):\n    os.wait()\nprint('all held')")
    res = strict.run(code, memory_limit_mb=256, timeout=30, max_processes=16)
    assert res.memory_exceeded and not res.timed_out, res
    assert "all held" not in out(res)
    assert int(res.report["held_bytes"]) > 256 << 20 and res.report["limit_bytes"] == 256 << 20  # type: ignore[call-overload]
    assert res.signal == signal.SIGKILL and res.wall_s < 20
    assert wait_until(lambda: processes_mentioning(res.workdir) == [])


def test_memfd_and_shared_memory_count_towards_the_call(strict: Trainer) -> None:
    code = ("import os\nfds = []\n"
            "for i in range(40):\n"
            "    fd = os.memfd_create(f'm{i}')\n    os.write(fd, b'x' * (15 << 20))\n    fds.append(fd)\n"
            "print('held', len(fds), flush=True)\nimport time\ntime.sleep(5)")  # held: pid 1 must see it
    res = strict.run(code, memory_limit_mb=128, max_file_bytes=16 << 20, max_open_files=64, timeout=30)
    assert res.memory_exceeded and res.signal == signal.SIGKILL and not res.timed_out, res


def test_the_peak_of_a_call_is_reported(strict: Trainer) -> None:
    res = strict.run("import time\nb = bytearray(40 << 20)\nfor i in range(0, len(b), 4096):\n"
                     "    b[i] = 1\ntime.sleep(0.5)")
    assert res.returncode == 0, res
    assert 40 << 20 < int(res.report["peak_bytes"]) < 200 << 20, res.report  # type: ignore[call-overload]


def test_network_is_unreachable_in_strict_and_reachable_when_allowed(strict: Trainer) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        code = ("import socket\ns = socket.socket()\ns.settimeout(5)\ntry:\n"
                f"    s.connect(('127.0.0.1', {server.getsockname()[1]}))\n    print('connected')\n"
                "except OSError as e:\n    print('refused', e.errno)\n"
                "t = socket.socket()\nt.bind(('127.0.0.1', 0))\nt.listen(1)\nprint('own loopback')")
        allowed = strict.run(code, allow_network=True)
        assert out(allowed).splitlines()[0] == "connected", allowed  # the check can tell both apart
        res = strict.run(code)
    assert out(res) == "refused 111\nown loopback\n", out(res)  # the namespace's own loopback, up


# -- `rlimits`: what a site accepts by naming it -------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_rlimits_mode_says_what_it_does_not_hold(kind: str, tmp_path: Path) -> None:
    with make_trainer(kind, tmp_path, "rlimits") as trainer:
        res = trainer.run(f"import os\nprint(os.path.exists({str(trainer.secret)!r}), "
                          "len(os.listdir('/proc')) > 10)")
    assert res.isolation.mode == "rlimits" and not res.isolation.network
    assert "reads and writes wherever its user may" in res.isolation.note
    # as documented: the node's processes are in sight, and the files of the code's user: the
    # ordinary trainer's own; as root, the code runs as `nobody`, to whom root's are closed
    assert out(res) == ("False True\n" if kind == "root" else "True True\n"), out(res)


def test_an_unknown_mode_is_refused_naming_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_PYTHON_SANDBOX", "loose")
    with pytest.raises(SandboxError, match=r"`HPCRL_PYTHON_SANDBOX=loose` names no sandbox mode; use "
                                           r"one of strict, rlimits"):
        sandbox.sandbox_mode()


# -- a node that grants no unprivileged user namespaces ------------------------------------------

NO_USERNS = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid = int(sys.argv[1])
go, ready = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000) == 0
    os.write(ready[1], b'x')
    os.read(go[0], 1)
    with open('/proc/sys/user/max_user_namespaces', 'w') as f:  # this node grants none
        f.write('0')
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.execv(sys.argv[2], sys.argv[2:])
os.read(ready[0], 1)
for name in ('uid_map', 'gid_map'):
    with open(f'/proc/{pid}/{name}', 'w') as f:
        f.write(f'0 0 1\n{uid} {uid} 1\n')
os.write(go[1], b'x')
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_strict_refuses_where_the_node_grants_no_user_namespace(tmp_path: Path) -> None:
    """An ordinary trainer in a user namespace whose `max_user_namespaces` is 0, as on a node
    that grants none: the probe refuses, naming why and the named weaker mode; `rlimits`, named,
    runs."""
    needs(ROOT, "making a node without user namespaces for an ordinary user needs root")
    with make_trainer("ordinary", tmp_path) as trainer:
        limits = trainer.limits()
        script = ("import asyncio, dataclasses, json, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\n"
                  "for mode in ('strict', 'rlimits'):\n"
                  "    limits = sandbox.SandboxLimits(**{**json.loads(sys.argv[2]), 'mode': mode})\n"
                  "    try:\n        sandbox.probe(limits)\n        print(mode, 'ok')\n"
                  "    except sandbox.SandboxError as e:\n        print(mode, 'refused:', e)\n")
        proc = subprocess.run(
            [sys.executable, "-c", NO_USERNS, str(ORDINARY_UID), trainer.python, "-I", "-c", script,
             str(trainer.modules), json.dumps(dataclasses.asdict(limits))],
            env={"HOME": str(trainer.home), "PATH": "/usr/bin:/bin"}, cwd=trainer.home,
            capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith("strict refused: python tool: the `strict` sandbox cannot be built on "
                               "this node: unshare(user, mount, pid"), lines[0]
    assert "No space left on device" in lines[0] and "user.max_user_namespaces" in lines[0]
    assert "`HPCRL_PYTHON_SANDBOX: rlimits` in the site profile's `env:`" in lines[0]
    assert lines[1] == "rlimits ok"


def test_the_probe_passes_on_this_node(strict: Trainer) -> None:
    if strict.subprocess:
        res = strict.run(sandbox._PROBE_STRICT)
        assert out(res).strip() == "ok", out(res) + res.stderr.decode()
    else:
        probe(strict.limits())


def test_the_sandbox_modules_need_only_the_standard_library() -> None:
    """The ordinary trainer's tests import a copy of them alone; the launcher runs as a script."""
    for name in ("sandbox.py", "sandbox_launch.py"):
        tree = ast.parse(Path(sandbox.__file__).with_name(name).read_text())
        imports = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        imports |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert imports <= set(sys.stdlib_module_names), (name, imports - set(sys.stdlib_module_names))
