"""Stop requests: a signal (SIGUSR2, SIGTERM) or a `STOP` file in the run directory.

The signal handlers only set a flag; the training loop polls `StopRequest.requested()` between
steps, finishes the step, writes a checkpoint and exits with `REQUEUE_EXIT_CODE`. (The job's end
time is the other reason to stop: `trainer.deadline`.)

Launched by hpcrl (`HPCRL_RUN_DIR` set), SIGINT is a stop signal too: Ctrl-C on
`hpcrl submit --site local` asks for a clean stop with a checkpoint, and a second SIGINT aborts
at once (`KeyboardInterrupt`, no checkpoint).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType

STOP_FILE = "STOP"
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
LAUNCHER_ENV = "HPCRL_RUN_DIR"


def stop_signals(env: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The signals that ask for a stop: SIGINT joins them when hpcrl launched the trainer."""
    env = os.environ if env is None else env
    return (*STOP_SIGNALS, signal.SIGINT) if env.get(LAUNCHER_ENV) else STOP_SIGNALS


class StopRequest:
    """Remembers whether a stop was asked for, by signal or by `<run_dir>/STOP`.

    `python -m trainer` installs the handlers first thing, before the models load, so that a stop
    request arriving during start-up is kept, not fatal (the default action of SIGUSR2 is to end
    the process); the run directory is named once the configuration is known (`watch`).
    """

    def __init__(self, run_dir: str | Path | None = None) -> None:
        self.stop_file: Path | None = None if run_dir is None else Path(run_dir) / STOP_FILE
        self.signal_received: int | None = None
        self.interrupts = 0
        self._previous: dict[int, object] = {}

    def watch(self, run_dir: str | Path) -> None:
        """Look for `<run_dir>/STOP` from now on."""
        self.stop_file = Path(run_dir) / STOP_FILE

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt("second SIGINT: abort without a checkpoint")
        if self.signal_received is None:
            self.signal_received = signum

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self, signals: Iterable[signal.Signals] | None = None) -> None:
        """Handle `signals` (default: `stop_signals()`) by setting the flag (main thread only,
        as Python requires); a second call changes nothing."""
        for sig in stop_signals() if signals is None else signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)

    def settle(self) -> None:
        """The exit status is decided: from now on the stop signals are ignored. A stop request
        that arrives after the last step (while the process exits, when Python has restored the
        default actions) would otherwise kill a finished run, which then reads as aborted."""
        for sig in set(self._previous) | set(stop_signals()):
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _file_present(self) -> bool:
        return self.stop_file is not None and self.stop_file.exists()

    def requested(self) -> bool:
        return self.signal_received is not None or self._file_present()

    def reason(self) -> str:
        if self.signal_received is not None:
            return f"signal {signal.Signals(self.signal_received).name}"
        return f"stop file {self.stop_file}" if self._file_present() else "none"

    def clear_stop_file(self) -> None:
        """Remove a consumed stop file so that the requeued run does not stop at once."""
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)
