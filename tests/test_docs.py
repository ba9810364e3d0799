"""The documentation site builds, strictly, from docs/ and the code.

`mkdocs build --strict` (what `make docs` runs) fails on any warning: a link to a page or anchor
that does not exist, a page left out of the navigation, a reference generator
(`docs/gen/reference.py`) that raises because the code it reads changed. The build runs here so
that every CI run builds the site; it needs the `docs` extra (the Makefile's venv installs it)
and skips without it, except under CI=true, where it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CI, REPO


def _need_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocs_gen_files")
               if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"the docs extra is not installed (missing {', '.join(missing)}): pip install -e '.[docs]'"
        if CI:
            pytest.fail(f"required under CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


def test_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    _need_mkdocs()
    # the theme's and mkdocs' banners about mkdocs 2 are no warning of this site's
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\s+-", line)]
    assert proc.returncode == 0 and not warnings, log
    for page in ("reference/site-profile-keys", "reference/trainer-keys",
                 "reference/verl-examples", "reference/cli"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
    _reference_names_everything(tmp_path / "site" / "reference")


def test_committed_reference_pages_are_what_the_code_gives() -> None:
    """`docs/reference/*.md` are committed (the repository's view shows them) and written from
    the code: a key, a profile, a verl example or a command changed without `--write` fails."""
    proc = subprocess.run([sys.executable, "docs/gen/reference.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr


def test_relative_links_of_the_repository_view_resolve() -> None:
    """Every relative link and image of the README, `docs/*.md` and `bench/README.md` names a
    file of the repository, as the repository's web view follows it (not only the built site)."""
    dead = []
    for page in [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md")),
                 *sorted((REPO / "docs" / "reference").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                dead.append(f"{page.relative_to(REPO)} -> {target}")
    assert not dead, dead


def _reference_names_everything(ref: Path) -> None:
    """Each trainer key, site-profile key, verl example and hpcrl command has its row."""
    from hpcrl.cli import COMMANDS
    from hpcrl.profiles import SiteProfile, flatten, profile_to_dict
    from tests.trainer.verl_examples import FIXTURE
    from trainer.config.load import describe_keys

    def shown(page: str) -> str:
        return (ref / page / "index.html").read_text()

    trainer_page = shown("trainer-keys")
    assert all(f"<code>{key}</code>" in trainer_page for key, _, _ in describe_keys())
    profile_page = shown("site-profile-keys")
    keys = [k for k, _ in flatten(profile_to_dict(SiteProfile(name="x")))]
    assert [k for k in keys if f"<code>{k}</code>" not in profile_page] == []
    examples = json.loads(FIXTURE.read_text())["examples"]
    assert all(f"<code>{Path(name).name}</code>" in shown("verl-examples") for name in examples)
    assert all(f"<code>hpcrl {name}</code>" in shown("cli") for name in COMMANDS)


# ----------------------------------------------------------------------------- commands shown

COMMANDS_DOC = """Every command shown in a `bash` code block of README.md and docs/*.md parses.

How a block is read: lines ending in `\\` are joined; each line is split as the shell splits it
(`shlex`, comments dropped) into commands at `&&`, `||`, `;` and `|`; a redirection (`> FILE`)
and leading `NAME=value` assignments are dropped; `...` stands for "the rest" and is dropped.
Each command is then checked by its program:

- `hpcrl ARGS` and `python -m hpcrl ARGS`: `hpcrl.cli.build_parser().parse_args(ARGS)`, nothing
  run; for `submit` and `render`, the `--site` profile must load, and (without `--command`) the
  trainer overrides after `--` must load with the trainer's config loader (`load_config`: keys,
  values, verl's grammar; files and models are not looked for);
- `python -m trainer ARGS`: the trainer's own parser (`trainer.__main__.build_parser`), then the
  overrides through `load_config`;
- `python -m pytest ARGS`: each path exists, each `-m` marker is registered in pyproject.toml,
  `-p` names `randomly` or `no:randomly`;
- `python -m MODULE ARGS` (any other module of the repository: `tests.lab`, `bench.*`,
  `hpcrl.demo`): the module runs as `__main__` until its `ArgumentParser.parse_args`, which
  parses ARGS and stops it there;
- `python -c CODE`: CODE compiles;
- `make TARGET`: TARGET is a target of the Makefile;
- `pip install REQ`: a requirement naming hpcrl (`hpcrl[x]`, `.[x]`) names extras that
  pyproject.toml declares;
- `bash FILE`: FILE exists;
- Slurm's, Hugging Face's and the shell's own commands (`sbatch`, `squeue`, `sinfo`,
  `scontrol`, `hf`, `eval`, `git`) are not checked; any other program fails the test, so that
  a new kind of command gets a rule here.
Python is `python`, `python3` or any `.../bin/python`. Running each command where the lab could
run it is not done here.
"""

import argparse  # noqa: E402
import runpy  # noqa: E402
import shlex  # noqa: E402
import tomllib  # noqa: E402

SKIPPED = {"sbatch", "squeue", "sinfo", "scontrol", "hf", "eval", "git"}
OPERATORS = {"&&", "||", ";", "|", "&"}


def shown_commands(text: str) -> list[list[str]]:
    """The commands of the `bash` code blocks of one Markdown text (see COMMANDS_DOC)."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            current: list[str] = []
            redirect = False
            for token in lexer:
                if token in OPERATORS:
                    commands.append(current)
                    current, redirect = [], False
                elif token in (">", ">>", "<", "2>"):
                    redirect = True
                elif redirect:
                    redirect = False
                elif token == "..." or (not current and re.match(r"^[A-Za-z_]\w*=", token)):
                    continue
                else:
                    current.append(token)
            commands.append(current)
    return [c for c in commands if c]


class _Parsed(Exception):
    """Raised by the patched `parse_args` once a module's arguments parsed."""


PARSE_ENTRIES = ("parse_args", "parse_known_args", "parse_intermixed_args",
                 "parse_known_intermixed_args")


def _check_module(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `python -m module args` up to the end of its outermost argparse call (whichever
    entry it uses: the intermixed ones call the others, subparsers call `parse_known_args`), and
    stop it there; a module that starts a process before parsing fails instead of running it."""
    depth = [0]

    def stopping(name: str):  # noqa: ANN202
        original = getattr(argparse.ArgumentParser, name)

        def parse(self: argparse.ArgumentParser, *a: object, **k: object) -> object:
            depth[0] += 1
            try:
                result = original(self, *a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed
            return result
        return parse

    def no_process(*a: object, **k: object) -> None:
        raise AssertionError(f"`python -m {module}` starts a process before parsing its arguments")

    with monkeypatch.context() as m:
        for name in PARSE_ENTRIES:
            m.setattr(argparse.ArgumentParser, name, stopping(name))
        m.setattr(subprocess.Popen, "__init__", no_process)
        m.setattr(sys, "argv", [module, *args])
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except _Parsed:
            return
    raise AssertionError(f"`python -m {module}` ended without parsing arguments")


def _check_overrides(overrides: list[str]) -> None:
    from trainer.config import load_config

    load_config(overrides, env={})


def _check_hpcrl(args: list[str], home: Path) -> None:
    from hpcrl.cli import build_parser
    from hpcrl.profile_load import load_profile

    ns = build_parser().parse_args(args)
    if ns.command not in ("submit", "render"):
        return
    load_profile(ns.site or "local", {"HOME": str(home), "PATH": os.environ.get("PATH", "")})
    payload = [a for a in ns.payload if a != "--"]
    if not ns.whole_command and payload:
        _check_overrides(payload)


def _check_trainer(args: list[str]) -> None:
    from trainer.__main__ import build_parser

    _check_overrides(build_parser().parse_args(args).overrides)


def _check_pytest(args: list[str]) -> None:
    markers = {m.split(":")[0] for m in tomllib.loads((REPO / "pyproject.toml").read_text())
               ["tool"]["pytest"]["ini_options"]["markers"]}
    it = iter(args)
    for arg in it:
        if arg == "-m":
            words = set(re.findall(r"\w+", next(it))) - {"and", "or", "not"}
            assert words <= markers, f"unregistered markers {words - markers}"
        elif arg == "-p":
            assert next(it) in ("randomly", "no:randomly")
        elif arg.startswith("--randomly-seed="):
            continue
        else:
            assert not arg.startswith("-"), f"unexpected pytest option {arg}"
            assert (REPO / arg.split("::")[0]).exists(), f"{arg} does not exist"


def _check_pip(args: list[str]) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for req in args:
        found = re.match(r"^(hpcrl|\.)\[([\w,]+)\]$", req)
        if found:
            assert set(found.group(2).split(",")) <= set(extras), f"unknown extra in {req}"


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))


def check_command(cmd: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raise when `cmd` (one command of a code block) does not parse (see COMMANDS_DOC)."""
    program, args = cmd[0], cmd[1:]
    if program in ("python", "python3") or program.endswith("/bin/python"):
        if args[:1] == ["-c"]:
            compile(args[1], "<-c>", "exec")
            return
        assert args[:1] == ["-m"], f"`{shlex.join(cmd)}`: python without -m or -c"
        program, args = args[1], args[2:]
        if program not in ("hpcrl", "trainer", "pytest"):
            _check_module(program, args, monkeypatch)
            return
    if program == "hpcrl":
        _check_hpcrl(args, home)
    elif program == "trainer":
        _check_trainer(args)
    elif program == "pytest":
        _check_pytest(args)
    elif program == "make":
        targets = [a for a in args if "=" not in a]
        assert set(targets) <= _make_targets(), f"no Makefile target {set(targets) - _make_targets()}"
    elif program == "pip":
        assert args[:1] == ["install"]
        _check_pip(args[1:])
    elif program == "bash":
        assert (REPO / args[0]).is_file(), f"{args[0]} does not exist"
    else:
        assert program in SKIPPED, f"no rule for the program `{program}`: add one to {__name__}"


def _shown_in(path: Path) -> list[list[str]]:
    return shown_commands(path.read_text())


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]


def test_commands_shown_in_the_docs_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checked, failures = 0, []
    for page in PAGES:
        for cmd in _shown_in(page):
            try:
                check_command(cmd, tmp_path, monkeypatch)
            except (Exception, SystemExit) as exc:  # argparse exits on a bad argument
                failures.append(f"{page.relative_to(REPO)}: `{shlex.join(cmd)}`: "
                                f"{type(exc).__name__}: {exc}")
            checked += 1
    assert checked >= 30, f"only {checked} commands found: is the block parser broken?"
    assert not failures, "\n".join(failures)


test_commands_shown_in_the_docs_parse.__doc__ = COMMANDS_DOC


@pytest.mark.parametrize("cmd", [
    ["hpcrl", "submit", "--nodse", "2"],                           # a misspelt flag
    ["python", "-m", "trainer", "data.train_batch_sise=64"],       # a misspelt trainer key
    ["hpcrl", "submit", "--site", "no-such-site", "--", "data.train_batch_size=64"],
    ["make", "no-such-target"],
    ["python", "-m", "tests.lab", "up", "--nodez", "3"],
    ["python", "-m", "bench.learning", "base", "--stepz", "3"],      # parse_intermixed_args
    ["python", "-m", "pytest", "-m", "not lab and not flaky"],
    ["pip", "install", "hpcrl[no_such_extra]"],
    ["curl", "http://example.org"],
])
def test_a_command_that_does_not_parse_is_caught(cmd: list[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises((Exception, SystemExit)):
        check_command(cmd, tmp_path, monkeypatch)


def test_blocks_are_split_as_the_shell_splits_them() -> None:
    text = ("```bash\nHOME=/tmp/h .venv/bin/python -m hpcrl render --site x -- ... > job.sbatch "
            "&& sbatch job.sbatch   # plain Slurm\nmake demo \\\n  DEMO_ARGS='--steps 4'\n```\n"
            "```text\nnot a command\n```\n")
    assert shown_commands(text) == [
        [".venv/bin/python", "-m", "hpcrl", "render", "--site", "x", "--"],
        ["sbatch", "job.sbatch"],
        ["make", "demo", "DEMO_ARGS=--steps 4"],
    ]


def _runs_safely(cmd: list[str]) -> list[str] | None:
    """The argv to run for a shown command that creates nothing and queues nothing (`hpcrl
    sites`, `hpcrl submit|render ... --dry-run`, `python -m trainer --print-config|--list-keys`),
    run with this Python; None for every other command."""
    if cmd[0] in ("python", "python3") or cmd[0].endswith("/bin/python"):
        cmd = cmd[2:] if cmd[1:2] == ["-m"] else cmd
    program, args = cmd[0], cmd[1:]
    head = args[:args.index("--")] if "--" in args else args
    if program == "hpcrl" and ((args[:1] == ["sites"] and args[1:2] != ["new"]) or "--dry-run" in head):
        return [sys.executable, "-m", "hpcrl", *args]
    if program == "trainer" and {"--print-config", "--list-keys"} & set(args):
        return [sys.executable, "-m", "trainer", *args]
    return None


def test_commands_shown_that_create_nothing_run() -> None:
    """Beyond parsing: each shown command that creates and queues nothing (a dry run, the
    trainer's printed config or keys, the list of sites) runs and exits 0. The others need a
    model, data, a Slurm cluster or the lab, and are only parsed (above)."""
    ran, failures = 0, []
    for page in PAGES:
        for cmd in _shown_in(page):
            argv = _runs_safely(cmd)
            if argv is None:
                continue
            proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                                  timeout=300, check=False, env={**os.environ, "HPCRL_SITE": ""})
            ran += 1
            if proc.returncode != 0:
                failures.append(f"{page.relative_to(REPO)}: `{shlex.join(cmd)}` exited "
                                f"{proc.returncode}: {proc.stderr[-800:]}")
    assert ran >= 4, f"only {ran} commands ran"
    assert not failures, "\n".join(failures)


def test_the_quickstart_pages_commands_are_the_ones_its_lab_test_runs() -> None:
    """`tests/lab/test_quickstart.py` runs `docs/quickstart-cluster.md`'s commands as the page
    gives them (read from the page); every other command of the page is named with where it is
    tested, so a command added to the page is either run there or accounted for here."""
    from tests.quickstart_page import NOT_RUN_HERE, page_commands

    test = (REPO / "tests" / "lab" / "test_quickstart.py").read_text()
    ran = re.findall(r'page\.(?:run|start|argv)\("([^"]+)"', test)
    commands = page_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        runs = [prefix for prefix in ran if command.startswith(prefix)]
        assert runs or command in NOT_RUN_HERE, f"`{command}` is on the quickstart page, run by no test"
    for prefix in ran:
        assert sum(c.startswith(prefix) for c in commands) == 1, f"`{prefix}` names no single command of the page"
    for command in NOT_RUN_HERE:
        assert command in commands, f"`{command}` is no longer on the page"


def test_the_readmes_headline_figures_are_the_recorded_ones() -> None:
    """The README's table of headline figures is the record's (`make figures` writes both), every
    figure is recorded, each at a commit, and the README's prose names no figure's old value."""
    from bench import headline

    record = headline.read_rows((REPO / "bench" / "README.md").read_text())
    readme_text = (REPO / "README.md").read_text()
    readme = headline.read_rows(readme_text)
    # `learning` (3 seeds and TRL, about 75 minutes) is recorded when `make figures` has run it at a
    # commit; until then the README quotes the 3-seed record with its commits instead
    missing = set(headline.FIGURES) - set(record)
    assert set(record) <= set(headline.FIGURES) and missing <= {"learning"}, f"not recorded: {missing}: make figures"
    assert readme == record, "the README's headline table differs from bench/README.md's: make figures writes both"
    for figure, row in record.items():
        assert re.fullmatch(r"[0-9a-f]{7,}", row.commit), f"`{figure}` names no commit: {row.commit!r}"
        assert f"`{figure}`" in readme_text.split(headline.BEGIN)[0] + readme_text.split(headline.END)[1], (
            f"the README's prose does not refer to the `{figure}` figure")


def test_recording_figures_replaces_the_measured_rows_and_keeps_the_others() -> None:
    from bench import headline

    old = {f: headline.Row(f, f"old {f}", "1111111", "2026-01-01", "1.0, 2") for f in ("demo", "stop")}
    text = "# B\n\n" + headline.section(old) + "\n\n## after\n"
    new = {"stop": headline.Row("stop", "2 nodes: 30.1 s", "2222222", "2026-02-02", "3.0, 2"),
           "memory-plan": headline.Row("memory-plan", "W=1: 0.99", "2222222", "2026-02-02", "3.0, 2")}
    rows = headline.read_rows(headline.write_rows(text, new))
    assert rows == {"demo": old["demo"], **new}
    assert headline.write_rows(text, new).endswith("\n\n## after\n") and text.startswith("# B")
    with pytest.raises(SystemExit, match="no `<!-- headline:begin -->`"):
        headline.write_rows("# no section\n", new)


def test_the_learning_figure_reads_the_seeds_runs_and_trl_s_scored_checkpoint(tmp_path: Path) -> None:
    """`make figures`' `learning`: the seeds' validations as `bench.learning run` logs them, TRL's
    budget (the job's wall less its validations) and its scored checkpoint, into the README's words."""
    import json

    from bench import headline
    from bench import learning as L

    def log(seed: int, rows: list[dict]) -> None:
        run = tmp_path / f"fp32-s{seed}" / "run"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    val = lambda step, acc, t: {"step": step, L.ACC: acc, L.ACC_SEM: 0.02, "timing_s/testing": t}  # noqa: E731
    log(1, [val(0, 0.129, 60.0), {"step": 1, "actor/pg_loss": 0.1}, val(10, 0.184, 50.0)])
    log(2, [{"step": 1, "actor/pg_loss": 0.1}, val(10, 0.230, 50.0)])
    log(3, [val(10, 0.141, 50.0)])
    (tmp_path / "fp32-s1" / "run-wall.json").write_text(json.dumps({"wall_s": 900.0}))
    (tmp_path / "fp32-s1" / "trl-eval.json").write_text(json.dumps([{"step": 7, "wall_s": 760.0, "acc": 0.1, "sem": 0.019}]))
    assert headline.budget_s(tmp_path / "fp32-s1") == 790.0  # 900 s less the two validations
    got = headline.learning_result(tmp_path)
    assert got["base"] == 0.129 and round(got["mean"], 3) == 0.185 and round(got["sd"], 3) == 0.045
    assert headline.learning_value(got, 790.0 / 60) == (
        "SmolLM2-135M, 3 seeds x 10 GRPO steps, vLLM: validation 0.129 -> mean 0.185 (seeds 0.184 ± 0.020, "
        "0.230 ± 0.020, 0.141 ± 0.020), sd over seeds 0.045; TRL GRPOTrainer, HF generate, in seed 1's 13.2 min: "
        "7 steps, 0.100 ± 0.019 (checkpoint at 12.7 min)")
    log(4, [])
    (tmp_path / "fp32-s3" / "run" / "metrics.jsonl").write_text(json.dumps(val(0, 0.129, 60.0)) + "\n")
    with pytest.raises(SystemExit, match="seed 3's run logged no validation after training"):
        headline.learning_result(tmp_path)


def test_the_first_step_picture_is_drawn_from_the_recorded_headline_row(tmp_path: Path) -> None:
    """docs/img/first_step.png shows the `first-step` row `make figures` recorded (and redraws)."""
    from bench import figures, headline

    data, commit = figures.headline_first_step((REPO / "bench" / "README.md").read_text())
    row = headline.read_rows((REPO / "bench" / "README.md").read_text())["first-step"]
    assert commit == row.commit and set(data) >= {2, 3}, (data, row)
    for n, seconds in data.items():
        assert f"N={n}: hpcrl {seconds['hpcrl']:.1f} s, symmetric-run {seconds['symm.']:.1f} s" in row.value
    out = tmp_path / "first_step.png"
    figures.draw_first_step(data, commit, out)
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no `first-step` row"):
        figures.headline_first_step("no headline here")
