"""`hpcrl sites` and `hpcrl sites show NAME`."""

from __future__ import annotations

import argparse
import json

from hpcrl.commands._common import user_errors
from hpcrl.profiles import (
    ProfileError,
    available_profiles,
    flatten,
    load_profile,
    profile_to_dict,
    source_of,
)

HELP = "list site profiles, or show one resolved with the file of each value"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["list", "show"], default="list",
                        help="`list` (default) or `show NAME`")
    parser.add_argument("name", nargs="?", help="profile name for `show`")


@user_errors
def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        found = available_profiles()
        width = max((len(n) for n in found), default=0)
        for name in found:
            try:
                desc = load_profile(name).profile.description
            except ProfileError as exc:
                desc = f"(broken: {exc})"
            print(f"{name.ljust(width)}  {desc}")
        return 0
    if not args.name:
        raise ProfileError("`hpcrl sites show` needs a profile name, e.g. "
                           "`hpcrl sites show slurmlab`")
    for line in show_lines(args.name):
        print(line)
    return 0


def show_lines(name: str) -> list[str]:
    """`key = value  # file` for every resolved value of profile `name`."""
    loaded = load_profile(name)
    lines = [f"# {name}: " + " -> ".join(loaded.chain)]
    rows = flatten(profile_to_dict(loaded.profile))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        src = "name of the file" if key == "name" else source_of(loaded.provenance, key)
        lines.append(f"{key.ljust(width)} = {json.dumps(value)}  # {src}")
    return lines
