"""Resume exact at every point of an epoch: stopped at an epoch's last step, at the next epoch's
first step and in an epoch's middle, the run trains each prompt at the same steps as an unbroken
run, with `data.shuffle` on and off and a dataset the batch size does not divide (the last partial
batch of each epoch is dropped, as verl's training sampler does).

The prompts are recorded as the real loop hands them to `train_step`: `Example.index`, the row of
the training file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.trainer.test_driver import toy_overrides
from trainer.checkpoint import full_state as ckpt
from trainer.config import load_config
from trainer.driver import PPODriver
from trainer.exit_codes import REQUEUE_EXIT_CODE
from trainer.rewards.toy import write_toy_digits

ROWS, BATCH, EPOCHS = 14, 4, 2  # 3 batches per epoch, 2 rows dropped each epoch; 6 steps


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy14")
    write_toy_digits(out, train_size=ROWS, val_size=4, seed=0)
    return out


def _overrides(model: Path, data: Path, run: Path, shuffle: bool) -> list[str]:
    return toy_overrides(
        model, data, run, "algorithm.adv_estimator=grpo", f"data.train_batch_size={BATCH}",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", f"trainer.total_epochs={EPOCHS}",
        f"data.shuffle={str(shuffle).lower()}", "data.seed=3", "trainer.test_freq=-1", "trainer.save_freq=-1")


def _run(overrides: list[str], run: Path, seen: list[tuple[int, list[int]]], stop_after: int | None) -> int:
    """One process's run of the real loop; the prompts of each step recorded; a STOP request
    arrives during step `stop_after` (the run then checkpoints and exits for a requeue)."""
    driver = PPODriver(load_config(overrides))
    driver.stop.install = lambda *a: None  # type: ignore[method-assign]
    original = driver.train_step

    def step(examples):  # type: ignore[no-untyped-def]
        seen.append((driver.global_step, [e.index for e in examples]))
        metrics = original(examples)
        if driver.global_step == stop_after:
            (run / "STOP").touch()
        return metrics

    driver.train_step = step  # type: ignore[method-assign]
    return driver.fit()


@pytest.mark.parametrize("shuffle", [True, False])
def test_stops_at_an_epoch_end_the_next_start_and_a_middle_train_each_prompt_as_unbroken(
        tiny_model_dir: Path, small_data: Path, tmp_path: Path, shuffle: bool) -> None:
    straight: list[tuple[int, list[int]]] = []
    assert _run(_overrides(tiny_model_dir, small_data, tmp_path / "straight", shuffle),
                tmp_path / "straight", straight, None) == 0
    per_epoch = ROWS // BATCH
    assert [s for s, _ in straight] == list(range(1, per_epoch * EPOCHS + 1))
    for epoch in range(EPOCHS):  # each epoch: distinct prompts, the partial batch dropped
        rows = [i for _, batch in straight[epoch * per_epoch:(epoch + 1) * per_epoch] for i in batch]
        assert len(rows) == len(set(rows)) == per_epoch * BATCH
    if shuffle:  # the epochs are ordered differently (else the test would not tell epochs apart)
        assert straight[:per_epoch] != straight[per_epoch:]

    broken: list[tuple[int, list[int]]] = []
    run = tmp_path / "broken"
    # step 3: the last of epoch 1; step 4: the first of epoch 2; step 5: the middle of epoch 2
    for stop_after in (3, 4, 5):
        assert _run(_overrides(tiny_model_dir, small_data, run, shuffle), run, broken, stop_after) == REQUEUE_EXIT_CODE
        assert ckpt.find_latest_checkpoint(run) == run / f"global_step_{stop_after}"
    assert _run(_overrides(tiny_model_dir, small_data, run, shuffle), run, broken, None) == 0
    assert broken == straight
    assert Counter(i for _, b in broken for i in b) == Counter(i for _, b in straight for i in b)
