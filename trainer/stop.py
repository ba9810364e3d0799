"""Stop requests: a signal (SIGUSR2, SIGTERM) or a `STOP` file in the run directory.

The signal handlers only set a flag; the training loop polls `StopRequest.requested()` between
steps, finishes the step, writes a checkpoint and exits with `REQUEUE_EXIT_CODE`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

STOP_FILE = "STOP"
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopRequest:
    """Remembers whether a stop was asked for, by signal or by `<run_dir>/STOP`."""

    def __init__(self, run_dir: str | Path) -> None:
        self.stop_file = Path(run_dir) / STOP_FILE
        self.signal_received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_received = signum

    def install(self, signals: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
        """Handle `signals` by setting the flag (main thread only, as Python requires)."""
        for sig in signals:
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
