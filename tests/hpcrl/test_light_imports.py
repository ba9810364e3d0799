"""The launcher stays light: `hpcrl --help`, `hpcrl render` and `hpcrl sites` import no torch,
ray or vllm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "ray", "vllm", "transformers")
PROBE = """
import json, sys
from hpcrl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["sites"],
    ["render", "--site", "mi300-cluster", "--no-prepare", "--", "trainer.nnodes=2",
     "critic.ppo_micro_batch_size_per_gpu=4"],
    ["render", "--site", "slurmlab-apptainer", "--no-prepare", "--", "critic.ppo_micro_batch_size_per_gpu=4"],
    ["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--",
     "trainer.nnodes=2", "critic.ppo_micro_batch_size_per_gpu=4"],
])
def test_no_heavy_imports(argv: list[str], tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=set(HEAVY)), *argv],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["code"] in (0, None), proc.stderr
    assert result["heavy"] == [], f"`hpcrl {' '.join(argv)}` imported {result['heavy']}"
