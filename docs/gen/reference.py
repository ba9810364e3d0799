"""The reference pages, written from the code itself so that they cannot drift: the site-profile
keys (`hpcrl/profiles.py`) and the shipped profiles (`site_profiles/*.yaml`), the trainer's keys
(what `python -m trainer --list-keys` prints), verl's example scripts as the tests judge them,
and every `hpcrl` command's `--help`.

    python docs/gen/reference.py --write   # after changing what a page shows: commit docs/reference/
    python docs/gen/reference.py --check   # what tests/test_docs.py runs: exit 1 naming stale pages

The pages are committed under `docs/reference/`, so the repository's own view shows them too;
the docs build (mkdocs-gen-files runs `docs/gen/build.py`) adds only the benchmark record,
`bench/README.md` as it is."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpcrl import profile_load, profiles  # noqa: E402
from hpcrl.cli import build_parser  # noqa: E402
from tests.trainer import verl_examples  # noqa: E402
from trainer.config.load import describe_keys, load_defaults  # noqa: E402

GENERATED = "<!-- generated at build time by docs/gen/reference.py: edit the code, not this page -->\n\n"


def _cell(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text != "" else '`""`'


def _text(text: str) -> str:
    """A table cell of prose: `<name>` outside code spans is shown, not taken for HTML."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


def _default(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else profiles.profile_to_dict(value)
    return None if f.default is dataclasses.MISSING else f.default


def _profile_rows(cls: type, prefix: str) -> list[str]:
    rows = []
    hints = typing.get_type_hints(cls)
    line = inspect.getsourcelines(cls)[1]
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            rows.extend(_profile_rows(hint, key + "."))
            continue
        meta = f.metadata
        limits = []
        if meta.get("choices"):
            limits.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
        if meta.get("bounds"):
            low, high = meta["bounds"]
            limits.append(f"{low:g} to {high:g} ({meta['rule']})")
        default = "required" if f.default is dataclasses.MISSING and \
            f.default_factory is dataclasses.MISSING else _cell(_default(f))  # type: ignore[misc]
        rows.append(f"| `{key}` | {profiles.type_name(hint)} | {default} | "
                    f"{'; '.join(limits) or '-'} | {_text(meta.get('help', ''))} | "
                    f"`hpcrl/profiles.py:{line}` `{cls.__name__}` |")
    return rows


def _as_written(value: object) -> object:
    """A shipped profile's value with this machine's paths written back as the references the
    file holds (`${sys:prefix}` ...), so that the page is the same in every checkout."""
    if isinstance(value, list):
        return [_as_written(v) for v in value]
    if not isinstance(value, str):
        return value
    refs = sorted(((profile_load._sys_value(n), n) for n in profiles.SYS_REFS), key=lambda r: -len(r[0]))
    for path, name in refs:
        value = value.replace(path, "${sys:" + name + "}")
    return value


def site_profile_page() -> str:
    out = [GENERATED, "# Site profile keys\n\n",
           "Every key a site profile may set, with its type, its default (what applies when no "
           "file sets it), the values it may take and the dataclass that defines it. How "
           "profiles are found, extended and checked: [Site profiles](../site-profiles.md).\n\n",
           "| key | type | default | allowed | what it sets | defined in |\n",
           "|---|---|---|---|---|---|\n"]
    out += [r + "\n" for r in _profile_rows(profiles.SiteProfile, "")]
    out.append("\n## The shipped profiles\n\n"
               "Each value a shipped profile sets away from the default, and the file it comes "
               "from (`extends:` chains included). `~` is the submitting user's home.\n")
    environ = {"HOME": "~", "PATH": "/usr/bin"}
    for name, path in profile_load.available_profiles(environ).items():
        if path.parent != ROOT / "site_profiles":
            continue
        loaded = profile_load.load_profile(name, environ)
        default = profiles.profile_to_dict(dataclasses.replace(
            profiles.SiteProfile(name=name)))
        defaults = dict(profiles.flatten(default))
        out.append(f"\n### `{name}`\n\n{_text(loaded.profile.description)}\n\n"
                   "| key | value | file |\n|---|---|---|\n")
        for key, value in profiles.flatten(profiles.profile_to_dict(loaded.profile)):
            if key == "name" or defaults.get(key, object()) == value:
                continue
            src = profiles.source_of(loaded.provenance, key)
            src = os.path.relpath(src, ROOT) if os.path.isabs(src) else src
            out.append(f"| `{key}` | {_cell(_as_written(value))} | `{src}` |\n")
    return "".join(out)


def trainer_keys_page() -> str:
    defaults = dict(profiles.flatten(load_defaults()))
    out = [GENERATED, "# Trainer keys\n\n",
           "Every key `python -m trainer` takes (what `python -m trainer --list-keys` prints), "
           "by verl's names, with the default from the YAML files under `trainer/config/`. "
           "Keys marked *compatibility only* are accepted and change no number. Which verl "
           "features are refused: [Trainer and verl](../verl-compatibility.md).\n\n"]
    section = None
    for key, type_name, help_text in describe_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            out.append(f"\n## `{top}`\n\n| key | type | default | what it sets |\n"
                       "|---|---|---|---|\n")
        value = defaults.get(key, "")
        out.append(f"| `{key}` | {_text(type_name)} | {_cell(value)} | {_text(help_text)} |\n")
    return "".join(out)


def verl_examples_page() -> str:
    data = json.loads(verl_examples.FIXTURE.read_text())
    rows = [(name, verl_examples.outcome(args)) for name, args in data["examples"].items()]
    accepted = sum(1 for _, o in rows if o == "accepted")
    out = [GENERATED, "# verl's example scripts\n\n",
           f"verl's own `examples/ppo_trainer` and `examples/grpo_trainer` scripts (verl commit "
           f"`{data['verl_commit'][:12]}`), each loaded by this trainer's config as "
           "`python -m trainer --print-config` loads it (the table "
           "`tests/trainer/test_verl_examples.py` checks): "
           f"{accepted} of {len(rows)} are accepted unchanged; the others are refused with the "
           "message below, naming the feature.\n\n| script | outcome |\n|---|---|\n"]
    for name, outcome in rows:
        out.append(f"| `{os.path.basename(name)}` | {_text(outcome)} |\n")
    return "".join(out)


def _commands(parser: argparse.ArgumentParser, prog: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prog} {name}")
    return found


def cli_page() -> str:
    os.environ["COLUMNS"] = "100"
    out = [GENERATED, "# `hpcrl` commands\n\n",
           "Each command's `--help`, as the installed `hpcrl` prints it.\n"]
    for prog, parser in _commands(build_parser(), "hpcrl"):
        out.append(f"\n## `{prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "".join(out)


PAGES = {
    "reference/site-profile-keys.md": site_profile_page,
    "reference/trainer-keys.md": trainer_keys_page,
    "reference/verl-examples.md": verl_examples_page,
    "reference/cli.md": cli_page,
}

OUT = ROOT / "docs"


def stale() -> list[str]:
    """The pages under `docs/reference/` that differ from what the code gives now."""
    return [page for page, build in PAGES.items()
            if not (OUT / page).is_file() or (OUT / page).read_text() != build()]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        for page, build in PAGES.items():
            (OUT / page).parent.mkdir(parents=True, exist_ok=True)
            (OUT / page).write_text(build())
        return 0
    if argv == ["--check"]:
        old = stale()
        if old:
            print(f"stale reference pages: {', '.join(old)}; the code they are written from changed. "
                  "Fix: python docs/gen/reference.py --write, and commit docs/reference/", file=sys.stderr)
        return 1 if old else 0
    print("usage: python docs/gen/reference.py --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
