"""`hpcrl image build|pull`: the container runtime's own build and pull for a site's image."""

from __future__ import annotations

import argparse
import sys

from hpcrl.commands._common import add_site, site_name, user_errors
from hpcrl.containers import ContainerError, build_command, pull_command
from hpcrl.profile_load import load_profile
from hpcrl.resources import data_dir

HELP = "build or pull the site's container image with its runtime's own command"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build", "pull"])
    add_site(parser)
    parser.add_argument("--recipe", help="build: Dockerfile, Apptainer .def, or (apptainer) "
                        "`docker-archive://FILE.tar` / `docker://REF`; default: the profile's "
                        "`container.recipe`")
    parser.add_argument("--context", help="build context for podman/docker (default: the hpcrl "
                        "source tree)")
    parser.add_argument("--from", dest="source", help="pull: source reference (apptainer: "
                        "`docker://REF` or `docker-archive://FILE.tar`)")
    parser.add_argument("--dry-run", action="store_true", help="print the command only")


def resolve_recipe(recipe: str) -> str:
    """A name of a file in hpcrl's `containers/`, a path, or a `scheme://` reference."""
    from pathlib import Path

    if "://" in recipe:
        return recipe
    shipped = data_dir("containers") / recipe
    if "/" not in recipe and shipped.is_file():
        return str(shipped)
    if not Path(recipe).expanduser().exists():
        raise ContainerError(f"recipe `{recipe}` not found (neither a path nor a file in "
                             f"{data_dir('containers')})")
    return str(Path(recipe).expanduser())


@user_errors
def run(args: argparse.Namespace) -> int:
    import os
    import subprocess
    from pathlib import Path

    c = load_profile(site_name(args)).profile.container
    context = None
    if args.action == "pull":
        cmd = pull_command(c, args.source)
    else:
        recipe = args.recipe or c.recipe
        if not recipe:
            raise ContainerError(f"site `{site_name(args)}` has no `container.recipe`; pass "
                                 "`--recipe FILE`")
        context = args.context or str(Path(__file__).resolve().parents[2])
        cmd = build_command(c, resolve_recipe(recipe), context)
    print(f"+ {cmd.display()}", file=sys.stderr)
    if args.dry_run:
        return 0
    try:
        # apptainer reads the `%files` sources of a .def relative to the current directory
        return subprocess.run(list(cmd.argv), env={**os.environ, **cmd.env},
                              cwd=context).returncode
    except FileNotFoundError:
        raise ContainerError(f"`{cmd.argv[0]}` was not found; install the runtime or set "
                             "`container.binary` in the site profile") from None
