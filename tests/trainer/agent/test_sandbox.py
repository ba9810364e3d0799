"""The sandbox of the `python` tool against hostile code: each case ends within its bounds, the
trainer's process, environment and files stay untouched, and nothing of a run is left behind.
Where the node cannot give a bound (no `unshare`, a root-only run), the assertion that needs it
is skipped with the reason; the rest still runs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.trainer.agent.sandbox_support import ROOT, processes_mentioning, small_limits, wait_until
from trainer.agent.tools import sandbox
from trainer.agent.tools.sandbox import SandboxResult, isolation, run_python


@pytest.fixture(params=["namespaces", "without-unshare"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The node as it is, and the node without `unshare` (no pid or network namespace)."""
    if request.param == "without-unshare":
        monkeypatch.setattr(sandbox, "_ISOLATION", {})
        monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    return str(request.param)


def run(code: str, tmp_path: Path, **limits: object) -> SandboxResult:
    return asyncio.run(run_python(code, small_limits(tmp_path, **limits)))


def out(res: SandboxResult) -> str:
    return res.stdout.decode()


def test_plain_code_runs_in_a_private_directory_that_is_removed(tmp_path: Path, mode: str) -> None:
    res = run("import os\nprint('hi', os.getcwd())\nopen('left.txt', 'w').write('x')", tmp_path)
    assert res.returncode == 0 and not res.timed_out, res
    word, cwd = out(res).split()
    assert word == "hi" and cwd == res.workdir and Path(cwd).parent == tmp_path / "work"
    assert not Path(res.workdir).exists()
    assert list((tmp_path / "work").iterdir()) == []


def test_a_strict_umask_of_the_trainer_does_not_lock_the_code_out(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        res = run("print('read')", tmp_path)
    finally:
        os.umask(old)
    assert out(res) == "read\n", res


def test_the_environment_is_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_TEST_SECRET", "s3cret")
    res = run("import os, json\nprint(json.dumps(dict(os.environ)))\n"
              "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
              "'import os; print(sorted(k for k in os.environ if k != \"LC_CTYPE\"))'])", tmp_path)
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


def test_an_infinite_loop_ends_at_the_timeout(tmp_path: Path, mode: str) -> None:
    res = run("while True:\n    pass", tmp_path, timeout=1.0)
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


def test_huge_stdout_is_capped_and_stops_the_process(tmp_path: Path, mode: str) -> None:
    res = run("while True:\n    print('x' * 1000)", tmp_path, max_output_bytes=10_000, timeout=60)
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


def test_a_fork_bomb_is_bounded_and_leaves_nothing(tmp_path: Path, mode: str) -> None:
    res = run(FORK_BOMB, tmp_path, max_processes=8)
    assert res.returncode == 0 and not res.timed_out, res
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"
    forked = int(out(res).split()[1])
    if ROOT and small_limits(tmp_path).uid is None:
        pytest.skip("the code runs as root, which RLIMIT_NPROC does not bind: the count is unbounded")
    assert forked < 8, forked


def test_a_resilient_fork_bomb_ends_at_the_timeout(tmp_path: Path, mode: str) -> None:
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    res = run(code, tmp_path, max_processes=8, timeout=2.0)
    assert res.timed_out, res
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"


def test_a_daemon_that_leaves_the_session_is_killed(tmp_path: Path, mode: str) -> None:
    # in a pid namespace the kernel ends it; without one, it is found by its command line
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(600)\n    os._exit(0)\nprint('parent done')")
    res = run(code, tmp_path)
    assert out(res) == "parent done\n"
    assert res.wall_s < 10  # the daemon holds stdout open: the run still ends when its code does
    assert wait_until(lambda: processes_mentioning(res.workdir) == []), \
        f"processes of the run are left: {processes_mentioning(res.workdir)}"


def test_killing_its_parent_does_not_reach_the_trainer(tmp_path: Path, mode: str) -> None:
    res = run("import os, signal\nprint(os.getppid(), flush=True)\n"
              "os.kill(os.getppid(), signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGTERM)", tmp_path)
    assert int(out(res).split()[0]) != os.getpid()
    assert res.returncode is not None
    # this process is alive to read the result: the code's parent is the sandbox's launcher


def test_network_is_unreachable_where_isolated(tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        code = ("import socket\ns = socket.socket()\ns.settimeout(5)\ntry:\n"
                f"    s.connect(('127.0.0.1', {server.getsockname()[1]}))\n    print('connected')\n"
                "except OSError as e:\n    print('refused', e.errno)")
        allowed = run(code, tmp_path, allow_network=True)
        assert out(allowed) == "connected\n", allowed  # the check can tell both cases apart
        res = run(code, tmp_path)
    if not isolation(False).network:
        pytest.skip(f"no network namespace on this node: {isolation(False).note}")
    assert out(res).startswith("refused"), res


def test_writes_outside_the_directory_are_refused(tmp_path: Path, mode: str) -> None:
    outside = tmp_path / "trainer-files"
    outside.mkdir()
    code = ("open('inside.txt', 'w').write('x')\n"
            f"for target in ['../escape.txt', {str(outside / 'escape.txt')!r}]:\n"
            "    try:\n        open(target, 'w').write('x')\n        print('wrote')\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)")
    res = run(code, tmp_path)
    assert not Path(res.workdir).exists()
    if small_limits(tmp_path).uid is None:
        pytest.skip("the code runs as the tests' own user: it may write wherever they may")
    # with private temporary space the trainer's files under /tmp are not even there to refuse
    hidden = "FileNotFoundError" if res.isolation.private_tmp else "PermissionError"
    assert out(res) == f"refused PermissionError\nrefused {hidden}\n", res
    assert list(outside.iterdir()) == [] and not (tmp_path / "work" / "escape.txt").exists()


def test_temporary_space_is_private_bounded_and_gone_after_the_run(tmp_path: Path, mode: str) -> None:
    """With a mount namespace: /tmp, /var/tmp, /dev/shm and the working directory are tmpfs of
    the run's own, `max_tmp_bytes` each. Files written there never reach the node, a file past
    the bound fails (ENOSPC) rather than filling a disk, and the trainer's files in /tmp are out
    of sight. Without one (no `unshare`) the note says so."""
    name = f"hpcrl-sandbox-{os.getpid()}-{tmp_path.name}"
    mine = Path("/tmp") / f"{name}-trainer"
    mine.write_text("the trainer's")
    code = ("import os\n"
            f"for d in ['/tmp', '/var/tmp', '/dev/shm']:\n"
            f"    open(os.path.join(d, {name!r}), 'w').write('x')\n"
            f"print('seen', os.path.exists({str(mine)!r}))\n"
            "for i in range(3):\n"
            "    try:\n        open(f'big{i}', 'wb').write(b'x' * (900 << 10))\n        print('wrote', i)\n"
            "    except OSError as e:\n        print('full', i, e.errno)")
    try:
        res = run(code, tmp_path, max_tmp_bytes=2 << 20)
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            assert not (Path(d) / name).exists() or not res.isolation.private_tmp, d
    finally:
        mine.unlink()
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            (Path(d) / name).unlink(missing_ok=True)
    if not res.isolation.private_tmp:
        assert "mount" in res.isolation.note, res.isolation
        pytest.skip(f"no mount namespace here: {res.isolation.note}")
    assert res.returncode == 0, res
    assert out(res) == "seen False\nwrote 0\nwrote 1\nfull 2 28\n", res  # ENOSPC at the third 900 KiB


def test_a_directory_the_code_locked_is_still_removed(tmp_path: Path) -> None:
    res = run("import os\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.chmod('d', 0)\n"
              "os.chmod('.', 0o500)", tmp_path)
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


def test_without_unshare_the_result_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_ISOLATION", {})
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    res = run("print('ran')", tmp_path)
    assert out(res) == "ran\n"
    assert res.isolation.prefix == () and not res.isolation.network
    assert "`unshare` (util-linux) is not installed" in res.isolation.note


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
