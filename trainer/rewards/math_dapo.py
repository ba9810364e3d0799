"""DAPO-Math's scorer with verl's semantics (`verl/utils/reward_score/math_dapo.py`, Minerva's
answer normalisation), for the data sources `math_dapo`, `math`, `math_dapo_reasoning` and
`aime*`.

Only the last 300 characters of the response are read. The answer is what follows the last
`Answer:` (any case) on its line; it is correct when it equals the ground truth after both pass
:func:`normalize_final_answer`. The result is `{"score": 1.0 or -1.0, "acc": bool, "pred": the
normalised answer}`: `acc` is the validation's core metric, `pred` the vote of `maj@N`.
"""

from __future__ import annotations

import re
from typing import Any

SOLUTION_CLIP_CHARS = 300
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
INVALID = "[INVALID]"

#: Replaced in this order, then the `REMOVED` strings deleted in this order (Minerva's lists).
SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
                 ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
           "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
           "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
           "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
           r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots")

#: Regex rewrites after the substitutions: keep the maths between the first two `$`, unwrap
#: `\text{}`, `\textbf{}`, `\overline{}` and `\boxed{}`, complete `\fracab` and `\sqrta`.
REWRITES = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
            (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"),
            (r"(\\boxed\{)(.*)(\})", "\\2"), (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),
            (r"(sqrt)([^{])", "sqrt{\\2}"))


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (the right-hand side of any `=`)."""
    answer = answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for text in REMOVED:
        answer = answer.replace(text, "")
    for pattern, replacement in REWRITES:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # 1,000 -> 1000
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(solution_str: str) -> str:
    """The text after the last `Answer:` in the response's last 300 characters, normalised."""
    found = re.findall(ANSWER_PATTERN, solution_str[-SOLUTION_CLIP_CHARS:])
    return normalize_final_answer(found[-1] if found else INVALID)


def compute_score(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """`{"score": 1.0 | -1.0, "acc": bool, "pred": str}` (verl's `math_dapo.compute_score`)."""
    pred = extract_answer(solution_str)
    correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
