"""The commands of `docs/quickstart-cluster.md`, as the page gives them (its ```bash blocks), and
how the lab runs each (`tests/lab/test_quickstart.py`): the page's names replaced by the lab's,
the lab's tiny-scale overrides appended to a submission. `tests/test_docs.py` checks that every
command on the page is either run by the lab test or named here with where it is tested."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "quickstart-cluster.md"

#: The page's names and the lab's, in the order they are replaced (the profile `sites new`
#: extends is the lab's own; every other site named is the one it wrote).
ON_THE_LAB = (("--extends mi300-cluster", "--extends slurmlab"), ("mycluster", "labnew"),
              ("--site mi300-cluster", "--site labnew"))

#: Commands of the page the lab test does not run, with where they are tested.
NOT_RUN_HERE = {
    'hpcrl submit --site slurmlab --nodes 2 --command -- python -c "import ray; ray.init(); print(ray.nodes())"':
        "tests/lab/test_agent.py (`--command` payloads on every node, Ray included)",
}


def page_commands(page: Path = PAGE) -> list[str]:
    """Each command line of the page's ```bash blocks, its trailing comment dropped."""
    commands, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" if not inside else False
            continue
        if inside and line.strip():
            commands.append(re.sub(r"\s+#.*$", "", line).strip())
    return commands


def on_the_lab(command: str, paths: dict[str, str]) -> list[str]:
    """`command` as the lab runs it: the page's names replaced (:data:`ON_THE_LAB`, then
    `paths`: the page's placeholder paths and the lab's), split into its argv."""
    for page, lab in (*ON_THE_LAB, *paths.items()):
        command = command.replace(page, lab)
    return shlex.split(command)
