"""`hpcrl status` shows every run of a requeued job and its last complete checkpoint, read from
the run directory without torch; its completeness rule agrees with the trainer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.runinfo import checkpoint_is_complete, checkpoint_root, run_info


def save(root: Path, step: int) -> Path:
    from trainer import checkpoint as ckpt

    return ckpt.save_checkpoint(root, step, {"trainer_state": {"global_step": step}},
                                files={"config.yaml": "x: 1\n"})


def test_completeness_agrees_with_the_trainer(tmp_path: Path) -> None:
    from trainer import checkpoint as ckpt

    good = save(tmp_path, 2)
    cut = save(tmp_path, 3)
    (cut / "config.yaml").write_text("x")  # size no longer matches the manifest
    bare = save(tmp_path, 4)
    (bare / "manifest.json").unlink()  # killed before the manifest
    renamed = tmp_path / "global_step_9"
    save(tmp_path, 5).rename(renamed)  # manifest names another step
    for path in (good, cut, bare, renamed, tmp_path / "global_step_77"):
        assert checkpoint_is_complete(path) == ckpt.is_complete(path), path
    assert checkpoint_is_complete(good) and not checkpoint_is_complete(cut)


def test_checkpoint_root_follows_the_payload(tmp_path: Path) -> None:
    assert checkpoint_root(tmp_path, ["py", "-m", "trainer"]) == tmp_path / "checkpoints"
    assert checkpoint_root(tmp_path, ["trainer.default_local_dir=/ck"]) == Path("/ck")
    assert checkpoint_root(tmp_path, ["trainer.default_local_dir=ck"]) == tmp_path / "ck"


@pytest.fixture
def requeued_run(tmp_path: Path) -> Path:
    """Two finished runs and a third one going on; checkpoints at 4 (complete) and 6 (cut)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"payload": ["python", "-m", "trainer"]}))
    (run / "submission.json").write_text(json.dumps({"job_id": "31", "logs": {}}))
    for r, line in ((0, "job 31 restart 0: payload exited with status 3 ...; requeued job 31"),
                    (1, "job 31 restart 1: payload exited with status 3 ...; requeued job 31")):
        (run / str(r)).mkdir()
        (run / str(r) / "summary.txt").write_text(f"{line} (exit 3)\nnode n1 (rank 0): ...\n")
    (run / "2").mkdir()
    save(run / "checkpoints", 4)
    (save(run / "checkpoints", 6) / "manifest.json").unlink()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    return run


def test_run_info(requeued_run: Path) -> None:
    info = run_info(requeued_run)
    assert [r.restart for r in info.restarts] == [0, 1, 2]
    assert info.restarts[2].summary is None
    assert info.last_checkpoint == 4 and info.last_logged_step == 5
