"""Toy tasks that a tiny model learns in a few PPO steps on a CPU.

`toy_digits`: the prompt asks for sevens; the reward is the share of the first
`TOY_DIGITS_WINDOW` response tokens that are `7`. Prompts use only whitespace-separated
tokens from the digits, `####` and the words `copy say sevens the digit answer`, which the
tiny tokenizer (`trainer.tiny`) has in its vocabulary.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from trainer.data import write_generated

TOY_DIGITS = "toy_digits"
TOY_DIGITS_WINDOW = 4
PROMPT_WORDS = ("copy", "say", "sevens", "the", "digit", "answer")
# Units of a response: `####`, single digits, words, single punctuation marks.
_UNITS = re.compile(r"####|[0-9]|[^\W\d_]+|[^\w\s]")


def response_units(text: str) -> list[str]:
    return _UNITS.findall(text)


def toy_digits_score(solution_str: str) -> float:
    """Share of the first 4 units of the response that are `7` (missing units count as not 7)."""
    head = response_units(solution_str)[:TOY_DIGITS_WINDOW]
    return sum(unit == "7" for unit in head) / TOY_DIGITS_WINDOW


def toy_digits_row(rng: random.Random, index: int, split: str) -> dict[str, Any]:
    digits = " ".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 4)))
    lead = rng.choice(["say sevens", "say the digit", "copy the digit", "answer"])
    content = f"{lead} {digits} ####"
    return {
        "data_source": TOY_DIGITS,
        "prompt": [{"role": "user", "content": content}],
        "ability": "toy",
        "reward_model": {"style": "rule", "ground_truth": " ".join(["7"] * TOY_DIGITS_WINDOW)},
        "extra_info": {"split": split, "index": index},
    }


def toy_digits_rows(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-{split}")
    return [toy_digits_row(rng, i, split) for i in range(n)]


def write_toy_digits(output_dir: str | Path, *, train_size: int, val_size: int, seed: int) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` of the toy task in verl's format."""
    return write_generated(output_dir, toy_digits_rows, train_size=train_size, val_size=val_size, seed=seed)
