"""Benchmark: what the python tool's sandbox costs a call, against a bare `python -I -c` process
in the same run (this machine is shared and noisy: read the ratios).

    python -m bench.sandbox_cost [--calls N] [--python PATH]

Prints, for `print(1)` and for a call that allocates and touches 64 MiB, the median wall time
of N calls in mode `strict` (namespaces, new root, pid 1 that watches the call's memory), in
mode `rlimits`, and as a bare subprocess, and the ratios to the bare one. As root, the sandbox
is built by `nobody`, as the python tool builds it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import statistics
import subprocess
import tempfile
import time

from trainer.agent.tools.sandbox import SandboxLimits, run_python, usable_python

CODES = {"print(1)": "print(1)",
         "64 MiB touched": "b = bytearray(64 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint(len(b))"}


def bare(python: str, code: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        subprocess.run([python, "-I", "-c", code], env={}, stdin=subprocess.DEVNULL, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def sandboxed(limits: SandboxLimits, code: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        res = asyncio.run(run_python(code, limits))
        times.append(time.perf_counter() - start)
        assert res.returncode == 0, res
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--python", default=None, help="the interpreter (default: this one, else /usr/bin/python3)")
    args = p.parse_args()
    uid = gid = None
    if os.geteuid() == 0:
        entry = pwd.getpwnam("nobody")
        uid, gid = entry.pw_uid, entry.pw_gid
    python = usable_python(uid, gid, (args.python,) if args.python else ())
    with tempfile.TemporaryDirectory() as work:
        os.chmod(work, 0o755)
        for name, code in CODES.items():
            base = statistics.median(bare(python, code, args.calls))
            print(f"{name}: bare subprocess median {base * 1000:.1f} ms over {args.calls} calls")
            for mode in ("rlimits", "strict"):
                limits = SandboxLimits(mode=mode, uid=uid, gid=gid, python=python, tmp_dir=work)
                med = statistics.median(sandboxed(limits, code, args.calls))
                print(f"  {mode:8s}: median {med * 1000:.1f} ms, {med / base:.2f}x the bare process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
