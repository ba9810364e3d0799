"""What reading overrides by verl's grammar costs at start-up: Hydra's override parser and
OmegaConf, against the YAML reader alone, each in a fresh interpreter.

    python -m bench.override_import [--rounds 9]

Prints the median wall time of each statement in a new `python -c` process, and the same less
an empty interpreter's. The trainer and `hpcrl submit` pay the parser's import once per start;
the trainer's own start (torch, transformers) is seconds, so this decides only whether the light
launcher commands stay fast.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "empty interpreter": "pass",
    "yaml": "import yaml",
    "omegaconf": "import omegaconf",
    "hydra parser + omegaconf": (
        "from hydra.core.override_parser.overrides_parser import OverridesParser; import omegaconf"),
    "trainer.config: 3 overrides read, ${} resolved": (
        "from trainer.config import override_values; "
        "override_values(['data.train_batch_size=8', '~data.shuffle', "
        "'+trainer.experiment_name=${data.train_batch_size}'])"),
    "hpcrl.cli (the launcher's entry point)": "import hpcrl.cli",
}


def timed(stmt: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", stmt], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    base = timed(CASES["empty interpreter"], args.rounds)
    print(f"median of {args.rounds} fresh interpreters ({sys.executable})")
    print("| what | ms | ms over an empty interpreter |")
    print("| --- | --- | --- |")
    for name, stmt in CASES.items():
        t = base if stmt == "pass" else timed(stmt, args.rounds)
        print(f"| {name} | {t * 1000:.0f} | {(t - base) * 1000:+.0f} |")


if __name__ == "__main__":
    main()
