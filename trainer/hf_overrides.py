"""verl's `model.override_config`: what reaches each model's Hugging Face config.

verl builds every model from a config it edits first (`verl/workers/config/model.py`,
`HFModelConfig.__post_init__` in 0.9.1; `_build_model_optimizer` of `fsdp_workers.py` at the
commit followed, the same steps):

1. the tokenizer's `bos_token_id`, `eos_token_id` and `pad_token_id` are set on the config
   (a Qwen2-style embedding takes `pad_token_id` as its `padding_idx`: that row gets no gradient);
2. then `override_config` over them: its `model_config` sub-mapping when it has one (Megatron's
   spelling, which verl 0.9.1 reads for FSDP too), else the whole mapping;
3. applied by `verl.utils.model.update_model_config`: a mapping value descends into the config
   attribute of that name (a sub-config such as `text_config`), any other value is set as an
   attribute, also one the config lacks (transformers keeps it, the model ignores it).

Here the actor, the reference, the critic (`critic.model.override_config`, its own key) and the
HF rollout copy are built from the config so edited; the vLLM engine gets the override as
`hf_overrides` (the model it generates with is the one trained) and sizes its context
(`max_model_len` when null) from the edited `max_position_embeddings`, as verl's server does;
the memory plan reads the edited shape. `attn_implementation` is the one key verl reads apart
(it picks the attention kernel); see :data:`ATTENTION`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ATTENTION", "apply_updates", "config_updates", "override_kwargs"]

ATTENTION = ("`attn_implementation` picks verl's attention kernel (its default `flash_attention_2`); "
             "the kernel is chosen here (SDPA, packed per sequence with `use_remove_padding`, "
             "flash-attention varlen where installed): every kernel computes the same attention, so the "
             "key is read and not applied")


def override_kwargs(override: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config edits of one `model.override_config` as verl 0.9.1 reads it: its `model_config`
    sub-mapping when there is one, else the mapping; without `attn_implementation` (:data:`ATTENTION`)."""
    given = dict(override or {})
    edits = dict(given["model_config"]) if "model_config" in given else given
    edits.pop("attn_implementation", None)
    return edits


def config_updates(override: Mapping[str, Any] | None, tokenizer: Any = None) -> dict[str, Any]:
    """Every edit verl makes to a model's config, in its order: the tokenizer's BOS/EOS/PAD ids
    (none without a tokenizer), then :func:`override_kwargs` over them."""
    updates: dict[str, Any] = {}
    if tokenizer is not None:
        updates = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}
    updates.update(override_kwargs(override))
    return updates


def _is_sub_config(value: Any, in_dict: bool) -> bool:
    if in_dict:  # the memory plan's `config.json` tree: a sub-config is a nested mapping
        return isinstance(value, dict)
    return value is not None and hasattr(value, "to_dict") and not isinstance(value, Mapping)


def apply_updates(config: Any, updates: Mapping[str, Any], key: str = "model.override_config") -> Any:
    """`updates` applied to `config` in place as verl's `update_model_config` applies them; returns
    `config`. `config` is a transformers config, or a `config.json` read as a dict (the memory
    plan). A mapping value for an attribute that is no sub-config (missing, None, or a plain dict
    such as `rope_scaling`) fails in verl with an AttributeError; here it is refused naming the key."""
    in_dict = isinstance(config, dict)
    for name, value in updates.items():
        if isinstance(value, Mapping):
            sub = config.get(name) if in_dict else getattr(config, name, None)
            if not _is_sub_config(sub, in_dict):
                held = "no such attribute" if sub is None else f"a {type(sub).__name__}"
                raise ValueError(
                    f"`{key}.{name}` is a mapping, but the model's config holds {held} under `{name}`: verl's "
                    "`update_model_config` descends only into sub-configs (such as `text_config`) and fails "
                    f"on anything else. Fix: set the leaves one by one where `{name}` is a sub-config, or "
                    f"give `{name}` in the model's own `config.json`")
            apply_updates(sub, value, f"{key}.{name}")
        elif in_dict:
            config[name] = value
        else:
            setattr(config, name, value)
    return config
