"""LoRA through peft: `actor_rollout_ref.model.lora_rank`, `lora_alpha`, `target_modules`, and
`lora_adapter_path` (:func:`load_lora`: the adapters start from a saved peft adapter).

:func:`apply_lora` wraps the actor's causal LM with ``peft.get_peft_model`` before FSDP2 shards
it: the base weights are frozen and only the adapters (``lora_A``, ``lora_B``) train, so only
they get gradients and optimizer state. The reference policy is the same model with its adapters
disabled (``model.disable_adapter()``, as verl does), not a second copy.

The rollout engines and the HF export never see peft's names: for a peft model
:func:`trainer.parallel.state_entries` lists the base model's state dict (:func:`base_name`:
``base_model.model.`` and ``.base_layer`` stripped; the adapters, :func:`is_adapter_name`, left
out) and gathers each adapted weight merged on the fly (:func:`merge`:
``W + lora_alpha / lora_rank * B @ A``), tensor by tensor like any other entry. The training
model itself is never merged.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError
from trainer.config.actor import ModelConfig

__all__ = ["adapter_settings", "apply_lora", "base_name", "is_adapter_name", "is_lora", "linear_module_names",
           "load_lora", "lora_layers", "merge"]

ALL_LINEAR = "all-linear"
_PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (FSDP2-sharded or not). peft is not imported for it: a
    process that never imported peft holds no peft model."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct short names of `model`'s linear layers (`q_proj`, ..., `lm_head`)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)})


def apply_lora(model: torch.nn.Module, rank: int, alpha: int, target_modules: Sequence[str]) -> Any:
    """`model` wrapped by ``peft.get_peft_model`` with LoRA adapters of `rank` on
    `target_modules` (`all-linear` or module names; a name matches a module whose dotted name
    equals it or ends with it); only the adapters require gradients."""
    from peft import LoraConfig, get_peft_model

    if rank < 1 or alpha <= 0:
        raise ConfigError(f"LoRA needs `actor_rollout_ref.model.lora_rank` >= 1 and `lora_alpha` > 0 "
                          f"(got {rank} and {alpha})")
    targets: str | list[str] = list(target_modules)
    if list(target_modules) == [ALL_LINEAR]:
        targets = ALL_LINEAR
    else:
        linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
        if unknown:
            raise ConfigError(
                f"`actor_rollout_ref.model.target_modules`: {', '.join(f'`{t}`' for t in unknown)} "
                f"match(es) no linear layer of the model; its linear layers are named "
                f"{', '.join(f'`{n}`' for n in linear_module_names(model))} (or use `all-linear`)")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def adapter_settings(model_cfg: ModelConfig) -> tuple[int, int, list[str]]:
    """The saved adapter's `r`, `lora_alpha` and `target_modules` (`lora_adapter_path`'s
    `adapter_config.json`). verl takes them from the adapter whatever the run sets; here a run
    that sets `lora_rank` > 0 must agree with them (its `target_modules` too, unless `all-linear`),
    else it is refused naming each mismatch."""
    path = str(model_cfg.lora_adapter_path)
    file = Path(path).expanduser() / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"`actor_rollout_ref.model.lora_adapter_path={path}`: cannot read `{file}` ({err}). Fix: give "
            "the directory a peft adapter was saved to (`save_pretrained(dir)` of a peft model)") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or not isinstance(config.get("r"), int):
        raise ConfigError(f"`actor_rollout_ref.model.lora_adapter_path={path}`: `{file}` is no LoRA adapter "
                          f"(`peft_type` {config.get('peft_type')!r}, `r` {config.get('r')!r}). Fix: give a "
                          "peft LoRA adapter directory")
    targets = config.get("target_modules")
    saved = sorted([targets] if isinstance(targets, str) else targets or [])
    rank, alpha = int(config["r"]), int(config.get("lora_alpha", 8))
    if model_cfg.lora_rank == 0:
        return rank, alpha, saved
    mismatches = []
    if model_cfg.lora_rank != rank:
        mismatches.append(f"`actor_rollout_ref.model.lora_rank={model_cfg.lora_rank}` (the adapter's `r` is {rank})")
    if model_cfg.lora_alpha != alpha:
        mismatches.append(f"`actor_rollout_ref.model.lora_alpha={model_cfg.lora_alpha}` (the adapter's is {alpha})")
    if list(model_cfg.target_modules) != [ALL_LINEAR] and sorted(model_cfg.target_modules) != saved:
        mismatches.append(f"`actor_rollout_ref.model.target_modules={list(model_cfg.target_modules)}` "
                          f"(the adapter's are {saved})")
    if mismatches:
        raise ConfigError(
            f"`actor_rollout_ref.model.lora_adapter_path={path}` disagrees with the run's LoRA settings: "
            + "; ".join(mismatches) + ". Fix: set them as the adapter has them, or leave "
            "`actor_rollout_ref.model.lora_rank=0` to take the adapter's")
    return rank, alpha, saved


def load_lora(model: torch.nn.Module, model_cfg: ModelConfig) -> Any:
    """`model` wrapped by the saved peft adapter at `model_cfg.lora_adapter_path`, its weights
    loaded and trainable (verl's `PeftModel.from_pretrained(module, path, is_trainable=True)`),
    once its settings are checked (:func:`adapter_settings`)."""
    from peft import PeftModel

    adapter_settings(model_cfg)
    path = str(Path(str(model_cfg.lora_adapter_path)).expanduser())
    return PeftModel.from_pretrained(model, path, is_trainable=True)


def base_name(name: str) -> str:
    """The base model's name of a peft state-dict entry
    (`base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` ->
    `model.layers.0.mlp.up_proj.weight`)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def is_adapter_name(name: str) -> bool:
    """Whether a peft state-dict entry belongs to an adapter (`...q_proj.lora_A.default.weight`)."""
    return _ADAPTER_PART.search(name) is not None


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """`{state-dict name of the base weight: LoRA layer}` for every adapted layer of `model`."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.base_layer.weight": module for name, module in model.named_modules()
            if isinstance(module, LoraLayer)}


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()


def merge(weight: torch.Tensor, layer: Any) -> torch.Tensor:
    """`weight` (the base weight, gathered whole) plus the scaled update of each active adapter
    of `layer` (its A and B gathered whole: a collective under FSDP2), in `weight`'s dtype."""
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = _whole(layer.lora_A[adapter].weight).float()
        b = _whole(layer.lora_B[adapter].weight).float()
        delta = (b @ a) * layer.scaling[adapter]
        merged = merged + (delta.T if layer.fan_in_fan_out else delta)
    return merged.to(weight.dtype)
