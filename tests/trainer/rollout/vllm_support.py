"""Whether the vLLM tests can run: they skip where `vllm` is not importable, except under
CI=true with HPCRL_REQUIRE_VLLM=1 (the CI run in the vLLM virtualenv), where they fail."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_VLLM = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
                and os.environ.get("HPCRL_REQUIRE_VLLM") == "1")


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = "vLLM is not importable in this environment (`make vllm-venv` builds one)"
    if REQUIRE_VLLM:
        pytest.fail(f"{reason}, but CI=true and HPCRL_REQUIRE_VLLM=1 require it", pytrace=False)
    pytest.skip(reason)
