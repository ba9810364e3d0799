"""A model read from safetensors is sharded while its parameters are still on the meta device and
only then given memory, so a rank allocates its shards, never the whole model (before, the
whole fp32 model was put on every GPU by `to_empty` and sharded after). One rank forms a real
gloo group here and shards with FSDP2; the weights read are the checkpoint's, ties kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainer import models as M
from trainer import parallel as P
from trainer.config import load_config
from trainer.phases import Phases
from trainer.workers.base import Worker


@pytest.fixture
def gloo_group(tmp_path: Path) -> Any:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_gets_memory_for_its_shards_only(tiny_model_dir: Path, gloo_group: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}"])
    worker = Worker(cfg, 0, 1, total_steps=1)
    worker.ctx = P.DistContext(rank=0, world_size=1, backend="gloo", fsdp=True)
    worker.phases = Phases(torch.device("cpu"), offload_optimizer=False)
    seen: list[tuple[bool, bool]] = []
    materialize = M.materialize

    def spy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        params = list(model.parameters())
        seen.append((all(p.is_meta for p in params), all(hasattr(p, "to_local") for p in params)))
        return materialize(model, device)

    monkeypatch.setattr(M, "materialize", spy)
    placed = worker._load_placed(str(tiny_model_dir), cfg.actor_rollout_ref.actor.fsdp_config,
                                 "actor_rollout_ref.actor.fsdp_config")
    assert seen == [(True, True)]  # given memory once, already sharded (DTensors)
    assert placed.lm_head.weight is placed.model.embed_tokens.weight  # tied embeddings stay tied
    reference = M.load_actor(tiny_model_dir).state_dict()
    for name, value in placed.state_dict().items():
        local = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(local, reference[name], rtol=0, atol=0, msg=name)
