"""The MATH scorer with verl's semantics (`verl/utils/reward_score/math_reward.py`, after the
Hendrycks MATH / lm-evaluation-harness normalisation), for `lighteval/MATH`,
`DigitalLearningGmbH/MATH-lighteval` and `HuggingFaceH4/MATH-500`.

The answer is the content of the last `\\boxed{...}` (or `\\boxed ...` up to a `$`) in the
response; it scores 1 when it equals the ground truth after both pass :func:`strip_string`, else
0. A response whose last box cannot be unwrapped (an `\\fbox{...}`) scores 0; a string the
normaliser cannot handle (a `\\sqrt` or `\\frac` with nothing after it, two `\\text{ ` units) is
compared as written.
"""

from __future__ import annotations

from typing import Any

BOXED = "\\boxed"


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` of `text` with its braces balanced (or the last `\\boxed ...`
    up to a `$`, or the last `\\fbox{...}` when there is no box), None when there is none or
    its braces never close."""
    if BOXED + " " in text:
        return BOXED + " " + text.split(BOXED + " ")[-1].split("$")[0]
    start = text.rfind(BOXED)
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The content of `\\boxed{content}` or `\\boxed content`; ValueError for anything else."""
    if BOXED + " " in boxed:
        if not boxed.startswith(BOXED + " "):
            raise ValueError(f"not a box: {boxed!r}")
        return boxed[len(BOXED) + 1 :]
    if not (boxed.startswith(BOXED + "{") and boxed.endswith("}")):
        raise ValueError(f"not a box: {boxed!r}")
    return boxed[len(BOXED) + 1 : -1]


def _fix_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (IndexError on a `\\sqrt` with nothing after it, as verl)."""
    if "\\sqrt" not in s:
        return s
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; a `\\frac` followed by one
    character leaves the string as it was."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b if b == "{" else "{" + b + "}") + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` for plain integers written canonically."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    """Drop a trailing `\\text{ unit}`; two of them is an error (compared as written)."""
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one unit in {s!r}")
    return parts[0]


def strip_string(s: str) -> str:
    """The MATH answer normalisation, step by step in verl's order."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _remove_right_units(s)
    for old, new in (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0.")):
        s = s.replace(old, new)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `k = 3` -> `3`
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a: Any, b: Any) -> bool:
    """Equal after :func:`strip_string`; compared as given where the normaliser fails."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return strip_string(a) == strip_string(b)
    except Exception:  # noqa: BLE001 - any failure of the normaliser: compare the raw strings
        return a == b


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer of `solution_str` is equivalent to `ground_truth`."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
