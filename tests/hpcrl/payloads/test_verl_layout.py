"""The stand-in's checkpoint layout (`tests/payloads/verl_standin/`) against the paths real verl
0.9.1's checkpoint code computes, in the venv where verl is installed (`make verl-venv`,
`.venv-verl`): verl's FSDP checkpoint manager saves a 1-rank FSDP2 model on CPU (gloo), its
tracker helpers read what the stand-in wrote, and its early-save rule answers as the stand-in's.
Skipped where verl is not importable, except under CI=true with HPCRL_REQUIRE_VERL=1 (the CI run
in the verl venv), where it fails."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from hpcrl.payloads import verl as kind
from hpcrl.runreport import TRACKER_FILE, tracked_checkpoint
from tests.conftest import REPO, require_verl

STANDIN = REPO / "tests" / "payloads" / "verl_standin" / "verl" / "trainer" / "main_ppo.py"


def standin():
    spec = importlib.util.spec_from_file_location("verl_standin_main_ppo", STANDIN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_save(root: Path, step: int) -> list[str]:
    """The `.pt` files real verl's FSDP checkpoint manager writes for one rank's actor."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{root}.pg", rank=0, world_size=1)
    try:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        import torch

        contents = ["model", "optimizer", "extra"]
        manager = FSDPCheckpointManager(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), lr_scheduler=None,
            processing_class=None,
            checkpoint_config=OmegaConf.create({"save_contents": contents,
                                                "load_contents": contents}))
        actor = root / f"global_step_{step}" / "actor"
        manager.save_checkpoint(str(actor), global_step=step)
    finally:
        dist.destroy_process_group()
    return sorted(p.name for p in actor.glob("*.pt"))


def test_standin_layout_is_verls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_verl()
    from verl.utils.checkpoint.checkpoint_manager import (
        find_latest_ckpt_path,
        get_checkpoint_tracker_filename,
        should_save_ckpt_esi,
    )

    fake = standin()
    real_files = verl_save(tmp_path / "verl", 3)
    assert real_files == ["extra_state_world_size_1_rank_0.pt", "model_world_size_1_rank_0.pt",
                          "optim_world_size_1_rank_0.pt"]
    root = tmp_path / "standin"
    fake.save(str(root), 3, 1)
    mine = sorted(Path(p).name for p in fake.checkpoint_paths(str(root), 3, 1)
                  if Path(p).parent.name == "actor")
    assert mine == real_files
    assert get_checkpoint_tracker_filename(str(root)) == str(root / TRACKER_FILE)
    assert find_latest_ckpt_path(str(root)) == str(root / "global_step_3")
    assert tracked_checkpoint(root) == (3, root / "global_step_3")
    for left, longest in ((30, 5.0), (70, 5.0), (70, 15.0), (-1, 5.0), (30, 0.0)):
        monkeypatch.setenv(kind.ESI_ENV, str(time.time() + left))
        assert fake.should_save_ckpt_esi(longest) == should_save_ckpt_esi(longest), (left, longest)
