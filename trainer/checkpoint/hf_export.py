"""The actor's ``huggingface/`` export, streamed: safetensors shards written one tensor at a time.

Every rank of the actor group calls :func:`write_hf_export` (a collective): the entries of the
model's state dict (tied duplicates left out, as ``save_pretrained`` does) are planned into
shards of at most ``max_shard_bytes`` from their global shapes, before anything is gathered;
then each tensor is gathered whole (``DTensor.full_tensor()`` on every rank) and rank 0 appends
its bytes to the open shard file, whose safetensors header (names, dtypes, shapes, offsets) it
wrote first. No rank ever holds more than one whole tensor beyond its own shards. The directory
is the standard layout (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``,
or ``model.safetensors`` alone for one shard, with ``config.json``, ``generation_config.json``
and the tokenizer), which ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from trainer.parallel import state_entries

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["HF_SHARD_BYTES", "INDEX_FILE", "plan_shards", "shard_names", "write_hf_config", "write_hf_export"]

#: Largest safetensors shard of the export (transformers' own default is 5 GB).
HF_SHARD_BYTES = 2 * 2**30
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names in state-dict order cut into consecutive shards of at most `max_shard_bytes` (a
    tensor larger than that gets a shard of its own)."""
    if max_shard_bytes < 1:
        raise ValueError(f"`max_shard_bytes` must be at least 1, received {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    total = 0
    for name, nbytes in sizes:
        if current and total + nbytes > max_shard_bytes:
            shards.append(current)
            current, total = [], 0
        current.append(name)
        total += nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """File names of `count` shards, as transformers names them."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(names: Sequence[str], meta: dict[str, tuple[torch.dtype, tuple[int, ...], int]]) -> bytes:
    """The safetensors header of one shard: JSON padded with spaces to a multiple of 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        dtype, shape, nbytes = meta[name]
        if dtype not in _DTYPES:
            raise TypeError(f"HF export: `{name}` has dtype {dtype}, which safetensors cannot hold")
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _append(out: IO[bytes], tensor: torch.Tensor) -> None:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    out.write(memoryview(data.numpy()))


def write_hf_export(directory: str | Path, model: torch.nn.Module, rank: int, *,
                    tokenizer: PreTrainedTokenizerBase | None = None,
                    max_shard_bytes: int = HF_SHARD_BYTES) -> list[str]:
    """Write `model` (sharded with FSDP2 or whole) as an HF directory; every rank of the group
    calls it, rank 0 writes. A LoRA (peft) model is written as its base model with the adapters
    merged, which plain transformers loads. Returns the shard file names."""
    entries = state_entries(model, unique=True)  # a LoRA model: its base names, merged
    meta = {e.name: (e.dtype, e.shape, e.nbytes) for e in entries}
    shards = plan_shards([(e.name, e.nbytes) for e in entries], max_shard_bytes)
    files = shard_names(len(shards))
    out_dir = Path(directory)
    writing = rank == 0
    if writing:
        write_hf_config(out_dir, model, tokenizer)
    tensors = ((e.name, e.gather()) for e in entries)
    for file, shard in zip(files, shards, strict=True):
        handle = open(out_dir / file, "wb") if writing else None  # noqa: SIM115 - closed below
        try:
            if handle is not None:
                header = _header(shard, meta)
                handle.write(len(header).to_bytes(8, "little"))
                handle.write(header)
            for expected in shard:
                name, tensor = next(tensors)  # gathered on every rank
                assert name == expected, (name, expected)
                if handle is not None:
                    _append(handle, tensor)
                del tensor
        finally:
            if handle is not None:
                handle.close()
    if writing and len(files) > 1:
        index = {"metadata": {"total_size": sum(m[2] for m in meta.values())},
                 "weight_map": {n: f for f, shard in zip(files, shards, strict=True) for n in shard}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def write_hf_config(out_dir: str | Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """`config.json`, `generation_config.json` (when the model has one) and the tokenizer: what
    verl's `huggingface/` holds on every save, the weights only with `hf_model` in
    `checkpoint.save_contents`. One rank writes it; no collective."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"HF export: `{type(model).__name__}` has no `config`; export a transformers model")
    config.save_pretrained(out_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
