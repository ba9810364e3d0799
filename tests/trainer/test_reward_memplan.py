"""The memory plan counts a discriminative reward model: its weights (bf16 on a GPU unless
`reward_model.rollout.dtype` says otherwise) on each actor rank's
device while it scores (a phase of its own, next to what the trainer holds), and asleep in each
actor worker's host memory between scorings."""

from __future__ import annotations

import pytest

# these plans trace `FLAGSHIP`'s update too: once in the run, by the trace cache (tests/conftest.py)
from tests.trainer.test_memplan import CONFIGS, FLAGSHIP
from trainer.config import load_config
from trainer.memplan import GIB, plan_config

RM = CONFIGS / "Qwen2.5-0.5B"


def test_the_reward_model_is_counted_on_the_device_and_the_host() -> None:
    without = {p.name: p for p in plan_config(load_config(FLAGSHIP), 80, host_gib=1000).phases}
    cfg = load_config([*FLAGSHIP, "reward_model.enable=true", f"reward_model.model.path={RM}"])
    phases = {p.name: p for p in plan_config(cfg, 80, host_gib=1000).phases}
    assert "reward model" not in without
    terms = dict(phases["reward model"].terms)
    assert terms["reward model weights"] == pytest.approx(0.494e9 * 2, rel=0.03)  # bf16, as verl serves it
    held = sum(b for n, b in dict(phases["rollout"].terms).items() if not n.startswith("vLLM share"))
    # one forward: 16384 padded tokens x (3 x hidden 896 + 3 x MLP 4864) in bf16
    assert terms["reward model forward"] == 16384 * (3 * 896 + 3 * 4864) * 2
    assert phases["reward model"].peak == held + terms["reward model weights"] + terms["reward model forward"]
    grew = phases["host memory"].peak - without["host memory"].peak
    assert grew == 8 * terms["reward model weights"]  # 8 actor ranks on the node
    assert phases["reward model"].limit == 80 * GIB


def test_the_reward_model_s_micro_batch_rows_bound_its_forward() -> None:
    """`reward_model.micro_batch_size_per_gpu` rows of a whole sequence, when fewer tokens than the
    default budget; one row longer than the budget goes alone."""
    def forward(*extra: str) -> int:
        cfg = load_config([*FLAGSHIP, "reward_model.enable=true", f"reward_model.model.path={RM}", *extra])
        return dict({p.name: p for p in plan_config(cfg, 80).phases}["reward model"].terms)["reward model forward"]

    seq = load_config(FLAGSHIP).data.max_prompt_length + load_config(FLAGSHIP).data.max_response_length
    assert forward("reward_model.micro_batch_size_per_gpu=2") == 2 * seq * (3 * 896 + 3 * 4864) * 2
    assert forward("data.max_response_length=30000") == (load_config(FLAGSHIP).data.max_prompt_length + 30000) * (
        3 * 896 + 3 * 4864) * 2


def test_a_generative_reward_model_adds_no_trainer_weights() -> None:
    """Its server is a process of its own; the trainer holds none of its weights."""
    cfg = load_config([*FLAGSHIP, "reward_model.enable=true", f"reward_model.model.path={RM}",
                       "custom_reward_function.path=/r.py"])
    assert "reward model" not in {p.name for p in plan_config(cfg, 80).phases}


def test_the_reward_models_dtype_sets_its_bytes() -> None:
    cfg = load_config([*FLAGSHIP, "reward_model.enable=true", f"reward_model.model.path={RM}",
                       "reward_model.rollout.dtype=float32"])
    terms = dict({p.name: p for p in plan_config(cfg, 80).phases}["reward model"].terms)
    assert terms["reward model weights"] == pytest.approx(0.494e9 * 4, rel=0.03)
