"""Hub model ids (`Qwen/Qwen2-7B-Instruct`) through the Hugging Face cache, offline, as
transformers and vLLM read it: a cache built here from the tiny model in huggingface_hub's layout
(`models--org--name/blobs`, `snapshots/<commit>/` of links, `refs/main`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl import preflight as pf
from trainer import hub
from trainer import models as M

REPO_ID = "Qwen/Qwen2-7B-Instruct"
COMMIT = "a" * 40


def fill_cache(hf_home: Path, model_dir: Path, repo_id: str = REPO_ID) -> Path:
    """`model_dir` as huggingface_hub stores a download of `repo_id` at `main` under `hf_home`."""
    folder = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    (folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hf_home = tmp_path / "hf"
    snapshot = fill_cache(hf_home, tiny_model_dir)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # `Qwen/...` is no local path here
    return snapshot


def test_a_hub_id_loads_from_the_cache_offline(offline_cache: Path, tiny_model_dir: Path) -> None:
    assert M.resolve_model_path(REPO_ID) == (str(offline_cache), None)
    assert M.load_tokenizer(REPO_ID).vocab_size == M.load_tokenizer(tiny_model_dir).vocab_size
    got, want = M.load_actor(REPO_ID).state_dict(), M.load_actor(tiny_model_dir).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_transformers_reads_the_same_snapshot(offline_cache: Path) -> None:
    # huggingface_hub itself (what transformers and vLLM call with a hub id), in a fresh process
    code = ("from huggingface_hub import snapshot_download; from transformers import AutoConfig; "
            f"print(snapshot_download({REPO_ID!r})); AutoConfig.from_pretrained({REPO_ID!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(offline_cache)


def test_a_missing_id_offline_names_hf_home_and_how_to_fill_it(offline_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(hub.HubModelError) as err:
        M.resolve_model_path("Qwen/Qwen2-72B-Instruct")
    text = str(err.value)
    assert f"`HF_HOME={tmp_path / 'hf'}`" in text and "HF_HUB_OFFLINE=1" in text
    assert "hf download Qwen/Qwen2-72B-Instruct" in text and "`actor_rollout_ref.model.path=" in text


def test_an_unreachable_hub_fails_naming_the_download(offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # no hub here (and, where there is one, no such repository): the download fails, said so
    with pytest.raises(hub.HubModelError, match="downloading it failed.*hf download hpcrl-tests/no-such-model"):
        M.resolve_model_path("hpcrl-tests/no-such-model", "critic.model.path")
    assert M.resolve_model_path(REPO_ID)[0] == str(offline_cache)  # the cache needs no hub


def test_local_paths_are_not_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not hub.is_hub_id("org/model")  # exists here: a relative local directory
    assert hub.is_hub_id("Qwen/Qwen2-7B-Instruct")
    assert not any(hub.is_hub_id(p) for p in ("/abs/x", "./a/b", "~/a", "a/b/c", "model.gguf"))
    env = {"HOME": "/h"}
    assert hub.hub_cache(env) == Path("/h/.cache/huggingface/hub")
    assert hub.hub_cache({**env, "XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub.hub_cache({**env, "HF_HOME": "/f"}) == Path("/f/hub")
    assert hub.hub_cache({**env, "HF_HOME": "/f", "HF_HUB_CACHE": "/c"}) == Path("/c")


def test_preflight_reads_the_jobs_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    snapshot = fill_cache(tmp_path / "site-hf", tiny_model_dir)
    overrides = {"actor_rollout_ref.model.path": REPO_ID}
    path, problems = pf.check_model(overrides, {}, tmp_path, {"HF_HOME": str(tmp_path / "site-hf")})
    assert path == snapshot and problems == []
    path, problems = pf.check_model(overrides, {}, tmp_path, {"HF_HOME": str(tmp_path / "empty")})
    assert path is None and len(problems) == 1
    assert f"`HF_HOME={tmp_path / 'empty'}`" in problems[0] and f"hf download {REPO_ID}" in problems[0]
    assert "compute nodes" in problems[0]


@pytest.mark.slow
def test_a_run_with_hub_ids_trains_and_checkpoints_offline(offline_cache: Path, tmp_path: Path) -> None:
    from trainer.checkpoint import full_state as ckpt
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.metrics import read_jsonl
    from trainer.rewards.toy import write_toy_digits

    data, run = tmp_path / "toy", tmp_path / "run"
    write_toy_digits(data, train_size=16, val_size=4, seed=0)
    cfg = load_config([
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", f"actor_rollout_ref.model.path={REPO_ID}",
        f"critic.model.path={REPO_ID}", "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", "trainer.val_before_train=false",
        "trainer.device=cpu", f"trainer.default_local_dir={run}", "trainer.logger=jsonl",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=1", "trainer.save_freq=1"])
    assert run_training(cfg) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert (ckpt.find_latest_checkpoint(run) / "huggingface" / "config.json").is_file()
