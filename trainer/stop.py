"""Stop requests: a signal (SIGUSR2, SIGTERM) or a `STOP` file in the run directory.

The signal handlers only set a flag; the training loop polls `StopRequest.requested()` between
steps, finishes the step, writes a checkpoint and exits with `REQUEUE_EXIT_CODE`.

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
    """Remembers whether a stop was asked for, by signal or by `<run_dir>/STOP`."""

    def __init__(self, run_dir: str | Path) -> None:
        self.stop_file = Path(run_dir) / STOP_FILE
        self.signal_received: int | None = None
        self.interrupts = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt("second SIGINT: abort without a checkpoint")
        if self.signal_received is None:
            self.signal_received = signum

    def install(self, signals: Iterable[signal.Signals] | None = None) -> None:
        """Handle `signals` (default: `stop_signals()`) by setting the flag (main thread only,
        as Python requires)."""
        for sig in stop_signals() if signals is None else signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def requested(self) -> bool:
        return self.signal_received is not None or self.stop_file.exists()

    def reason(self) -> str:
        if self.signal_received is not None:
            return f"signal {signal.Signals(self.signal_received).name}"
        return f"stop file {self.stop_file}" if self.stop_file.exists() else "none"

    def clear_stop_file(self) -> None:
        """Remove a consumed stop file so that the requeued run does not stop at once."""
        self.stop_file.unlink(missing_ok=True)
