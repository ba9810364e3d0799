"""Shared fixtures: the tiny model is built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny random Llama model and its tokenizer."""
    from trainer.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)
