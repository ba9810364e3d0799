"""`arith`: short arithmetic word problems, generated from a fixed seed, in verl's GSM8K format.

A real verifiable task small enough for a 135M model on CPU: one- and two-step problems with
numbers below 50 whose answers need a few words, not a page. The prompt asks for the final
answer after `####`, as verl's GSM8K prompt does.

Reward (format + correctness): 1.0 when the response's final answer is right, where the final
answer is the number after the last `####`, or, with no `####`, the last number of the response;
a right answer without `####` scores `1.0 - FORMAT_PENALTY`. A wrong or missing answer scores 0.
Validation accuracy counts right final answers whatever the format (`acc` in the metrics).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.data import write_generated
from trainer.rewards.gsm8k import INSTRUCTION, extract_solution

ARITH = "hpcrl/arith"
FORMAT_PENALTY = 0.2

_NAMES = ("Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Max", "Eva", "Ben", "Ivy")
_THINGS = ("apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells")


def _add(rng: random.Random) -> tuple[str, int]:
    n, t, a, b = rng.choice(_NAMES), rng.choice(_THINGS), rng.randint(2, 49), rng.randint(2, 49)
    return f"{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?", a + b


def _sub(rng: random.Random) -> tuple[str, int]:
    n, t = rng.choice(_NAMES), rng.choice(_THINGS)
    a = rng.randint(10, 49)
    b = rng.randint(1, a - 1)
    return f"{n} has {a} {t}. {n} gives away {b} {t}. How many {t} does {n} have left?", a - b


def _mul(rng: random.Random) -> tuple[str, int]:
    n, t, a, b = rng.choice(_NAMES), rng.choice(_THINGS), rng.randint(2, 9), rng.randint(2, 12)
    return f"{n} has {a} boxes with {b} {t} in each box. How many {t} does {n} have?", a * b


def _two_step(rng: random.Random) -> tuple[str, int]:
    n, t = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(5, 40), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    return (f"{n} has {a} {t}, buys {b} more and then gives {c} to a friend. "
            f"How many {t} does {n} have now?"), a + b - c


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "two_step": _two_step,
}


def arith_row(rng: random.Random, index: int, split: str) -> dict[str, Any]:
    kind = rng.choice(sorted(KINDS))
    question, answer = KINDS[kind](rng)
    return {
        "data_source": ARITH,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "kind": kind, "question": question},
    }


def arith_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    rng = random.Random(f"arith-{seed}-{split}")
    return [arith_row(rng, i, split) for i in range(n)]


def final_answer(solution_str: str) -> tuple[str | None, bool]:
    """(the response's final answer, whether it came after `####`)."""
    strict = extract_solution(solution_str, "strict")
    if strict is not None:
        return strict, True
    return extract_solution(solution_str, "flexible"), False


def arith_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    answer, formatted = final_answer(solution_str)
    correct = answer is not None and _same_number(answer, ground_truth)
    score = (1.0 if formatted else 1.0 - FORMAT_PENALTY) if correct else 0.0
    return {"score": score, "acc": float(correct), "formatted": float(formatted)}


def _same_number(answer: str, truth: str) -> bool:
    try:
        return float(answer) == float(truth)
    except ValueError:
        return False


def write_arith(output_dir: str | Path, *, train_size: int, val_size: int, seed: int) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` of the task in verl's format."""
    return write_generated(output_dir, arith_rows, train_size=train_size, val_size=val_size, seed=seed)
