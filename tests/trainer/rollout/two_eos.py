"""A tiny model whose generation config names two EOS ids, the tokenizer's `</s>` and a second
id that greedy decoding of the toy prompts really produces (as Qwen2.5-Instruct's `<|im_end|>`
and `<|endoftext|>`), and a check that a rollout through the trainer stops on either."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from trainer.tiny import EOS, vocabulary


def greedy_rollout(model: Path, data: Path, run: Path, engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy responses and response mask of the first 8 training prompts, generated through
    the trainer's own path (driver -> actor worker -> engine)."""
    from tests.trainer.test_driver import toy_overrides
    from trainer.config import load_config
    from trainer.driver import PPODriver

    driver = PPODriver(load_config(toy_overrides(
        model, data, run, "data.max_response_length=8", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"actor_rollout_ref.rollout.name={engine}")))
    batch = driver.generate([driver.train_set[i] for i in range(8)], validate=True)
    return batch.responses.clone(), batch.response_mask.clone()


def second_eos(responses: torch.Tensor, mask: torch.Tensor) -> int:
    """A token that some greedy response emits before its end and that is not `</s>`."""
    eos = vocabulary()[EOS]
    for row, m in zip(responses, mask, strict=True):
        for token in row[: int(m.sum()) - 1].tolist():
            if token != eos:
                return int(token)
    raise AssertionError("no greedy response has a token before its end to use as a second EOS")


def with_two_eos(model: Path, out: Path, second: int) -> Path:
    """A copy of `model` whose `generation_config.json` names `[</s>, second]` as EOS."""
    shutil.copytree(model, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [vocabulary()[EOS], second]
    path.write_text(json.dumps(config))
    return out


def expected_mask(responses: torch.Tensor, eos_ids: set[int]) -> list[list[int]]:
    """1 up to and including the first id of `eos_ids` in each row (re-derived row by row)."""
    rows = []
    for row in responses.tolist():
        out, ended = [], False
        for token in row:
            out.append(0 if ended else 1)
            ended = ended or token in eos_ids
        rows.append(out)
    return rows


def check_two_eos(model: Path, data: Path, tmp: Path, engine: str) -> None:
    """With one EOS the greedy responses run past `second`; with two they stop at its first
    occurrence, pad after it, and the mask ends there."""
    responses, mask = greedy_rollout(model, data, tmp / "one", engine)
    second = second_eos(responses, mask)
    two = with_two_eos(model, tmp / "two_eos_model", second)
    got, got_mask = greedy_rollout(two, data, tmp / "two", engine)
    eos = vocabulary()[EOS]
    assert got_mask.long().tolist() == expected_mask(got, {eos, second})
    stopped = [r for r, row in enumerate(responses.tolist()) if second in row[: int(mask[r].sum()) - 1]]
    assert stopped, "no response stops early on the second EOS"
    for r in stopped:
        n = int(got_mask[r].sum())
        assert int(got[r, n - 1]) == second and n < int(mask[r].sum())
        assert got[r, :n].tolist() == responses[r, :n].tolist()  # the same tokens up to the stop
        assert (got[r, n:] == 0).all()  # pad after the stop
