"""Bring-up and tear-down time of the Slurm test lab (packages and images already present),
and time from `sbatch` to a finished 3-node job. Needs root.

    .venv/bin/python -m bench.lab_bringup [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from tests.lab import Lab, LabConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    rows: dict[str, list[float]] = {}
    for ipv6_only in (False, True):
        for _ in range(args.repeat):
            t0 = time.monotonic()
            lab = Lab.up(LabConfig(nodes=3, ipv6_only=ipv6_only))
            up = time.monotonic() - t0
            with tempfile.TemporaryDirectory() as out:
                t1 = time.monotonic()
                job = lab.sbatch(f"#!/bin/bash\n#SBATCH -N 3\n#SBATCH -o {out}/o-%j\nsrun hostname\n")
                lab.wait_done(job)
                job_s = time.monotonic() - t1
            t2 = time.monotonic()
            lab.down()
            down = time.monotonic() - t2
            mode = "ipv6-only" if ipv6_only else "ipv4+ipv6"
            for key, val in (("up", up), ("3-node job", job_s), ("down", down)):
                rows.setdefault(f"{mode:9s} {key}", []).append(val)
    print(f"{'lab, 3 nodes':22s} {'median s':>9s} {'min s':>7s} {'max s':>7s}")
    for key, vals in rows.items():
        print(f"{key:22s} {statistics.median(vals):9.2f} {min(vals):7.2f} {max(vals):7.2f}")


if __name__ == "__main__":
    main()
