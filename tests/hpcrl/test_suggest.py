"""`hpcrl.suggest.did_you_mean`, and the misspelt site and profile keys it answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.profile_load import load_profile
from hpcrl.profiles import ProfileError
from hpcrl.suggest import did_you_mean


def test_the_closest_name_or_nothing() -> None:
    assert did_you_mean("trainr", ["trainer", "data"]) == " (did you mean `trainer`?)"
    assert did_you_mean("Slrum", ["slurm", "ray"]) == " (did you mean `slurm`?)"  # case ignored, kept
    assert did_you_mean("xyz", ["trainer", "data"]) == ""
    assert did_you_mean("nodes", []) == ""
    assert did_you_mean("gpu", ["gpus"], "`slurm.{}`") == " (did you mean `slurm.gpus`?)"


def test_a_misspelt_site_is_answered_with_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ProfileError) as err:
        load_profile("locl", environ={"HPCRL_SITE_PATH": str(tmp_path)})
    assert "no site profile `locl` (did you mean `local`?);" in str(err.value)
    assert "known profiles:" in str(err.value)


def test_a_misspelt_profile_key_is_answered_with_the_closest(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("extends: local\nslurm:\n  partiton: gpu\n")
    with pytest.raises(ProfileError) as err:
        load_profile("mine", environ={"HPCRL_SITE_PATH": str(tmp_path)})
    assert "unknown key `slurm.partiton` (did you mean `slurm.partition`?); valid keys" in str(err.value)
