"""What `make demo`'s first install downloads on a machine with the public index alone.

    .venv/bin/python -m bench.public_index [--spec torch==2.13.0] [-- PIP_ARGS ...]
    .venv/bin/python -m bench.public_index --spec "torch==2.13.0 .[train,dev,docs]"   # all of `make demo`'s .venv

pip resolves the spec as `make demo` installs it (`pip install torch==2.13.0`), but with this
machine's pip configuration hidden (`PIP_CONFIG_FILE=/dev/null`, no `PIP_FIND_LINKS`: no local
wheel folder, no local index), in `--dry-run` mode with a `--report`: nothing is installed, and
with PyPI's published metadata nothing large is downloaded. Each file's size is then read from
the index's `Content-Length`. Prints the packages, the largest files and the total.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path


def resolve(spec: str, pip_args: list[str]) -> list[tuple[str, str, str]]:
    """(name, version, url) of every file pip would download for `spec` (requirements separated
    by spaces, resolved together) from the public index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # no configuration; and nothing written to the home directory (pip's cache, its version check)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                               "--report", str(report), *pip_args, *spec.split()], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"bench.public_index: pip could not resolve `{spec}` from the public index "
                             f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        installs = json.loads(report.read_text())["install"]
    return [(i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"]) for i in installs]


def size(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as reply:
        return int(reply.headers.get("Content-Length", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.public_index", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="torch==2.13.0")
    parser.add_argument("pip_args", nargs="*", help="after `--`: more pip arguments (an --index-url)")
    args = parser.parse_args(argv)
    files = [(name, version, url, size(url)) for name, version, url in resolve(args.spec, args.pip_args)
             if url.startswith(("http://", "https://"))]  # a local project (`.[train]`) downloads nothing
    files.sort(key=lambda f: -f[3])
    for name, version, url, n in files[:8]:
        print(f"{n / 1e6:9.0f} MB  {name} {version}  ({url.rsplit('/', 1)[-1]})")
    total = sum(f[3] for f in files)
    print(f"{len(files)} packages, {total / 1e9:.2f} GB to download for `{args.spec}` from the public index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
