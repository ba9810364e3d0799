"""The package as a user gets it: a wheel that carries its data directories, a console
script, and a launcher that needs none of torch, ray or vllm."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "vllm", "transformers")

# Run a snippet with the heavy packages made unimportable, as on a login node's base install.
BLOCK_HEAVY = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {HEAVY!r}:
            raise ImportError(f'{{name}} is not installed on this login node')
sys.meta_path.insert(0, Block())
"""


def test_base_dependencies_exclude_heavy_packages():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = " ".join(meta["dependencies"]).lower()
    assert not [h for h in HEAVY if h in base], meta["dependencies"]
    assert {"train", "vllm", "dev"} <= set(meta["optional-dependencies"])
    assert meta["scripts"]["hpcrl"] == "hpcrl.cli:main"


def test_help_works_without_heavy_packages():
    code = BLOCK_HEAVY + "import sys; from hpcrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n    sys.exit(e.code)\n"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "usage: hpcrl" in res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, capture_output=True)  # fmt: skip
    return next(out.glob("hpcrl-*.whl"))


def test_wheel_ships_packages_and_data_dirs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for top in ("hpcrl/cli.py", "trainer/__init__.py", "hpcrl/py.typed"):
        assert top in names, top
    for init in [*REPO.glob("hpcrl/**/__init__.py"), *REPO.glob("trainer/**/__init__.py")]:
        rel = init.relative_to(REPO).as_posix()
        assert rel in names, f"{rel} is missing from the wheel: add its package to pyproject.toml"
    for defaults in REPO.glob("trainer/config/*.yaml"):  # the trainer's defaults, one file a section
        rel = defaults.relative_to(REPO).as_posix()
        assert rel in names, f"{rel} is missing from the wheel: add it to pyproject.toml's package-data"
    for data in ("sbatch_templates", "site_profiles", "containers"):
        src = sorted(p.name for p in (REPO / data).iterdir() if p.is_file() and not p.name.startswith("."))
        shipped = sorted(n.split("/")[-1] for n in names if n.startswith(f"hpcrl/_data/{data}/"))
        assert src == shipped, f"{data}: in tree {src}, in wheel {shipped}"


def test_installed_wheel_finds_its_data(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    code = BLOCK_HEAVY + (
        "from hpcrl.resources import data_dir, DATA_DIRS\n"
        "for d in DATA_DIRS: print(data_dir(d))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert res.returncode == 0, res.stderr
    for line in res.stdout.split():
        assert line.startswith(str(target / "hpcrl" / "_data")), res.stdout
