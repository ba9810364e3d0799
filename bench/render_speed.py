"""Benchmark: wall time of `hpcrl render` against `python -c pass` in the same run.

    python bench/render_speed.py [--repeat N] [--site NAME]

Prints the median of N fresh-process runs of each, their ratio, and whether rendering imported
torch, ray or vllm (it must not: a login node may not have them, and they cost seconds).
Exits non-zero if a heavy module was imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "ray", "vllm")
PROBE = """
import json, sys
from hpcrl.cli import main
code = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY_NAMES))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
""".replace("HEAVY_NAMES", repr(HEAVY))


def timed(argv: list[str], env: dict[str, str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--site", default="mi300-cluster")
    args = parser.parse_args()
    render = ["render", "--site", args.site, "--no-prepare", "--", "trainer.nnodes=2",
              "critic.ppo_micro_batch_size_per_gpu=4",
              "data.train_batch_size=256"]
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HOME": home, "PYTHONPATH": str(REPO)}
        base = timed([sys.executable, "-c", "pass"], env, args.repeat)
        hpcrl = timed([sys.executable, "-m", "hpcrl", *render], env, args.repeat)
        probe = subprocess.run([sys.executable, "-c", PROBE, *render], env=env, text=True,
                               capture_output=True, check=True)
    heavy = json.loads(probe.stderr.strip().splitlines()[-1])["heavy"]
    b, h = statistics.median(base), statistics.median(hpcrl)
    print(f"python -c pass          : median {b * 1000:7.1f} ms over {args.repeat} runs")
    print(f"hpcrl render --site {args.site}: median {h * 1000:7.1f} ms over {args.repeat} runs")
    print(f"ratio render / baseline : {h / b:5.2f}x  (render overhead {(h - b) * 1000:.1f} ms)")
    print(f"heavy modules imported by render ({', '.join(HEAVY)}): {heavy or 'none'}")
    print(f"target: render under 0.5 s: {'met' if h < 0.5 else 'NOT met'}")
    return 1 if heavy else 0


if __name__ == "__main__":
    sys.exit(main())
