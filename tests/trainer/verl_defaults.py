"""verl's own generated config (`verl/trainer/config/_generated_ppo_trainer.yaml`) against this
trainer's config: every leaf key set to its own default, one at a time.

    python -m tests.trainer.verl_defaults             # counts per verl version
    python -m tests.trainer.verl_defaults --list      # and every key not accepted, with why

The files are kept under `tests/data/verl_config/` (verl 0.9.1's, and that of the verl commit
followed before, b178a3cd). A leaf is a key whose value is not a non-empty mapping (an empty
mapping `{}` is a leaf); `_target_` keys (verl's dataclass names) are not keys of the config;
interpolations (`${...}`) are skipped: they name other keys and are no default of their own; so
are OmegaConf's mandatory values (`???`, `rollout.name`: verl has no default there). Each leaf is
given to `load_config` as the `--config-name` file would give it (an `Override` of that value),
over verl's `trainer.n_gpus_per_node=8` (`HPCRL_GPUS_PER_NODE=8`: verl's default
`rollout.tensor_model_parallel_size=2` needs more than one rank), and judged: `accepted`, `unknown` (an unknown-key error), `refused` (a feature
named as not supported) or `other` (another error, e.g. a value of the wrong type).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from trainer.config import GPUS_ENV, ConfigError, Override, load_config

DATA = Path(__file__).parents[1] / "data" / "verl_config"
#: verl version (or commit) -> its generated config.
VERSIONS = {"0.9.1": DATA / "ppo_trainer_0.9.1.yaml", "b178a3cd": DATA / "ppo_trainer_b178a3cd.yaml"}


def verl_tree(version: str) -> dict[str, Any]:
    return yaml.safe_load(VERSIONS[version].read_text())


def leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf, `_target_` keys left out."""
    for key, value in tree.items():
        if key == "_target_":
            continue
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def is_mandatory(value: Any) -> bool:
    """OmegaConf's `???`: a value verl requires the user to give (no default)."""
    return value == "???"


#: verl's default world: one node of 8 GPUs.
VERL_ENV = {GPUS_ENV: "8"}


def as_override(key: str, value: Any) -> Override:
    """The leaf as a `--config-name` file's key gives it to the loader."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return Override(item=f"{key}={text} (verl's default)", key=key, op="set", value=value, text=None)


def judge(key: str, value: Any) -> str:
    """`accepted`, or `unknown: ...`, `refused: ...`, `other: ...` with the message."""
    try:
        load_config([as_override(key, value)], env=VERL_ENV)
    except ConfigError as err:
        msg = str(err)
        kind = "unknown" if "unknown key" in msg else "refused" if "not supported" in msg else "other"
        return f"{kind}: {msg}"
    return "accepted"


def outcomes(version: str) -> dict[str, str]:
    """Each non-interpolated leaf of `version`'s config -> its judgement."""
    return {key: judge(key, value) for key, value in leaves(verl_tree(version))
            if not is_interpolation(value) and not is_mandatory(value)}


def counts(version: str, judged: dict[str, str] | None = None) -> dict[str, int]:
    """The leaves, interpolations and mandatory values of `version`'s config, and its outcomes
    by kind; `judged`: its :func:`outcomes` when already at hand (judging every leaf loads the
    config once per leaf, several hundred times)."""
    all_leaves = list(leaves(verl_tree(version)))
    judged = outcomes(version) if judged is None else judged
    found = Counter(o.split(":", 1)[0] for o in judged.values())
    return {"leaves": len(all_leaves),
            "interpolations": sum(is_interpolation(v) for _, v in all_leaves),
            "mandatory": sum(is_mandatory(v) for _, v in all_leaves),
            **{k: found.get(k, 0) for k in ("accepted", "unknown", "refused", "other")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every key not accepted")
    args = parser.parse_args(argv)
    for version in VERSIONS:
        judged = outcomes(version)
        print(version, counts(version, judged))
        if args.list:
            for key, result in judged.items():
                if result != "accepted":
                    print(f"  {key}: {result[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
