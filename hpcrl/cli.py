"""The `hpcrl` command line. Each subcommand lives in `hpcrl/commands/<name>.py` and is
imported only when it runs or when its parser is built, so `hpcrl --help` stays light."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hpcrl import __version__

# name -> module. Every module defines HELP (one line), configure(parser) and run(args) -> int.
COMMANDS: dict[str, str] = {
    "sites": "hpcrl.commands.sites",
    "render": "hpcrl.commands.render",
    "submit": "hpcrl.commands.submit",
    "status": "hpcrl.commands.status",
    "logs": "hpcrl.commands.logs",
    "cancel": "hpcrl.commands.cancel",
    "image": "hpcrl.commands.image",
    "plot": "hpcrl.commands.plot",
    "doctor": "hpcrl.commands.doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl",
        description="Run RL training of language models as Slurm batch jobs.",
    )
    parser.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("hpcrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
