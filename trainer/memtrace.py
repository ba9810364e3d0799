"""The training phases' per-rank peak, traced without weights or GPUs: torch's FSDP2 memory
tracker (`FSDPMemTracker`) under `FakeTensorMode`, as torchtitan estimates memory.

A fake process group (`FakeStore`, backend `fake`) of any world size, the device mesh built
outside fake mode (inside it fails with `DataDependentOutputException`), the model built on the
meta device from its config, sharded unit by unit as :func:`trainer.parallel.apply_fsdp2` does
(each decoder layer, then the root), `to_empty`, AdamW, and two update steps (the second has the
optimizer moments) of the trainer's own log-prob path (:func:`trainer.models.compute_log_probs`)
or value path on a fake micro-batch, packed (`use_remove_padding`) or padded as the trainer runs
it. Fake tensors hold no memory: the tracker counts what the
real tensors would. Runs in its own process (`python -m trainer.memtrace`, a JSON list of specs in, of peaks out):
the fake process group is process-wide.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from trainer import critic_model
from trainer import models as M
from trainer import parallel as P

CATEGORIES = ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER", "SHARDED_GRAD", "UNSHARDED_GRAD", "ACT",
              "TEMP", "ALL_GATHER", "REDUCE_SCATTER", "OPT", "INP")


def _build(config: dict[str, Any], critic: bool, dtype: Any, grad_ckpt: bool, device: str = "meta") -> Any:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    auto = AutoModel if critic else AutoModelForCausalLM
    # the workers' attention without flash-attn (which needs a GPU): SDPA, packed sequences apart
    attention = M.attention_implementation(torch.device("cpu"), dtype)
    with torch.device(device):
        model = auto.from_config(cfg, dtype=dtype, attn_implementation=attention)
        if critic:
            model = critic_model.CriticModel(model)
    if grad_ckpt:
        M.enable_checkpointing(model.backbone if critic else model)
    return model


def _steps(tracker: Any, model: Any, optim: Any, spec: dict[str, Any]) -> Any:
    """Two update steps of the trainer's own forward (the second with the AdamW moments) under
    `tracker`; its peak snapshot."""
    import dataclasses

    import torch
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rows, seq, resp = int(spec["rows"]), int(spec["seq_len"]), int(spec["response_len"])
    mode = detect_fake_mode()
    with unset_fake_temporarily():  # which tokens to compute is data-dependent: chosen for real
        ids = torch.randint(0, 100, (rows, seq))
        real = M.select_tokens(ids, torch.ones(rows, seq, dtype=torch.long), resp,
                               remove_padding=bool(spec.get("remove_padding")))
    tokens = dataclasses.replace(real, **{f.name: mode.from_tensor(getattr(real, f.name))
                                          for f in dataclasses.fields(real)
                                          if isinstance(getattr(real, f.name), torch.Tensor)})
    if hasattr(tracker, "track_inputs"):
        tracker.track_inputs((tokens.input_ids, tokens.attention_mask))
    with tracker:
        for _ in range(2):  # the trainer's own forward of the selected tokens (`compute_log_probs`)
            if spec["critic"]:
                out = critic_model.token_values(model, tokens)
            else:
                lp, _ = M._response_log_probs(model, tokens, 1.0, True, bool(spec.get("entropy_grad")))
                out = tokens.scatter(lp)
            out.float().mean().backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")


UNSHARDED_NAMES = {"PARAM": "SHARDED_PARAM", "GRAD": "SHARDED_GRAD"}


def _trace_unsharded(spec: dict[str, Any]) -> dict[str, int]:
    """One rank, no FSDP: torch's `MemTracker`, its categories named as FSDP's (the whole
    parameters and gradients are this rank's "shards")."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        # fake tensors from the start: `to_empty` cannot swap a plain meta parameter for a fake one
        model = _build(spec["config"], bool(spec["critic"]), torch.float32, bool(spec["grad_ckpt"]), "cpu")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
        tracker = MemTracker()
        tracker.track_external(model, optim)
        snap = _steps(tracker, model, optim, spec)
    per_device = next(iter(snap.values()))
    out = {UNSHARDED_NAMES.get(str(k).rsplit(".", 1)[-1], str(k).rsplit(".", 1)[-1]): int(v)
           for k, v in per_device.items()}
    return {**{c: 0 for c in CATEGORIES}, **out}


def trace(spec: dict[str, Any]) -> dict[str, int]:
    """Peak bytes per tracker category (and `Total`) on one rank for `spec`: `config` (a model
    config dict with `model_type`), `world`, `rows`, `seq_len`, `response_len`, `critic`,
    `grad_ckpt`, `entropy_grad`, `param_dtype`, `reduce_dtype`."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = int(spec["world"])
    if world == 1:  # the trainer does not shard a single rank (`DistContext.fsdp`)
        return _trace_unsharded(spec)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        mp = MixedPrecisionPolicy(param_dtype=dtypes[spec["param_dtype"]],
                                  reduce_dtype=dtypes[spec["reduce_dtype"]])
        with FakeTensorMode():
            model = _build(spec["config"], bool(spec["critic"]), torch.float32, bool(spec["grad_ckpt"]))
            for layer in P._decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            model.to_empty(device="cpu")
            optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
            tracker = FSDPMemTracker(model, optim)
            snap = _steps(tracker, model, optim, spec)
    finally:
        dist.destroy_process_group()
    per_device = next(iter(snap.values()))
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in per_device.items()}


if __name__ == "__main__":
    json.dump([trace(spec) for spec in json.loads(sys.stdin.read())], sys.stdout)
