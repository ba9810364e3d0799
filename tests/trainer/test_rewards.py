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
    assert default_compute_score("lighteval/MATH", "so \\boxed{2}", "2") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{3}", "2") == 0.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{.5}", "\\frac12") == 1.0
    assert default_compute_score("math_dapo", "Answer: 2", "2") == {"score": 1.0, "acc": True, "pred": "2"}
    assert default_compute_score("math", "Answer: 2", "3")["score"] == -1.0
    assert default_compute_score("aime2024", "Answer: 7", "7")["acc"] is True
    with pytest.raises(RewardError, match="custom_reward_function.path"):
        default_compute_score("my/dataset", "x", "y")


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
    with pytest.raises(RewardError, match="cannot be called as verl calls a reward function.*`data_source=`"):
        load_reward_fn(str(file), "other")  # positional names of its own: verl passes keywords
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return 'high'\n")
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


def test_reward_functions_are_called_by_keyword_with_the_reward_kwargs(tmp_path: Path) -> None:
    """verl calls `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)` and
    adds `custom_reward_function.reward_kwargs`, which win over the call's own keywords."""
    file = tmp_path / "kw.py"
    file.write_text(
        "def keyword_only(*, ground_truth, solution_str, extra_info, data_source, scale):\n"
        "    return {'score': scale * (solution_str == ground_truth), 'pred': solution_str,\n"
        "            'turns': extra_info['num_turns'] is None, 'seen': len(extra_info)}\n")
    fn = load_reward_fn(str(file), "keyword_only", {"scale": 2.0})
    scores, extras = score_responses(fn, ["s", "s"], ["4", "5"], ["4", "4"], [{"k": 1}, None])
    assert scores == [2.0, 0.0]
    assert extras == {"pred": ["4", "5"], "turns": [1.0, 1.0], "seen": [3.0, 2.0]}
    with pytest.raises(RewardError, match="`scale=`"):
        load_reward_fn(str(file), "keyword_only", {"scale": 1.0}, keywords=R.BATCH_ARGS)


def test_batch_manager_passes_the_reward_model_s_reward_kwargs() -> None:
    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, bonus):
        return [bonus + len(s) for s in solution_strs]

    scores, _ = R.score_batch(batch_fn, ["a", "b"], ["x", "yy"], [None] * 2, [None] * 2, {"bonus": 0.5})
    assert scores == [1.5, 2.5]


def test_math_boxed_answer_extraction() -> None:
    m = R.math_reward
    assert m.last_boxed_only_string("a \\boxed{x^{2}} b") == "\\boxed{x^{2}}"
    assert m.last_boxed_only_string("\\boxed{1} then \\boxed{\\frac{2}{3}}.") == "\\boxed{\\frac{2}{3}}"
    assert m.last_boxed_only_string("so \\boxed 5$ done") == "\\boxed 5"
    assert m.last_boxed_only_string("\\boxed{5") is None and m.last_boxed_only_string("no box") is None
    assert m.last_boxed_only_string("\\fbox{5}") == "\\fbox{5}"
    assert m.remove_boxed("\\boxed{x^{2}}") == "x^{2}" and m.remove_boxed("\\boxed 5") == "5"
    with pytest.raises(ValueError, match="not a box"):
        m.remove_boxed("\\fbox{5}")


@pytest.mark.parametrize(("answer", "truth"), [
    ("\\frac{1}{2}", "\\frac12"), ("0.5", "\\frac{1}{2}"), ("3/4", "\\frac{3}{4}"),
    ("\\dfrac{3}{4}", "\\frac34"), ("10^\\circ", "10"), ("x = 5", "5"), ("50\\%", "50"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("\\sqrt2", "\\sqrt{2}"), ("5 \\text{ cm}", "5"),
    (".5", "\\frac12"), ("\\$4", "4"),
])
def test_math_equivalent_answers_score_one(answer: str, truth: str) -> None:
    assert R.math_reward.compute_score(f"so the answer is \\boxed{{{answer}}}.", truth) == 1.0


def test_math_wrong_or_unreadable_answers_score_zero() -> None:
    m = R.math_reward
    assert m.compute_score("\\boxed{6}", "5") == 0.0
    assert m.compute_score("\\boxed{1} and \\boxed{2}", "1") == 0.0  # the last box counts
    assert m.compute_score("\\fbox{5}", "5") == 0.0  # found, but not a box to unwrap
    assert m.compute_score("the answer is 5", "5") == 0.0
    assert m.compute_score("\\boxed{12}", "1/2") == 0.0 and m.compute_score("\\boxed{1/2}", "1/2") == 1.0
    # the normaliser fails on a bare `\\sqrt`: the strings are compared as written
    assert m.is_equiv("\\sqrt", "\\sqrt") and not m.is_equiv("\\sqrt", "\\sqrt ")
    assert m.is_equiv(None, None) and not m.is_equiv("1", None)


@pytest.mark.parametrize(("response", "truth", "pred"), [
    ("so Answer: 42", "42", "42"), ("Answer: $\\frac{1}{2}$", "\\frac12", "\\frac{1}{2}"),
    ("answer: 1,000 dollars", "1000", "1000"), ("Answer: 3\nAnswer: 4\nthat is all", "4", "4"),
    ("Answer: x = 12", "12", "12"), ("ANSWER : \\text{(B)}", "(B)", "(B)"),
])
def test_dapo_math_correct_answers(response: str, truth: str, pred: str) -> None:
    assert R.math_dapo.compute_score(response, truth) == {"score": 1.0, "acc": True, "pred": pred}


def test_dapo_math_wrong_or_missing_answers() -> None:
    d = R.math_dapo
    assert d.compute_score("Answer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}
    assert d.compute_score("no final line", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert d.compute_score("Answer: 42" + " " * 300, "42")["pred"] == "[INVALID]"  # the last 300 characters
    assert d.normalize_final_answer("\\boxed{\\sqrt3}") == "\\sqrt{3}"
