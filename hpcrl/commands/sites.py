"""`hpcrl sites`, `hpcrl sites show NAME` and `hpcrl sites new NAME [--extends SITE]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from hpcrl import sitenew
from hpcrl.commands._common import user_errors
from hpcrl.profile_load import available_profiles, check_profile_name, load_profile, user_sites_dir
from hpcrl.profiles import (
    ProfileError,
    SiteProfile,
    flatten,
    profile_to_dict,
    source_of,
)
from hpcrl.sitedetect import Probe

HELP = ("list site profiles, show one resolved with the file of each value, or write a new one "
        "from what this login node shows (`new NAME`)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["list", "show", "new"], default="list",
                        help="`list` (default), `show NAME` or `new NAME`")
    parser.add_argument("name", nargs="?", help="profile name for `show` and `new`")
    new = parser.add_argument_group("new", "`hpcrl sites new NAME`: run on a login node; writes "
                                    "~/.config/hpcrl/sites/NAME.yaml, each value with its source")
    new.add_argument("--extends", help="profile the new one extends (e.g. mi300-cluster, h100-cluster)")
    new.add_argument("--partition", help="Slurm partition (else detected; asked when several fit)")
    new.add_argument("--account", help="Slurm account (else `sacctmgr`'s when you have one)")
    new.add_argument("--runtime", help="container runtime (else the first on PATH)")
    new.add_argument("--image", help="container image (asked when the runtime differs from the extended one's)")
    new.add_argument("--force", action="store_true", help="replace an existing file")


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
        raise ProfileError(f"`hpcrl sites {args.action}` needs a profile name, e.g. "
                           f"`hpcrl sites {args.action} " + ("mycluster --extends mi300-cluster`"
                                                            if args.action == "new" else "slurmlab`"))
    if args.action == "new":
        return new_site(args)
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


def ask_terminal(question: str, default: str, choices: Sequence[str]) -> str:
    """Ask on a terminal; without one (a job, a pipe, `< /dev/null`) take `default` and say so."""
    if not sys.stdin.isatty():
        print(f"note: not a terminal, {question}: {default} (pass a flag to choose)", file=sys.stderr)
        return default
    while True:
        answer = input(f"{question} [{default}]: ").strip() or default
        if not choices or answer in choices:
            return answer
        print(f"choose one of {', '.join(choices)}", file=sys.stderr)


def new_site(args: argparse.Namespace) -> int:
    """Detect, plan, write ~/.config/hpcrl/sites/NAME.yaml, check it loads, point at the doctor."""
    check_profile_name(args.name, None)
    path = user_sites_dir() / f"{args.name}.yaml"
    if path.exists() and not args.force:
        raise ProfileError(f"{path} exists; pass `--force` to replace it, or choose another name")
    parent: SiteProfile | None = load_profile(args.extends).profile if args.extends else None
    flags = sitenew.Flags(args.partition, args.account, args.runtime, args.image, interactive=sys.stdin.isatty())
    plan = sitenew.plan(sitenew.gather(Probe()), parent, flags, ask_terminal)
    for note in plan.notes:  # what could not be detected, beside the profile's comments
        print(f"note: {note}", file=sys.stderr)
    text = sitenew.render(args.name, args.extends, plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    try:
        load_profile(args.name)
    except ProfileError as exc:
        raise ProfileError(f"the profile written to {path} does not load ({exc}); fix it there") from None
    print(text, end="")
    print(f"wrote {path}\nnext: `hpcrl doctor --site {args.name}` checks it on the cluster")
    return 0
