"""verl-format data: reading, chat template, length policies, shuffling, loader state,
and the GSM8K preprocessing command."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer import preprocess
from trainer.data import (
    DataError,
    PromptDataset,
    PromptLoader,
    batches,
    chat_prompt_ids,
    epoch_order,
    truncate,
)

DATA = Path(__file__).parents[1] / "data"
SAMPLE = DATA / "gsm8k_train_sample.parquet"
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' </s> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A whitespace word-level tokenizer over the sample's words, with a chat template."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "</s>", "<|user|>", "<|assistant|>"]
    for row in pq.read_table(SAMPLE).to_pylist():
        words += row["prompt"][0]["content"].split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="</s>", model_input_names=["input_ids", "attention_mask"])
    fast.chat_template = TEMPLATE
    return fast


def test_reads_verl_rows_and_applies_the_chat_template(tokenizer) -> None:
    ds = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    assert len(ds) == 16
    ex = ds[0]
    assert ex.data_source == "openai/gsm8k" and ex.ability == "math"
    assert ex.ground_truth == "72" and ex.extra_info["index"] == 0
    content = ex.prompt[0]["content"]
    expected = tokenizer.convert_tokens_to_ids(["<|user|>", *content.split(), "</s>", "<|assistant|>"])
    assert ex.prompt_ids == expected
    assert chat_prompt_ids(tokenizer, ex.prompt) == expected


def test_chat_template_kwargs_reach_the_template(tokenizer) -> None:
    """`data.apply_chat_template_kwargs` goes to `apply_chat_template`, as verl passes it: here a
    template variable drops the user turn's end marker; the filter counts the rendered length."""
    template = TEMPLATE.replace("' </s> '", "(' ' if short else ' </s> ')").replace(
        "{% for", "{% set short = short | default(false) %}{% for", 1)
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>",
                                    unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = template
    plain = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    short = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512, chat_template_kwargs={"short": True})
    end = tokenizer.convert_tokens_to_ids("</s>")
    assert all(end in e.prompt_ids for e in plain) and not any(end in e.prompt_ids for e in short)
    assert [len(e.prompt_ids) for e in short] == [len(e.prompt_ids) - 1 for e in plain]
    limit = len(plain[0].prompt_ids) - 1  # the first prompt fits only without the marker
    assert PromptDataset([SAMPLE], tokenizer, max_prompt_length=limit, filter_overlong_prompts=True,
                         chat_template_kwargs={"short": True})[0].index == plain[0].index


def test_overlong_prompts_filtered_or_truncated_or_rejected(tokenizer) -> None:
    lengths = [len(e.prompt_ids) for e in PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)]
    limit = sorted(lengths)[8]
    kept = PromptDataset([SAMPLE], tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert len(kept) == sum(n <= limit for n in lengths) and kept.num_filtered == 16 - len(kept)
    assert all(len(e.prompt_ids) <= limit for e in kept)
    for policy in ("left", "right", "middle"):
        cut = PromptDataset([SAMPLE], tokenizer, max_prompt_length=limit, truncation=policy)
        assert len(cut) == 16 and max(len(e.prompt_ids) for e in cut) == limit
    with pytest.raises(DataError, match="filter_overlong_prompts=true"):
        PromptDataset([SAMPLE], tokenizer, max_prompt_length=limit)


def test_truncation_policies_match_verl() -> None:
    ids = list(range(10))
    assert truncate(ids, 4, "left", "x") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right", "x") == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle", "x") == [0, 1, 7, 8, 9]
    assert truncate(ids, 10, "error", "x") == ids


def test_missing_column_and_file_errors(tmp_path, tokenizer) -> None:
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "x"}]}]), bad)
    with pytest.raises(DataError, match="lacks column.*`data_source`"):
        PromptDataset([bad], tokenizer, max_prompt_length=8)
    with pytest.raises(DataError, match="does not exist.*trainer.preprocess"):
        PromptDataset([tmp_path / "nope.parquet"], tokenizer, max_prompt_length=8)


def test_reward_fn_key_names_the_column_that_selects_the_reward(tmp_path, tokenizer) -> None:
    """`data.reward_fn_key` (verl): another column than `data_source` picks the scorer."""
    rows = pq.read_table(SAMPLE).to_pylist()[:2]
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(pa.Table.from_pylist([{**{k: v for k, v in r.items() if k != "data_source"},
                                          "task": f"task-{i}"} for i, r in enumerate(rows)]), renamed)
    ds = PromptDataset([renamed], tokenizer, max_prompt_length=512, reward_fn_key="task")
    assert [e.data_source for e in ds.examples] == ["task-0", "task-1"]
    with pytest.raises(DataError, match="lacks column.*`data_source`"):
        PromptDataset([renamed], tokenizer, max_prompt_length=512)


def test_shuffle_is_seeded_and_differs_by_epoch() -> None:
    a = epoch_order(50, 0, shuffle=True, seed=1)
    assert a == epoch_order(50, 0, shuffle=True, seed=1) and sorted(a) == list(range(50))
    assert a != epoch_order(50, 1, shuffle=True, seed=1)
    assert a != epoch_order(50, 0, shuffle=True, seed=2)
    assert epoch_order(5, 3, shuffle=False, seed=1) == [0, 1, 2, 3, 4]


def test_loader_state_resumes_at_the_same_batch(tokenizer) -> None:
    ds = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    straight = PromptLoader(ds, 5, shuffle=True, seed=3)
    assert straight.batches_per_epoch == 3
    seen = [[e.index for e in straight.next_batch()] for _ in range(7)]
    assert sorted(i for b in seen[:3] for i in b) == sorted(set(i for b in seen[:3] for i in b))
    first = PromptLoader(ds, 5, shuffle=True, seed=3)
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    resumed = PromptLoader(ds, 5, shuffle=True, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [[e.index for e in resumed.next_batch()] for _ in range(3)] == seen[4:]
    other = PromptLoader(ds, 4, shuffle=True, seed=3)
    with pytest.raises(DataError, match="batch_size"):
        other.load_state_dict(state)


def test_loader_hands_out_a_batch_in_flight_first(tokenizer) -> None:
    """A position saved with the batch handed out ahead and not trained (`state_dict(ahead=...)`,
    the one-step-off loop's with a curriculum sampler) gives that batch first, then the rest."""
    ds = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    straight = PromptLoader(ds, 5, shuffle=True, seed=3)
    seen = [[e.index for e in straight.next_batch()] for _ in range(5)]
    first = PromptLoader(ds, 5, shuffle=True, seed=3)
    first.next_batch()
    state = json.loads(json.dumps(first.state_dict(ahead=first.next_batch())))
    assert "sampler" not in state  # the default order: nothing of a sampler's
    resumed = PromptLoader(ds, 5, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert [[e.index for e in resumed.next_batch()] for _ in range(4)] == seen[1:]


def test_loader_needs_a_full_batch(tokenizer) -> None:
    ds = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    with pytest.raises(DataError, match="fewer than `data.train_batch_size`=32"):
        PromptLoader(ds, 32, shuffle=False, seed=0)
    assert [len(b) for b in batches(ds, 6)] == [6, 6, 4] and len(batches(ds, None)) == 1


def test_preprocess_gsm8k_from_raw_jsonl_equals_verl_rows(tmp_path) -> None:
    rows = pq.read_table(SAMPLE).to_pylist()
    raw = tmp_path / "raw"
    raw.mkdir()
    with (raw / "train.jsonl").open("w") as fh:
        for row in rows:
            fh.write(json.dumps({"question": row["extra_info"]["question"],
                                 "answer": row["extra_info"]["answer"]}) + "\n")
    out = tmp_path / "out"
    assert preprocess.main(["gsm8k", "--input", str(raw), "--output", str(out)]) == 0
    made = pq.read_table(out / "train.parquet").to_pylist()
    assert made == rows


def test_preprocess_gsm8k_accepts_verl_parquet_and_rejects_junk(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert preprocess.main(["gsm8k", "--input", str(SAMPLE), "--output", str(out)]) == 0
    assert pq.read_table(out / "train.parquet").to_pylist() == pq.read_table(SAMPLE).to_pylist()
    (tmp_path / "junk").mkdir()
    assert preprocess.main(["gsm8k", "--input", str(tmp_path / "junk"), "--output", str(out)]) == 2
    assert "no GSM8K files" in capsys.readouterr().err


def test_gsm8k_final_answer() -> None:
    assert preprocess.gsm8k_final_answer("so 3 + 4\n#### 1,234") == "1234"
    assert preprocess.gsm8k_final_answer("#### -5") == "-5"
    with pytest.raises(preprocess.PreprocessError, match="no `#### <number>`"):
        preprocess.gsm8k_final_answer("no answer")
