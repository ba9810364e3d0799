"""Rewards: verl's GSM8K scorer, selection by data_source, user functions, the toy task."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from trainer import preprocess
from trainer import rewards as R
from trainer.rewards import (
    RewardError,
    default_compute_score,
    gsm8k,
    load_reward_fn,
    score_responses,
    toy,
)


def test_gsm8k_strict() -> None:
    assert gsm8k.compute_score("so the answer is\n#### 72", "72") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0  # commas stripped
    assert gsm8k.compute_score("#### 10\n#### 12", "12") == 1.0  # last one counts
    assert gsm8k.compute_score("#### 12.", "12") == 0.0  # "12." != "12", as in verl
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0  # no `####`
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "72", format_score=0.1) == 0.0


def test_gsm8k_dollar_is_stripped_only_inside_the_match() -> None:
    # verl's pattern captures digits, dots and commas; `$` before the number stops the match.
    assert gsm8k.extract_solution("#### $5") is None
    assert gsm8k.extract_solution("#### -3,000") == "-3000"


def test_gsm8k_looks_only_at_the_last_300_characters() -> None:
    assert gsm8k.compute_score("#### 72" + " " * 300, "72") == 0.0
    assert gsm8k.compute_score("x" * 1000 + "#### 72", "72") == 1.0


def test_gsm8k_flexible() -> None:
    assert gsm8k.extract_solution("it is 5 then 7.", method="flexible") == "7."
    assert gsm8k.extract_solution("1 and . end", method="flexible") == "1"
    assert gsm8k.extract_solution("no numbers", method="flexible") is None
    assert gsm8k.compute_score("total: 42", "42", method="flexible") == 1.0
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("x", method="loose")  # type: ignore[arg-type]


def test_scorer_chosen_by_data_source() -> None:
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("toy_digits", "7 7 1 7 7", "7 7 7 7") == 0.75
    with pytest.raises(RewardError, match="custom_reward_function.path"):
        default_compute_score("lighteval/MATH", "x", "y")


def test_toy_digits_score_counts_first_four_units() -> None:
    assert toy.toy_digits_score("7 7 7 7 </s>") == 1.0
    assert toy.toy_digits_score("7777") == 1.0
    assert toy.toy_digits_score("say 7") == 0.25
    assert toy.toy_digits_score("") == 0.0
    assert toy.toy_digits_score("1 2 3 4 7 7") == 0.0


def test_toy_dataset_uses_only_the_tiny_vocabulary(tmp_path: Path) -> None:
    allowed = {str(d) for d in range(10)} | {"####"} | set(toy.PROMPT_WORDS)
    assert preprocess.main(["toy_digits", "--output", str(tmp_path), "--train-size", "40",
                            "--val-size", "8", "--seed", "3"]) == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 40 and len(pq.read_table(tmp_path / "test.parquet")) == 8
    for row in rows:
        assert row["data_source"] == "toy_digits"
        assert set(row["prompt"][0]["content"].split()) <= allowed
    assert rows == toy.toy_digits_rows(40, 3, "train")
    assert len({r["prompt"][0]["content"] for r in rows}) > 10


def test_custom_reward_function_from_file(tmp_path: Path) -> None:
    file = tmp_path / "my_reward.py"
    file.write_text(
        "def length_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 10, 'chars': len(solution_str)}\n"
    )
    fn = load_reward_fn(str(file), "length_score")
    scores, extras = score_responses(fn, ["any", "any"], ["abc", "abcdefghij"], [None, None], [{}, {}])
    assert scores == [0.3, 1.0] and extras == {"chars": [3.0, 10.0]}
    assert load_reward_fn(None, "compute_score") is default_compute_score


def test_custom_reward_function_errors(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match="does not exist"):
        load_reward_fn(str(tmp_path / "missing.py"), "compute_score")
    file = tmp_path / "r.py"
    file.write_text("def other(a, b, c, d=None):\n    return 1.0\n")
    with pytest.raises(RewardError, match="no function `compute_score`.*other"):
        load_reward_fn(str(file), "compute_score")
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(a, b, c, d=None):\n    return 'high'\n")
    with pytest.raises(RewardError, match="return a float"):
        score_responses(load_reward_fn(str(bad), "compute_score"), ["s"], ["x"], [None], [None])


def test_toy_prompts_and_sevens_have_no_unknown_tokens_in_the_tiny_tokenizer() -> None:
    from trainer.data import chat_prompt_ids
    from trainer.tiny import UNK, build_tokenizer

    tok = build_tokenizer()
    unk = tok.convert_tokens_to_ids(UNK)
    for row in toy.toy_digits_rows(30, 1):
        assert unk not in chat_prompt_ids(tok, row["prompt"])
    ids = tok("7 7 7 7", add_special_tokens=False)["input_ids"]
    assert toy.toy_digits_score(tok.decode(ids, skip_special_tokens=True)) == 1.0


def test_batch_manager_calls_once_with_lists() -> None:
    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):  # verl's batch signature
        calls.append(len(solution_strs))
        return [len(s) / 10 if i % 2 else {"score": 1.0, "acc": 1} for i, s in enumerate(solution_strs)]

    scores, extras = R.score_batch(batch_fn, ["a", "b", "c"], ["x", "yy", "zzz"], [None] * 3, [None] * 3)
    assert calls == [3] and scores == [1.0, 0.2, 1.0] and extras == {"acc": [1.0, 1.0]}
    with pytest.raises(R.RewardError, match="returned 2 results for 3 responses"):
        R.score_batch(lambda **kw: [0.0, 0.0], ["a"] * 3, ["x"] * 3, [None] * 3, [None] * 3)


def test_dapo_overlong_penalty_rises_linearly_over_the_buffer() -> None:
    # limit 10 tokens, buffer 4: no penalty up to 6 tokens, -0.25 per token after, -1 at 10
    assert R.overlong_penalty([3, 6, 7, 8, 10], 10, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert R.overlong_penalty([10], 10, 4, 0.5) == [-0.5]
