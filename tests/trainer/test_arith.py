"""The arithmetic word-problem task: generated from a seed, answers right, scored by format and
correctness."""

from __future__ import annotations

import re

import pytest

from trainer.rewards import default_compute_score
from trainer.rewards.arith import ARITH, FORMAT_PENALTY, arith_rows, arith_score


def test_rows_are_reproducible_and_the_splits_differ() -> None:
    assert arith_rows(20, 3, "train") == arith_rows(20, 3, "train")
    assert arith_rows(20, 3, "train") != arith_rows(20, 4, "train")
    train = {r["extra_info"]["question"] for r in arith_rows(200, 0, "train")}
    test = {r["extra_info"]["question"] for r in arith_rows(200, 0, "test")}
    assert len(train & test) < 5


def test_every_answer_follows_from_its_question() -> None:
    for row in arith_rows(400, 1, "test"):
        q, kind = row["extra_info"]["question"], row["extra_info"]["kind"]
        n = [int(x) for x in re.findall(r"\d+", q)]
        expected = {"add": n[0] + n[1], "sub": n[0] - n[1], "mul": n[0] * n[1],
                    "two_step": n[0] + n[1] - n[2] if len(n) > 2 else None}[kind]
        assert row["reward_model"]["ground_truth"] == str(expected) and expected > 0, row


@pytest.mark.parametrize(("response", "score", "acc"), [
    ("3 + 4 = 7.\n#### 7", 1.0, 1.0),
    ("3 + 4 = 7", 1.0 - FORMAT_PENALTY, 1.0),        # right, but not after ####
    ("#### 7 and then 12", 1.0, 1.0),                 # the number after #### counts
    ("#### 8, no wait 7", 0.0, 0.0),
    ("I do not know", 0.0, 0.0),
    ("#### 7.0", 1.0, 1.0),
])
def test_score_rewards_format_and_correctness(response: str, score: float, acc: float) -> None:
    got = arith_score(response, "7")
    assert (got["score"], got["acc"]) == (pytest.approx(score), acc)
    assert default_compute_score(ARITH, response, "7") == got


def test_kinds_are_mixed() -> None:
    kinds = [r["extra_info"]["kind"] for r in arith_rows(400, 0, "train")]
    assert set(kinds) == {"add", "sub", "mul", "two_step"}
    assert min(kinds.count(k) for k in set(kinds)) > 60
