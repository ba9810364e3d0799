"""A sharded build: the actor built empty on each rank and filled with only the part of each
tensor the rank holds, read from the model's safetensors files (FSDP2's placement first, then
:func:`load_local_shards`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.models import empty_actor, enable_checkpointing, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["empty_placed_actor", "load_local_shards", "safetensors_files"]


def safetensors_files(path: str | Path) -> list[Path]:
    """The HF safetensors files of the model at `path` (none for a GGUF file)."""
    directory, gguf_file = resolve_model_path(path)
    return [] if gguf_file else sorted(Path(directory).glob("*.safetensors"))


def empty_placed_actor(path: str | Path, *, dtype: str | torch.dtype = "float32",
                       attn_implementation: str = "sdpa", gradient_checkpointing: bool = False,
                       trust_remote_code: bool = False,
                       config_updates: Mapping[str, Any] | None = None) -> PreTrainedModel:
    """`empty_actor` with gradient checkpointing as `load_actor` sets it: for a rank that then
    reads only its shards (:func:`load_local_shards`)."""
    model = empty_actor(path, dtype=dtype, attn_implementation=attn_implementation,
                        trust_remote_code=trust_remote_code, config_updates=config_updates)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds of `param` and where it sits in the whole one: an FSDP2
    DTensor's local shard and its global offset, or a plain tensor, whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return param, tuple(slice(0, n) for n in param.shape)


@torch.no_grad()
def load_local_shards(model: nn.Module, path: str | Path) -> None:
    """Fill `model`'s parameters (built empty, already placed and sharded) from the HF
    safetensors files at `path`, each rank reading only the part it holds (safetensors' lazy
    slicing of the memory-mapped file): no rank ever holds a whole tensor it does not keep, so
    host memory at build does not grow with the ranks on a node. Tied parameters are read once."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            where.update(dict.fromkeys(f.keys(), file))
    missing = [name for name, _ in model.named_parameters() if name not in where]
    if missing:
        raise ValueError(
            f"the safetensors files of `{path}` hold no tensor named {', '.join(f'`{m}`' for m in missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; the model's parameter names must match the "
            "checkpoint's (a model saved by `save_pretrained`)")
    for name, param in model.named_parameters():
        local, region = _local_region(param)
        if local.numel():  # the file mapped for one tensor at a time: its pages leave the RSS after
            with safe_open(str(where[name]), framework="pt", device="cpu") as f:
                local.copy_(f.get_slice(name)[region].to(local.dtype))
