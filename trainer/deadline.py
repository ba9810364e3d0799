"""The job's end time: stop and checkpoint early enough on one's own, signal or not.

The launcher passes the Unix time at which Slurm ends the job in `HPCRL_JOB_END_TIME`. After
each step the loop asks :meth:`Deadline.reached`: when the next step plus a checkpoint plus
`trainer.deadline_margin_s` would not fit before the end, it stops now (checkpoint, requeue
status). Estimates are the longest of the recent step and save times; before the first save the
save is assumed to take as long as a step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

END_TIME_ENV = "HPCRL_JOB_END_TIME"
RECENT = 5


class DeadlineError(ValueError):
    """`HPCRL_JOB_END_TIME` is not a time."""


def parse_end_time(value: str | None) -> float | None:
    """`HPCRL_JOB_END_TIME` (Unix seconds, e.g. `1763741234`) -> float; unset or empty -> None."""
    if value is None or not value.strip():
        return None
    try:
        return float(value)
    except ValueError:
        raise DeadlineError(
            f"`{END_TIME_ENV}` is {value!r}, not a Unix time in seconds; the launcher sets it "
            "from Slurm's end time: unset it, or give seconds since the epoch"
        ) from None


class Deadline:
    """Recent step and save durations and the job's end time (None: no deadline)."""

    def __init__(self, end_time: float | None, margin_s: float) -> None:
        self.end_time = end_time
        self.margin_s = margin_s
        self.steps: deque[float] = deque(maxlen=RECENT)
        self.saves: deque[float] = deque(maxlen=RECENT)

    @classmethod
    def from_env(cls, env: Mapping[str, str], margin_s: float) -> Deadline:
        return cls(parse_end_time(env.get(END_TIME_ENV)), margin_s)

    def record_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def record_save(self, seconds: float) -> None:
        self.saves.append(seconds)

    def needed_s(self) -> float:
        """Seconds one more step and its checkpoint need, margin included."""
        step = max(self.steps, default=0.0)
        save = max(self.saves, default=step)
        return step + save + self.margin_s

    def reached(self, now: float | None = None) -> bool:
        """True when another step and a checkpoint would not fit before the end."""
        if self.end_time is None:
            return False
        now = time.time() if now is None else now
        return now + self.needed_s() >= self.end_time

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        left = (self.end_time or now) - now
        return (f"the job ends in {left:.0f} s and a step, a checkpoint and the "
                f"{self.margin_s:.0f} s margin need {self.needed_s():.0f} s")
