"""`hpcrl plot RUN [-o out.png]`."""

from __future__ import annotations

import argparse

from hpcrl.commands._common import run_dir_of, user_errors
from hpcrl.plotting import plot_run

HELP = ("write a PNG of reward, validation (with standard errors), KL, entropy, response length "
        "and step time per step (restarts marked)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory (or a job id whose run directory hpcrl finds)")
    parser.add_argument("-o", "--output", help="PNG file to write (default: RUN/metrics.png)")


@user_errors
def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    out, _ = plot_run(run_dir_of(args.run), Path(args.output).expanduser() if args.output else None)
    print(out)
    return 0
