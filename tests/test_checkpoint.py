"""Atomic checkpoint directories: round trips, pruning, HF export, and writers killed mid-way."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import full_state as ck

REPO = Path(__file__).resolve().parents[1]


def small_states(step: int) -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "actor": model.state_dict(),
        "actor_optim": opt.state_dict(),
        "trainer_state": {"global_step": step, "dataloader": {"epoch": 0, "index": 7}},
    }


def test_round_trip_marker_and_manifest(tmp_path: Path) -> None:
    states = small_states(3)
    path = ck.save_checkpoint(
        tmp_path, 3, states, files={"config.yaml": "a: 1\n"}, metadata={"note": "x"}
    )
    assert path == tmp_path / "global_step_3" and ck.is_complete(path)
    assert ck.read_latest_marker(tmp_path) == 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["metadata"] == {"note": "x"}
    assert set(manifest["files"]) == {
        "actor.pt",
        "actor_optim.pt",
        "trainer_state.pt",
        "config.yaml",
    }
    loaded = ck.load_checkpoint(path)
    assert set(loaded) == {"actor", "actor_optim", "trainer_state"}
    torch.testing.assert_close(loaded["actor"], states["actor"])
    assert loaded["actor_optim"]["state"][0]["step"] == states["actor_optim"]["state"][0]["step"]
    assert ck.load_state(path, "trainer_state")["dataloader"]["index"] == 7
    with pytest.raises(KeyError, match="Available: actor, actor_optim, trainer_state"):
        ck.load_state(path, "critic")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_nested_names_and_bad_names(tmp_path: Path) -> None:
    path = ck.save_checkpoint(tmp_path, 1, {"critic/model": {"w": torch.zeros(2)}})
    assert set(ck.load_checkpoint(path)) == {"critic/model"}
    torch.testing.assert_close(ck.load_state(path, "critic/model")["w"], torch.zeros(2))
    for bad in ("../x", "manifest.json", "a b", ""):
        with pytest.raises(ValueError, match="Invalid checkpoint entry name"):
            ck.save_checkpoint(tmp_path, 2, {bad: 1})
    assert ck.find_latest_checkpoint(tmp_path) == path


def test_keep_last_and_resave(tmp_path: Path) -> None:
    for step in range(1, 6):
        ck.save_checkpoint(tmp_path, step, {"s": step}, keep_last=2)
    assert [ck.step_of(p) for p in ck.list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_4", "global_step_5", "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    ck.save_checkpoint(tmp_path, 5, {"s": 50})
    assert ck.load_state(tmp_path / "global_step_5", "s") == 50
    assert ck.prune_checkpoints(tmp_path, 0) == []


def test_incomplete_directories_are_never_picked(tmp_path: Path) -> None:
    good = ck.save_checkpoint(tmp_path, 1, {"s": 1})
    # A newer directory without a manifest (e.g. copied by hand or cut short).
    (tmp_path / "global_step_7").mkdir()
    (tmp_path / "global_step_7" / "s.pt").write_bytes(b"junk")
    # A newer one whose file was truncated after the manifest was written.
    bad = ck.save_checkpoint(tmp_path, 9, {"s": torch.zeros(100)})
    with open(bad / "s.pt", "r+b") as f:
        f.truncate(10)
    # A corrupt manifest, and a manifest claiming another step.
    (tmp_path / "global_step_11").mkdir()
    (tmp_path / "global_step_11" / "manifest.json").write_text("{not json")
    (tmp_path / "global_step_12").mkdir()
    (tmp_path / "global_step_12" / "manifest.json").write_text('{"step": 3, "files": {}}')
    assert ck.find_latest_checkpoint(tmp_path) == good
    assert ck.resolve_resume(tmp_path, "auto") == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ck.resolve_resume(tmp_path, "resume_path", tmp_path / "global_step_9")
    with pytest.raises(FileNotFoundError, match="cut short"):
        ck.load_checkpoint(tmp_path / "global_step_7")


def test_renamed_but_marker_not_yet_written_is_complete(tmp_path: Path) -> None:
    ck.save_checkpoint(tmp_path, 1, {"s": 1})
    ck.save_checkpoint(tmp_path, 2, {"s": 2})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1\n")  # as if killed before
    assert ck.find_latest_checkpoint(tmp_path) == tmp_path / "global_step_2"


def test_resolve_resume_modes(tmp_path: Path) -> None:
    assert ck.resolve_resume(tmp_path / "none", "auto") is None
    p = ck.save_checkpoint(tmp_path, 4, {"s": 4})
    assert ck.resolve_resume(tmp_path, "disable") is None
    assert ck.resolve_resume(tmp_path, "resume_path", p) == p
    with pytest.raises(ValueError, match="resume_from_path"):
        ck.resolve_resume(tmp_path, "resume_path")
    with pytest.raises(ValueError, match="Valid values: auto, disable, resume_path"):
        ck.resolve_resume(tmp_path, "latest")


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from trainer.checkpoint.full_state import save_checkpoint

    class Stall:
        # Pickling this object signals the parent, then blocks: the write is cut here.
        def __reduce__(self):
            open(sys.argv[2], "w").close()
            time.sleep(120)
            return (int, (0,))

    states = {"a_model": {"w": torch.ones(50_000)}, "b_blocked": [torch.ones(10), Stall()],
              "c_after": 1}
    save_checkpoint(sys.argv[1], 2, states)
    """
)


def test_writer_killed_mid_write_is_never_picked(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    first = ck.save_checkpoint(root, 1, {"a_model": {"w": torch.zeros(3)}})
    script, flag = tmp_path / "child.py", tmp_path / "writing"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(flag)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None, "the writer exited before reaching the blocking state"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-global_step_2")]
    assert len(partial) == 1 and (partial[0] / "a_model.pt").is_file()
    assert not (partial[0] / "manifest.json").exists()
    assert not (root / "global_step_2").exists()
    assert ck.find_latest_checkpoint(root) == first
    assert ck.read_latest_marker(root) == 1
    # The next save succeeds and clears the leftover of the killed writer.
    second = ck.save_checkpoint(root, 2, {"a_model": {"w": torch.ones(3)}})
    assert ck.find_latest_checkpoint(root) == second
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_hf_export_loads_with_from_pretrained(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import models

    actor = models.load_actor(tiny_model_dir)
    tok = models.load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        actor.model.embed_tokens.weight.add_(0.5)  # differs from the saved base model
    path = ck.save_checkpoint(
        tmp_path, 2, {"actor": actor.state_dict()}, hf_model=actor, hf_tokenizer=tok
    )
    assert ck.is_complete(path)
    assert "huggingface/config.json" in json.loads((path / "manifest.json").read_text())["files"]
    loaded = AutoModelForCausalLM.from_pretrained(path / ck.HF_DIR)
    torch.testing.assert_close(
        loaded.state_dict()["lm_head.weight"], actor.state_dict()["lm_head.weight"]
    )
    assert AutoTokenizer.from_pretrained(path / ck.HF_DIR).eos_token == tok.eos_token
    assert set(ck.load_checkpoint(path)) == {"actor"}


def test_rng_state_round_trip(tmp_path: Path) -> None:
    import numpy as np

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    path = ck.save_checkpoint(tmp_path, 1, {"rng": ck.capture_rng_state()})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    ck.restore_rng_state(ck.load_state(path, "rng"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
