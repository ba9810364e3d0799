"""GSM8K scorer with verl's semantics (`verl/utils/reward_score/gsm8k.py`).

Only the last 300 characters of the response are searched. Strict mode needs `#### <number>`
(the last one counts; commas and `$` stripped); flexible mode takes the last number anywhere.
A found answer equal to the ground truth scores `score`, a found but wrong one `format_score`,
no answer 0.
"""

from __future__ import annotations

import re
from typing import Literal

SOLUTION_CLIP_CHARS = 300
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""What verl's GSM8K preprocessing appends to every question."""


def extract_solution(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer in `solution_str`, or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"GSM8K extraction `method`={method!r}; use `strict` or `flexible`")
    if len(solution_str) > SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
        if not solutions:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    final_answer = None
    for final_answer in reversed(re.findall(r"(\-?[0-9\.\,]+)", solution_str)):
        if final_answer not in ("", "."):
            break
    return final_answer


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
