"""verl's own example scripts (examples/ppo_trainer, examples/grpo_trainer) through this trainer's
config: each is accepted unchanged, or refused naming the feature it needs. The overrides were
read from the scripts by `python -m tests.trainer.verl_examples extract` into
`tests/data/verl_examples.json` (verl's commit is recorded there); no verl checkout is needed.

Refused on purpose: Megatron-LM training, multimodal data, SGLang /
TensorRT-LLM rollout, Ulysses sequence parallelism and
non-fp32 actor weights: each changes what is computed and is not implemented here.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.trainer.verl_examples import FIXTURE, outcome
from trainer.config import compat_notes, dump_config, load_config

ACCEPTED = "accepted"
#: Each example: accepted, or a phrase of the refusal (the feature it needs).
EXPECTED = {
    # sets `trainer.use_legacy_worker_impl`: here as in verl it selects the loss normalisers
    "examples/ppo_trainer/run_deepseek7b_llm.sh": ACCEPTED,
    "examples/ppo_trainer/run_deepseek7b_llm_modelscope.sh": ACCEPTED,
    "examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh": ACCEPTED,
    "examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh": ACCEPTED,
    "examples/ppo_trainer/run_deepseek7b_llm_sp2.sh": "sequence parallelism",
    "examples/ppo_trainer/run_deepseek_full_hh_rlhf.sh": "Megatron-LM",
    "examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": "Megatron-LM",
    "examples/ppo_trainer/run_deepseek_math_gsm8k_megatron_nsys.sh": "Megatron-LM",
    "examples/ppo_trainer/run_gemma.sh": ACCEPTED,
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": "Megatron-LM",
    "examples/ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh": "Megatron-LM",
    "examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": "Megatron-LM",
    "examples/ppo_trainer/run_qwen2-7b_rm.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_rm_legacy.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_rm_reward_loop_colocate.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance_fused_kernels.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance_nsys.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_seq_balance.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2-7b_sglang_seq_balance.sh": "SGLang rollout",
    "examples/ppo_trainer/run_qwen2.5-32b.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2.5-3b_rm_legacy.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen2.5-3b_rm_reward_loop_colocate.sh": ACCEPTED,
    "examples/ppo_trainer/run_qwen3-8b_npu.sh": "sequence parallelism",
    "examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": "Megatron-LM",
    "examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": "Megatron-LM",
    "examples/grpo_trainer/run_deepseek7b_llm.sh": ACCEPTED,
    "examples/grpo_trainer/run_deepseek7b_llm_math.sh": ACCEPTED,
    "examples/grpo_trainer/run_deepseek7b_llm_math_megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_deepseek7b_llm_seq_balance.sh": ACCEPTED,
    "examples/grpo_trainer/run_glm41v_9b.sh": "multimodal data",
    "examples/grpo_trainer/run_gptoss_20b.sh": "SGLang rollout",
    "examples/grpo_trainer/run_minicpmo2_6.sh": "multimodal data",
    "examples/grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh": ACCEPTED,
    "examples/grpo_trainer/run_moonlight16b_math_megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2-32b_sglang_fsdp_npu.sh": "SGLang rollout",
    "examples/grpo_trainer/run_qwen2-7b.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2-7b_math.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2-7b_math_megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2-7b_math_megatron_trtllm.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2-7b_math_trtllm.sh": "TensorRT-LLM",
    "examples/grpo_trainer/run_qwen2-7b_seq_balance.sh": "SGLang rollout",
    "examples/grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2-7b_sgl_megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5-7b_math_megatron_diff_tp.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2_5_32b_grpo_npu.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5_7b_grpo_discrete_prof_npu.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5_7b_grpo_e2e_prof_npu.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5_7b_grpo_npu.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen2_5_vl-7b-sglang.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl-7b.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl-7b_freeze_vision.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl-7b_lora.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl-7b_seq_balance.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl_32b_npu.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl_3b_npu.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen2_5_vl_7b_npu.sh": "multimodal data",
    "examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen3-32b_npu.sh": "sequence parallelism",
    "examples/grpo_trainer/run_qwen3-8b.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen3-8b_npu.sh": ACCEPTED,
    "examples/grpo_trainer/run_qwen3_4b_grpo_vllm_1k_npu.sh": "does not parse",
    "examples/grpo_trainer/run_qwen3_8b_grpo_sglang_1k_spmd_npu.sh": "SGLang rollout",
    "examples/grpo_trainer/run_qwen3_8b_grpo_sglang_32k_spmd_npu.sh": "SGLang rollout",
    "examples/grpo_trainer/run_qwen3_vl-235b-megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen3_vl-30b-megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen3_vl-8b-megatron.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": "Megatron-LM",
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_lora.sh": "Megatron-LM",
    "examples/grpo_trainer/run_seed_oss_36b.sh": ACCEPTED,
    # verl's multi-turn examples (`--config-path`/`--config-name` of examples/sglang_multiturn/config):
    # their first refusal; `AGENT_LOOPS` below follows each refusal's fix to the agent loops they need.
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh": "`actor_rollout_ref.actor.use_kl_loss=`",
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh": "set `actor_rollout_ref.rollout.name=vllm`",
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh": "set `actor_rollout_ref.rollout.name=vllm`",
    "examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh":
        "set `actor_rollout_ref.rollout.name=vllm`",
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh": "set `actor_rollout_ref.rollout.name=vllm`",
}

_VLLM = "actor_rollout_ref.rollout.name=vllm"
#: The multi-turn examples with the one fix their refusal names: vLLM for SGLang; the script's
#: empty `${use_kl_loss}` given the value it sets a line before. Each is then accepted (the
#: MLflow one with its tracing and logger), its tool or interaction config read through verl's
#: `--config-path` files.
AGENT_LOOPS = {
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh": ["actor_rollout_ref.actor.use_kl_loss=True"],
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_4xgpu.sh": [_VLLM],
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh": [_VLLM],
    "examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh": [_VLLM],
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh": [_VLLM],
}

_FIXTURE = json.loads(FIXTURE.read_text())
EXAMPLES = _FIXTURE["examples"]
CONFIGS = _FIXTURE["configs"]


def test_the_fixture_lists_every_example() -> None:
    assert set(EXAMPLES) == set(EXPECTED)
    assert all(EXAMPLES.values()), "an example without overrides: the extraction failed"


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=lambda n: n.split("/")[-1])
def test_verl_example_is_accepted_or_refused_naming_the_feature(name: str) -> None:
    result = outcome(EXAMPLES[name], CONFIGS)
    if EXPECTED[name] == ACCEPTED:
        assert result == ACCEPTED, result
    else:
        assert result.startswith("refused: ") and EXPECTED[name] in result, result
        assert "unknown key" not in result or "unknown key" in EXPECTED[name], result


@pytest.mark.parametrize("name", sorted(AGENT_LOOPS), ids=lambda n: n.split("/")[-1])
def test_multi_turn_examples_are_accepted_with_the_fix_their_refusal_names(name: str) -> None:
    """With the fix their refusal names, verl's multi-turn examples (their config file read from
    `--config-path`/`--config-name`) are accepted: the file's tool or interaction config,
    `multi_turn.enable: True`, `multi_turn.max_assistant_turns` and the scripts'
    `rollout.mode=async`, `over_sample_rate`, `multi_stage_wake_up`."""
    args = [*EXAMPLES[name], *AGENT_LOOPS[name]]
    assert outcome(args, CONFIGS) == ACCEPTED


def test_accepted_examples_print_their_settings_and_note_the_no_ops() -> None:
    """--print-config of an accepted example shows every value the script set (paths included);
    the keys that change nothing each get one note."""
    lora = EXAMPLES["examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh"]
    cfg = load_config(lora, env={})
    printed = yaml.safe_load(dump_config(cfg))
    arr = printed["actor_rollout_ref"]
    assert (arr["model"]["lora_rank"], arr["model"]["lora_alpha"], arr["rollout"]["n"]) == (64, 32, 5)
    assert arr["rollout"]["load_format"] == "safetensors" and arr["rollout"]["layered_summon"] is True
    notes = compat_notes(lora, cfg)
    assert [n.split("`")[1] for n in notes] == [
        "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon", "actor_rollout_ref.ref.fsdp_config.param_offload=true"]
    prof = EXAMPLES["examples/grpo_trainer/run_qwen2_5_7b_grpo_discrete_prof_npu.sh"]
    printed = yaml.safe_load(dump_config(load_config(prof, env={})))
    assert printed["global_profiler"]["steps"] == [2, 4]
    assert printed["actor_rollout_ref"]["actor"]["profiler"]["ranks"] == [1, 2]
