"""Build verl-format parquet files from a local copy of a dataset.

`python -m trainer.preprocess gsm8k --input DIR_OR_FILE --output DIR` accepts GSM8K as the raw
release (`train.jsonl`/`test.jsonl` with `question` and `answer`, or the Hugging Face parquet
with the same columns) or as verl parquet, and writes `DIR/train.parquet` and
`DIR/test.parquet` with the columns verl's own `gsm8k.py` writes.
`python -m trainer.preprocess toy_digits --output DIR` writes the toy task (see
`trainer.rewards.toy`), `... arith --output DIR` the arithmetic word problems
(`trainer.rewards.arith`), both generated from `--seed`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.data import write_split
from trainer.rewards.arith import write_arith
from trainer.rewards.gsm8k import INSTRUCTION
from trainer.rewards.toy import write_toy_digits

GSM8K_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")


class PreprocessError(ValueError):
    """Input cannot be turned into verl rows; the message says why and what to pass instead."""


def gsm8k_final_answer(answer: str) -> str:
    """The number after `#### ` in a GSM8K solution, commas removed (verl's extract_solution)."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise PreprocessError(f"GSM8K answer has no `#### <number>` line: {answer[-80:]!r}")
    return match.group(0).split("#### ")[1].replace(",", "")


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One verl row, exactly as verl's `examples/data_preprocess/gsm8k.py` builds it."""
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_final_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        with path.open() as fh:
            return [json.loads(line) for line in fh if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise PreprocessError(f"`{path}`: expected a `.jsonl` or `.parquet` file")


def gsm8k_rows(records: list[dict[str, Any]], split: str, source: Path) -> list[dict[str, Any]]:
    """Raw (`question`, `answer`) records or verl rows -> verl rows for `split`."""
    rows = []
    for index, rec in enumerate(records):
        if "question" in rec and "answer" in rec:
            rows.append(gsm8k_row(rec["question"], rec["answer"], split, index))
        elif {"prompt", "reward_model", "data_source"} <= set(rec):
            rows.append(rec)
        else:
            raise PreprocessError(
                f"`{source}` row {index} has columns {sorted(rec)}; expected GSM8K's "
                "`question` and `answer` or verl's `data_source`, `prompt`, `reward_model`"
            )
    return rows


def find_split_files(input_path: Path) -> dict[str, Path]:
    """`{split: file}` for a directory (train*/test* .jsonl/.parquet, also under `main/`) or a file."""
    if input_path.is_file():
        split = "test" if "test" in input_path.name else "train"
        return {split: input_path}
    if not input_path.is_dir():
        raise PreprocessError(f"`--input {input_path}` does not exist")
    found: dict[str, Path] = {}
    for folder in (input_path, input_path / "main"):
        for split in SPLITS:
            for pattern in (f"{split}.jsonl", f"{split}*.parquet"):
                matches = sorted(folder.glob(pattern)) if folder.is_dir() else []
                if matches and split not in found:
                    found[split] = matches[0]
    if not found:
        raise PreprocessError(
            f"no GSM8K files in `{input_path}`: expected `train.jsonl`/`test.jsonl` or "
            "`train*.parquet`/`test*.parquet` (optionally under `main/`)"
        )
    return found


def preprocess_gsm8k(input_path: Path, output_dir: Path) -> dict[str, int]:
    """Write `output_dir/<split>.parquet` for each split found; return rows per split."""
    counts = {}
    for split, file in find_split_files(input_path).items():
        rows = gsm8k_rows(_read_records(file), split, file)
        write_split(rows, output_dir, split)
        counts[split] = len(rows)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=["gsm8k", "toy_digits", "arith"], help="which dataset to build")
    parser.add_argument("--input", type=Path, help="gsm8k: local copy, a directory or one file")
    parser.add_argument("--output", required=True, type=Path, help="directory for <split>.parquet")
    parser.add_argument("--train-size", type=int, default=256, help="toy_digits, arith: training rows")
    parser.add_argument("--val-size", type=int, default=64, help="toy_digits, arith: validation rows")
    parser.add_argument("--seed", type=int, default=0, help="toy_digits, arith: generator seed")
    args = parser.parse_args(argv)
    if args.dataset == "gsm8k" and args.input is None:
        parser.error("gsm8k needs `--input DIR_OR_FILE` (a local GSM8K copy)")
    try:
        if args.dataset in ("toy_digits", "arith"):
            write = write_toy_digits if args.dataset == "toy_digits" else write_arith
            write(args.output, train_size=args.train_size, val_size=args.val_size, seed=args.seed)
            counts = {"train": args.train_size, "test": args.val_size}
        else:
            counts = preprocess_gsm8k(args.input, args.output)
    except (PreprocessError, json.JSONDecodeError) as err:
        print(f"python -m trainer.preprocess: error: {err}", file=sys.stderr)
        return 2
    for split, n in counts.items():
        print(f"{args.output / (split + '.parquet')}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
