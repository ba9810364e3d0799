""""Did you mean": the one rule for every misspelt name hpcrl or its trainer refuses (a site, a
profile key, a trainer override key). Standard library only, so that the launcher stays light and
the trainer can use it too."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, choices: Iterable[str], render: str = "`{}`") -> str:
    """`" (did you mean `x`?)"` for the closest of `choices` to `word` (difflib's ratio at least
    0.6, case ignored), or `""` when none is close: to follow the name an error refuses."""
    names = list(choices)
    by_lower = {c.lower(): c for c in names}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {render.format(by_lower[close[0]])}?)" if close else ""
