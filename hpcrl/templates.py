"""Jinja2 rendering of the thin templates in `sbatch_templates/` (StrictUndefined: a missing
value is an error, never an empty string). Callers pass values already shell-quoted."""

from __future__ import annotations

import functools
from typing import Any

from hpcrl.resources import data_dir


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("sbatch_templates"))),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_template(name: str, **values: Any) -> str:
    """Render template `name` with `values`; an undefined name raises `jinja2.UndefinedError`."""
    return str(_environment().get_template(name).render(**values))
