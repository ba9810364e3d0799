"""`python -m hpcrl.agent RUN_DIR`: the node agent, one per node of a job."""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl.agent.core import Agent

USAGE = "usage: python -m hpcrl.agent RUN_DIR"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2

    return Agent(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
