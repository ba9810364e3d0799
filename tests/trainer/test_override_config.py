"""verl's `model.override_config`: read as verl reads it, checked against verl 0.9.1's own
`HFModelConfig`, and carried by every model the trainer builds (actor, reference, critic, the HF
rollout copy, vLLM's engine arguments and the memory plan)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.verl_env import verl_python
from trainer import models as M
from trainer.config import load_config
from trainer.hf_overrides import apply_updates, config_updates, override_kwargs

#: What verl's scripts set (`max_position_embeddings`), a dropout the model reads, a key the
#: model's config lacks (verl sets it anyway), and one inside a sub-mapping.
OVERRIDE = {"max_position_embeddings": 2048, "attention_dropout": 0.25, "brand_new_key": 7}
ACTOR_FLAGS = ["+actor_rollout_ref.model.override_config.max_position_embeddings=2048",
               "+actor_rollout_ref.model.override_config.attention_dropout=0.25",
               "+actor_rollout_ref.model.override_config.brand_new_key=7"]


def test_override_is_read_as_verl_reads_it(tiny_model_dir: Path) -> None:
    tok = M.load_tokenizer(tiny_model_dir)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    assert config_updates({}, tok) == ids  # verl sets the tokenizer's ids on every model's config
    assert config_updates({"pad_token_id": 9, "x": 1}, tok) == {**ids, "pad_token_id": 9, "x": 1}  # the override wins
    # Megatron's spelling, read by verl 0.9.1 for FSDP too; the kernel choice is not applied
    assert override_kwargs({"model_config": {"max_position_embeddings": 8}, "rope_theta": 1.0}) == {
        "max_position_embeddings": 8}
    assert override_kwargs({"attn_implementation": "eager", "hidden_act": "gelu"}) == {"hidden_act": "gelu"}
    # a mapping descends into a sub-config, in a transformers config and in the plan's dict
    from transformers import AutoConfig, LlavaConfig

    nested = LlavaConfig(text_config=AutoConfig.from_pretrained(tiny_model_dir).to_dict())
    apply_updates(nested, {"text_config": {"max_position_embeddings": 99}})
    assert nested.text_config.max_position_embeddings == 99
    assert apply_updates({"text_config": {"a": 1}}, {"text_config": {"b": 2}}) == {"text_config": {"a": 1, "b": 2}}
    # verl's update_model_config fails on a mapping for anything but a sub-config: refused, named
    config = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"`critic.model.override_config.rope_scaling` is a mapping.*holds a "
                                         r"dict under `rope_scaling`.*Fix: "):
        apply_updates(config, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "critic.model.override_config")
    with pytest.raises(ValueError, match=r"`model.override_config.absent` is a mapping.*no such attribute"):
        apply_updates(config, {"absent": {"a": 1}})


def test_the_config_keys_are_accepted_as_verl_spells_them() -> None:
    cfg = load_config([*ACTOR_FLAGS, "+critic.model.override_config.model_config.attention_dropout=0.5"])
    assert dict(cfg.actor_rollout_ref.model.override_config) == OVERRIDE
    assert override_kwargs(cfg.critic.model.override_config) == {"attention_dropout": 0.5}
    assert load_config([]).actor_rollout_ref.model.override_config == {}


VERL_SIDE = r"""
import json, sys
from verl.workers.config.model import HFModelConfig
spec = json.loads(sys.stdin.read())
made = HFModelConfig(path=spec["path"], override_config=spec["override"])
print(json.dumps({k: getattr(made.hf_config, k, None) for k in spec["keys"]}))
"""


def test_the_edited_config_is_verls(tiny_model_dir: Path) -> None:
    """verl 0.9.1's `HFModelConfig` (what its FSDP engine builds the actor, reference and critic
    from) on the same model and override gives the same config values."""
    python = verl_python()
    override = {"model_config": {**OVERRIDE, "pad_token_id": 1}, "attn_implementation": "eager"}
    keys = [*OVERRIDE, "pad_token_id", "bos_token_id", "eos_token_id", "num_hidden_layers"]
    done = subprocess.run([python, "-c", VERL_SIDE], capture_output=True, text=True, timeout=300, check=False,
                          input=json.dumps({"path": str(tiny_model_dir), "override": override, "keys": keys}),
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    tok = M.load_tokenizer(tiny_model_dir)
    ours = M.load_model_config(tiny_model_dir, updates=config_updates(override, tok))
    assert {k: getattr(ours, k, None) for k in keys} == theirs
    assert theirs["max_position_embeddings"] == 2048 and theirs["pad_token_id"] == 1  # the test can fail


def _cfg(model: Path, *extra: str) -> Any:
    return load_config([f"actor_rollout_ref.model.path={model}", "trainer.device=cpu", "data.train_batch_size=4",
                        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                        "data.max_response_length=8", "actor_rollout_ref.rollout.name=hf", *extra])


def _carries(config: Any, override: dict[str, Any]) -> bool:
    return all(getattr(config, k) == v for k, v in override.items())


def test_every_built_model_carries_the_override(tiny_model_dir: Path) -> None:
    from trainer.rollout.hf import rollout_copy
    from trainer.rollout.vllm import engine_args, rollout_knobs
    from trainer.workers.actor import ActorRolloutRefWorker
    from trainer.workers.critic import CriticWorker

    torch.manual_seed(0)
    cfg = _cfg(tiny_model_dir, *ACTOR_FLAGS, "actor_rollout_ref.actor.use_kl_loss=true",
               "algorithm.adv_estimator=gae", "+critic.model.override_config.attention_dropout=0.5")
    actor = ActorRolloutRefWorker(cfg, 0, 1, total_steps=1)
    actor.init_dist(None, None)
    assert _carries(actor.model.config, OVERRIDE) and _carries(actor.ref.config, OVERRIDE)
    # the model reads what it is given: the attention drops out in train mode, not in eval mode
    assert actor.model.model.layers[0].self_attn.attention_dropout == 0.25
    tok = actor.tokenizer
    assert (actor.model.config.pad_token_id, actor.model.model.embed_tokens.padding_idx) == (tok.pad_token_id,) * 2
    critic = CriticWorker(cfg, 0, 1, total_steps=1)
    critic.init_dist(None, None)
    assert critic.model.config.attention_dropout == 0.5 and critic.model.config.max_position_embeddings == 512
    copy = rollout_copy(str(tiny_model_dir), 1, 1, torch.device("cpu"), config_updates=actor.config_updates)
    assert _carries(copy.config, OVERRIDE)
    knobs = rollout_knobs(cfg, tok, [tok.eos_token_id])
    assert knobs["hf_overrides"] == OVERRIDE
    assert knobs["max_model_len"] == 2048  # verl's server: `max_model_len` null -> the edited context
    args = engine_args(knobs.pop("model_path"), **{k: v for k, v in knobs.items()
                                                    if k not in ("pad_token_id", "eos_token_ids", "calculate_log_probs")})
    assert args["hf_overrides"] == OVERRIDE and args["max_model_len"] == 2048
    plain = rollout_knobs(_cfg(tiny_model_dir), tok, [tok.eos_token_id])
    assert plain["max_model_len"] == 512 and "hf_overrides" not in engine_args(str(tiny_model_dir), max_model_len=512)


def test_the_memory_plan_reads_the_edited_shape(tiny_model_dir: Path) -> None:
    """`max_position_embeddings` sizes vLLM's context (the KV cache of one `max_model_len`
    sequence); a shape key (`num_hidden_layers`) changes what is planned."""
    from trainer.memplan import _config_settings

    shape, s, _ = _config_settings(_cfg(tiny_model_dir), 80, 0)
    assert (s.max_model_len, shape.layers) == (512, 2)
    shape, s, _ = _config_settings(_cfg(tiny_model_dir, *ACTOR_FLAGS,
                                     "+actor_rollout_ref.model.override_config.num_hidden_layers=1"), 80, 0)
    assert (s.max_model_len, shape.layers) == (2048, 1)
