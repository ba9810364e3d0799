"""Prompt data in verl's parquet format, tokenised through the chat template, and a loader
whose position is part of the checkpoint.

A row holds `data_source` (selects the reward function; another column with
`data.reward_fn_key`), `prompt` (a chat: list of
`{"role", "content"}`), `ability`, `reward_model` (`{"style", "ground_truth"}`) and
`extra_info` (free-form).

Rows made for verl's agent loops (an `agent_name` other than the single-turn default, or
`extra_info.tools_kwargs` / `extra_info.interaction_kwargs`) are refused: the rollout here is
single-turn, and training them single-turn would not be what they were made for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from trainer.config.rollout import SINGLE_TURN_AGENT

Truncation = Literal["error", "left", "right", "middle"]


class DataError(ValueError):
    """Input data is unusable; the message says which file/row and how to fix it."""


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...
    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Example:
    """One prompt row, with its token ids after the chat template (and truncation)."""

    index: int
    data_source: str
    prompt: list[dict[str, str]]
    ability: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    prompt_ids: list[int]
    agent_name: str = SINGLE_TURN_AGENT
    """verl's `agent_name` column: the agent loop that runs this row."""

    @property
    def ground_truth(self) -> Any:
        return self.reward_model.get("ground_truth")


#: verl's per-row arguments of its tool agent loop, under `extra_info` (verl's `RLHFDataset`
#: hands them to the agent loop as `tools_kwargs` and `interaction_kwargs`).
AGENT_LOOP_EXTRA = ("tools_kwargs", "interaction_kwargs")
#: The columns `agent_loop_refusal` reads.
AGENT_LOOP_COLUMNS = ("agent_name", "extra_info")


def _given(value: Any) -> bool:
    """Whether a parquet cell holds something (a struct column gives None, or a dict of Nones,
    for a row that lacks the entry other rows have)."""
    if isinstance(value, dict):
        return any(_given(v) for v in value.values())
    return value not in (None, "", [])


def agent_loop_use(row: Mapping[str, Any]) -> str | None:
    """What a data row asks of verl's agent loops (`agent_name=tool_agent`, `extra_info.tools_kwargs`),
    or None for a single-turn row. verl picks each row's loop by `agent_name`, default
    `single_turn_agent` (`rollout.agent.default_agent_loop`)."""
    agent = row.get("agent_name")
    if agent is not None and agent != SINGLE_TURN_AGENT:
        return f"`agent_name={agent}`"
    extra = row.get("extra_info")
    for key in AGENT_LOOP_EXTRA:
        if isinstance(extra, Mapping) and _given(extra.get(key)):
            return f"`extra_info.{key}`"
    return None


def agent_loop_refusal(rows: Sequence[Mapping[str, Any]], path: str | Path) -> str | None:
    """The refusal of the agent-loop rows among `rows` of the parquet file `path`, or None when
    every row is single-turn. One message for the trainer's load and the launcher's preflight."""
    uses = [(i, use) for i, use in enumerate(agent_loop_use(r) for r in rows) if use is not None]
    if not uses:
        return None
    first, what = uses[0]
    return (f"`{path}`: {len(uses)} of {len(rows)} rows (the first: row {first}, {what}) are made for "
            "verl's agent loops (multi-turn rollout with tools or interactions), which this trainer "
            "does not have yet: its rollout is single-turn (verl's `single_turn_agent`), and these rows "
            "would be trained single-turn without their tools. Fix: train on single-turn data (e.g. "
            "`python -m trainer.preprocess gsm8k`, or verl's `examples/data_preprocess/gsm8k.py`), or "
            "drop the `agent_name` column and `extra_info.tools_kwargs`/`interaction_kwargs` to train "
            "these prompts single-turn")


def agent_loop_file_refusal(path: str | Path) -> str | None:
    """`agent_loop_refusal` of a parquet file, reading only the columns it needs (the launcher's
    preflight)."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    columns = [c for c in AGENT_LOOP_COLUMNS if c in names]
    if not columns:
        return None
    return agent_loop_refusal(pq.read_table(path, columns=columns).to_pylist(), path)


def read_rows(files: Sequence[str | Path], prompt_key: str = "prompt",
              reward_fn_key: str = "data_source") -> list[dict[str, Any]]:
    """All rows of the parquet `files`, in order; fail naming a missing file or column, or rows
    made for verl's agent loops (`agent_loop_refusal`)."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise DataError(
                f"data file `{path}` does not exist; build it with "
                "`python -m trainer.preprocess gsm8k --input ... --output ...` or fix "
                "`data.train_files`/`data.val_files`"
            )
        table = pq.read_table(path)
        required = (prompt_key, reward_fn_key, "reward_model")
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise DataError(
                f"`{path}` lacks column(s) {', '.join(f'`{c}`' for c in missing)}; verl's format "
                f"needs {', '.join(f'`{c}`' for c in required)} (has: {', '.join(table.column_names)})"
            )
        found = table.to_pylist()
        refusal = agent_loop_refusal(found, path)
        if refusal is not None:
            raise DataError(refusal)
        rows.extend(found)
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Write `rows` to the parquet file `path` (what :func:`read_rows` reads), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def write_split(rows: list[dict[str, Any]], output_dir: str | Path, split: str) -> Path:
    """Write `rows` as `output_dir/<split>.parquet`, verl's layout; return the path."""
    path = Path(output_dir) / f"{split}.parquet"
    write_rows(rows, path)
    return path


def write_generated(output_dir: str | Path, rows_of: Callable[[int, int, str], list[dict[str, Any]]], *,
                    train_size: int, val_size: int, seed: int) -> dict[str, Path]:
    """`train.parquet` and `test.parquet` of a task generated by `rows_of(count, seed, split)`."""
    return {split: write_split(rows_of(count, seed, split), output_dir, split)
            for split, count in (("train", train_size), ("test", val_size))}


def chat_prompt_ids(tokenizer: ChatTokenizer, messages: list[dict[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ready to generate;
    `template_kwargs` go to `apply_chat_template` (verl's `data.apply_chat_template_kwargs`)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **dict(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate(ids: list[int], max_length: int, policy: Truncation, where: str) -> list[int]:
    """Cut `ids` to `max_length` tokens as `data.truncation` says (verl's semantics)."""
    if len(ids) <= max_length:
        return ids
    if policy == "left":
        return ids[-max_length:]
    if policy == "right":
        return ids[:max_length]
    if policy == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    raise DataError(
        f"{where}: prompt has {len(ids)} tokens, more than `data.max_prompt_length`={max_length}; "
        "raise `data.max_prompt_length`, set `data.filter_overlong_prompts=true` to drop such "
        "prompts, or `data.truncation=left|right|middle` to cut them"
    )


def _check_messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in value
    )
    if not ok:
        raise DataError(
            f"{where}: the prompt must be a chat list of {{`role`, `content`}} messages, "
            f"got {str(value)[:80]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


class PromptDataset:
    """The rows of some parquet files, tokenised, filtered or truncated to `max_prompt_length`."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer: ChatTokenizer,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        filter_overlong_prompts: bool = False,
        truncation: Truncation = "error",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.files = [str(f) for f in files]
        self.num_filtered = 0
        self.examples: list[Example] = []
        for index, row in enumerate(read_rows(files, prompt_key, reward_fn_key)):
            where = f"row {index} of {', '.join(self.files)}"
            messages = _check_messages(row[prompt_key], where)
            ids = chat_prompt_ids(tokenizer, messages, chat_template_kwargs)
            if filter_overlong_prompts and len(ids) > max_prompt_length:
                self.num_filtered += 1
                continue
            self.examples.append(Example(
                index=index,
                data_source=str(row[reward_fn_key]),
                prompt=messages,
                ability=str(row.get("ability") or ""),
                reward_model=dict(row["reward_model"] or {}),
                extra_info=dict(row.get("extra_info") or {}),
                prompt_ids=truncate(ids, max_prompt_length, truncation, where),
            ))
        if not self.examples:
            raise DataError(
                f"no usable prompts in {', '.join(self.files)} ({self.num_filtered} longer than "
                f"`data.max_prompt_length`={max_prompt_length} were filtered); raise "
                "`data.max_prompt_length` or check the files"
            )

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


def epoch_order(num_rows: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """Row order of one epoch: a permutation seeded by (`seed`, `epoch`), or 0..n-1."""
    import numpy as np

    if not shuffle:
        return list(range(num_rows))
    rng = np.random.default_rng([seed, epoch])
    return [int(i) for i in rng.permutation(num_rows)]


class PromptLoader:
    """Fixed-size batches over epochs; `(epoch, index)` is the whole state (checkpointed).

    The last incomplete batch of an epoch is dropped, as verl's training loader does.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool, seed: int) -> None:
        if len(dataset) < batch_size:
            raise DataError(
                f"{len(dataset)} usable prompts in {', '.join(dataset.files)} is fewer than "
                f"`data.train_batch_size`={batch_size}; lower the batch size or add data"
            )
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, list[int]()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _order_of(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = epoch_order(len(self.dataset), epoch, shuffle=self.shuffle, seed=self.seed)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[Example]:
        """The next batch; moves to the next epoch when this one is used up."""
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order_of(self.epoch)
        start = self.index * self.batch_size
        self.index += 1
        return [self.dataset[i] for i in order[start:start + self.batch_size]]

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": len(self.dataset),
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = [k for k in ("num_rows", "batch_size", "seed", "shuffle") if state.get(k) != mine[k]]
        if changed:
            detail = ", ".join(f"`{k}` {state.get(k)} -> {mine[k]}" for k in changed)
            raise DataError(
                f"the checkpoint's data-loader position does not fit this data ({detail}); "
                "resume with the same data and `data.*` settings, or start fresh with "
                "`trainer.resume_mode=disable`"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def batches(dataset: PromptDataset, batch_size: int | None) -> list[list[Example]]:
    """The whole dataset in order, in batches of `batch_size` (None: one batch), last kept."""
    size = batch_size or len(dataset)
    return [list(dataset.examples[i:i + size]) for i in range(0, len(dataset), size)]
