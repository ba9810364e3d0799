"""verl's own example scripts against this trainer's config: which load unchanged.

    python -m tests.trainer.verl_examples extract --verl-git-dir DIR   # refresh the fixture
    python -m tests.trainer.verl_examples check                        # accepted / refused table

`extract` reads every `examples/ppo_trainer/*.sh` and `examples/grpo_trainer/*.sh` of a verl
checkout, and the multi-turn scripts of `MULTI_TURN` (a bare git directory is enough: the
scripts are read from its HEAD), runs each under bash with `python3`/`python` stubbed and an
empty `PATH` (no other command runs, so the shell variables, quoting and `$HOME` expand as they
would for a user, and nothing else happens), and keeps the arguments after
`verl.trainer.main_ppo`: the overrides, and the `--config-path`/`--config-name` flags. A script
runs in the checkout's root, which is `VERL_ROOT` in the arguments kept (`$(pwd)`); the YAML
files of the `--config-path` directories are kept too. They go to `tests/data/verl_examples.json`
with the verl commit, so the tests need no verl checkout. `check` runs each through the
trainer's reading of a command line (what `python -m trainer --print-config` does) and prints
whether it is accepted, or the first refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).parents[1] / "data" / "verl_examples.json"
FOLDERS = ("examples/ppo_trainer", "examples/grpo_trainer")
#: verl's multi-turn (agent loop) examples that run through `verl.trainer.main_ppo`.
MULTI_TURN = tuple(f"examples/sglang_multiturn/{name}" for name in (
    "run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh", "run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh",
    "run_qwen2.5-3b_gsm8k_multiturn.sh", "run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh",
    "run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh"))
ENTRY = "verl.trainer.main_ppo"
#: verl's one-step-off scripts (FSDP2; the SGLang and Megatron ones aside) and their entry, kept in
#: the fixture under `async` (`python -m tests.trainer.verl_examples extract` reads them too).
ONE_STEP_OFF_ENTRY = "verl.experimental.one_step_off_policy.main_ppo"
ONE_STEP_OFF_FOLDER = "verl/experimental/one_step_off_policy/shell"
HOME = "/home/user"
#: Where the scripts run (verl's checkout, `$(pwd)`), as the arguments kept spell it.
VERL_ROOT = f"{HOME}/verl"

_STUB = r"""
command_not_found_handle() { return 0; }
source() { return 0; }
tee() { while IFS= read -r _; do :; done; return 0; }
_verl_entry() {
    local a seen=
    for a in "$@"; do
        if [ -n "$seen" ]; then printf '%s\0' "$a" >> "$VERL_ARGS_OUT"; fi
        if [ "$a" = "ENTRY" ]; then seen=1; fi
    done
    return 0
}
python3() { _verl_entry "$@"; }
python() { _verl_entry "$@"; }
""".replace("ENTRY", ENTRY)


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


def script_args(text: str, entry: str = ENTRY) -> list[str]:
    """The arguments one example script passes after its `entry` module (`verl.trainer.main_ppo`),
    as bash expands them (no command but the stubbed python runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.path.realpath(tmp)
        out = Path(tmp, "args")
        out.touch()
        script = Path(tmp, "script.sh")
        script.write_text(_STUB.replace(ENTRY, entry) + "\n" + text)
        env = {"HOME": HOME, "PATH": str(Path(tmp, "empty")), "VERL_ARGS_OUT": str(out)}
        subprocess.run(["/bin/bash", str(script)], cwd=tmp, env=env, capture_output=True,
                       timeout=30, check=False)
        raw = out.read_bytes().decode()
    return [a.replace(tmp, VERL_ROOT) for a in raw.split("\0") if a.strip()]


def extract(git_dir: Path) -> dict[str, Any]:
    commit = _git(git_dir, "rev-parse", "HEAD").strip()
    names = [name for folder in FOLDERS
             for name in sorted(_git(git_dir, "ls-tree", "--name-only", "HEAD", f"{folder}/").split())
             if name.endswith(".sh")]
    examples = {name: script_args(_git(git_dir, "show", f"HEAD:{name}")) for name in [*names, *MULTI_TURN]}
    configs: dict[str, str] = {}
    for args in examples.values():
        from trainer.config import split_config_flags

        folder, _, _ = split_config_flags(args)
        if folder is None or not folder.startswith(VERL_ROOT + "/"):
            continue  # a folder of the script's own (`config`), not read: Megatron scripts only
        rel = folder[len(VERL_ROOT) + 1:]
        for name in _git(git_dir, "ls-tree", "--name-only", "HEAD", f"{rel}/").split():
            if name.endswith(".yaml"):
                configs[name] = _git(git_dir, "show", f"HEAD:{name}")
    scripts = sorted(_git(git_dir, "ls-tree", "--name-only", "HEAD", f"{ONE_STEP_OFF_FOLDER}/").split())
    one_step_off = {name: script_args(_git(git_dir, "show", f"HEAD:{name}"), ONE_STEP_OFF_ENTRY) for name in scripts
                    if name.endswith(".sh") and "fsdp2" in name and "sglang" not in name}
    one_step_off = {name: args for name, args in one_step_off.items() if args}  # `colocate` runs main_ppo
    return {"verl_commit": commit, "examples": examples, "configs": configs, "one_step_off": one_step_off}


def outcome(args: list[str], configs: dict[str, str] | None = None) -> str:
    """`accepted`, or `refused: <the trainer's message>`; `configs`: verl's YAML files by path in
    its checkout (the fixture's), found where the arguments name `VERL_ROOT`."""
    from trainer.config import ConfigError, expand_args, load_config

    with tempfile.TemporaryDirectory() as tmp:
        for name, text in (configs or {}).items():
            Path(tmp, name).parent.mkdir(parents=True, exist_ok=True)
            Path(tmp, name).write_text(text)
        try:
            load_config(expand_args([a.replace(VERL_ROOT, tmp) for a in args]), env={})
        except ConfigError as err:
            return f"refused: {err}".replace(tmp, VERL_ROOT)
    return "accepted"


def one_step_off_outcome(args: list[str]) -> str:
    """`accepted`, or `refused: <message>`: `args` as `python -m trainer.one_step_off` reads them
    (its entry's file beneath them) and checks them at its start."""
    from trainer.config import ConfigError, check_run, expand_args, load_config
    from trainer.config.async_training import ENTRY_DEFAULTS

    try:
        check_run(load_config([*ENTRY_DEFAULTS["one_step_off"], *expand_args(args)], env={}), "one_step_off")
    except ConfigError as err:
        return f"refused: {err}"
    return "accepted"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="read verl's example scripts into the fixture")
    ex.add_argument("--verl-git-dir", type=Path, required=True)
    sub.add_parser("check", help="load each example's overrides; print accepted / refused")
    args = parser.parse_args(argv)
    if args.cmd == "extract":
        data = extract(args.verl_git_dir)
        FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{len(data['examples'])} examples of verl {data['verl_commit'][:12]} -> {FIXTURE}")
        return 0
    data = json.loads(FIXTURE.read_text())
    for name, overrides in data["examples"].items():
        print(f"{os.path.basename(name)}: {outcome(overrides, data.get('configs'))}")
    for name, overrides in data.get("one_step_off", {}).items():
        print(f"{os.path.basename(name)} (python -m trainer.one_step_off): {one_step_off_outcome(overrides)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
