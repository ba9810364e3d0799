"""Run verl's driver so that it outlives Slurm's SIGTERM: `python3 verl_launch.py -- ARGV...`.

verl's driver (`verl/trainer/main_ppo.py` under Ray) exits 15 on SIGTERM, from Ray's driver
handler, and dies of SIGUSR2 (140), which it does not catch. Slurm sends SIGTERM to every process
of the job at a preemption with GraceTime, `scontrol requeue` and `scancel`. SIGTERM is blocked
here first, and `exec` keeps the blocked mask (as Ray's processes keep it, `ray_launch.py`): the
driver runs on until verl has saved and the head's agent ends it (SIGKILL, which no mask holds
back). The parent-death signal is SIGKILL for the same reason.

It prints the verl it runs (its installed version) first, so the payload log names it.

Run next to verl (inside the job's container), as a file: it imports nothing from hpcrl, and
nothing of verl but its package metadata.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def verl_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return "not installed as a package (no version metadata)"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--":
        print("usage: verl_launch.py -- PYTHON -m verl.trainer.main_ppo OVERRIDES...",
              file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    print(f"verl_launch: verl {verl_version()} ({sys.executable}); SIGTERM blocked, the "
          "head's agent ends verl once it has saved", flush=True)
    os.execvp(argv[1], argv[1:])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
