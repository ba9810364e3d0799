"""Prompt data in verl's parquet format, tokenised through the chat template, and a loader
whose position is part of the checkpoint.

A row holds `data_source` (selects the reward function; another column with
`data.reward_fn_key`), `prompt` (a chat: list of
`{"role", "content"}`), `ability`, `reward_model` (`{"style", "ground_truth"}`) and
`extra_info` (free-form).

Each row runs through the agent loop its `agent_name` column names (`single_turn_agent` by
default, `tool_agent`, or a registered custom loop; :mod:`trainer.agent`), with its
`extra_info.tools_kwargs` and `interaction_kwargs`. A row giving arguments to a tool the tool
config does not define is refused: it would be trained without the tool it was made for.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
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


def _given(value: Any) -> bool:
    """Whether a parquet cell holds something (a struct column gives None, or a dict of Nones,
    for a row that lacks the entry other rows have)."""
    if isinstance(value, dict):
        return any(_given(v) for v in value.values())
    return value not in (None, "", [])


def row_agent_name(row: Mapping[str, Any], default: str = SINGLE_TURN_AGENT) -> str:
    """The agent loop of a data row: its `agent_name`, or `default` without one (verl's
    `rollout.agent.default_agent_loop`, `AgentLoopWorker.generate_sequences`)."""
    agent = row.get("agent_name")
    return str(agent) if _given(agent) else default


def row_tools(row: Mapping[str, Any]) -> list[str]:
    """The tools a row's `extra_info.tools_kwargs` gives arguments to (verl's tool agent loop
    passes `tools_kwargs[name]["create_kwargs"]` to the tool `name`)."""
    extra = row.get("extra_info")
    kwargs = extra.get("tools_kwargs") if isinstance(extra, Mapping) else None
    return sorted(k for k, v in kwargs.items() if _given(v)) if isinstance(kwargs, Mapping) else []


def tools_refusal(rows: Sequence[Mapping[str, Any]], path: str | Path, tools: Collection[str]) -> str | None:
    """The refusal of rows of the parquet file `path` whose `tools_kwargs` name a tool that is not
    among `tools` (those of `multi_turn.tool_config_path`), or None. Such a row would run without
    the tool it was made for (verl's loop only logs a warning when the model calls it). One
    message for the trainer's load and the launcher's preflight."""
    missing = [(i, [t for t in row_tools(r) if t not in tools]) for i, r in enumerate(rows)]
    missing = [(i, names) for i, names in missing if names]
    if not missing:
        return None
    first, names = missing[0]
    have = ", ".join(f"`{t}`" for t in sorted(tools)) or "none"
    return (f"`{path}`: {len(missing)} of {len(rows)} rows (the first: row {first}) give arguments to "
            f"the tool(s) {', '.join(f'`{t}`' for t in names)} in `extra_info.tools_kwargs`, which the "
            f"tool config does not define (tools configured: {have}); they would be trained without "
            "their tool. Fix: set `actor_rollout_ref.rollout.multi_turn.tool_config_path` to the tool "
            "config that defines them (verl's `gsm8k_tool_config.yaml` defines `calc_gsm8k_reward`)")


def configured_tool_names(path: Path) -> set[str] | None:
    """The tool names a verl tool config file defines, read from its YAML alone (the launcher
    imports no tool); None when that cannot tell (no such file, or an entry without
    `tool_schema.function.name`, whose class gives its own schema): the trainer checks then."""
    import yaml

    try:
        tree = yaml.safe_load(path.read_text())
        names = {entry["tool_schema"]["function"]["name"] for entry in tree["tools"]}
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return {str(n) for n in names}


def tools_file_refusal(path: str | Path, tools: Collection[str]) -> str | None:
    """`tools_refusal` of a parquet file, reading only the columns it needs (the launcher's
    preflight)."""
    import pyarrow.parquet as pq

    if "extra_info" not in pq.read_schema(path).names:
        return None
    return tools_refusal(pq.read_table(path, columns=["extra_info"]).to_pylist(), path, tools)


def read_rows(files: Sequence[str | Path], prompt_key: str = "prompt",
              reward_fn_key: str = "data_source", tools: Collection[str] | None = None) -> list[dict[str, Any]]:
    """All rows of the parquet `files`, in order; fail naming a missing file or column, or (given
    the configured `tools`) rows whose tools are not configured (`tools_refusal`)."""
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
        refusal = None if tools is None else tools_refusal(found, path, tools)
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
        tool_schemas: Sequence[Mapping[str, Any]] | None = None,
        length_tool_schemas: Sequence[Mapping[str, Any]] | None = None,
        tools: Collection[str] | None = None,
        default_agent: str = SINGLE_TURN_AGENT,
        agents: Collection[str] | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """`tool_schemas`: rendered into every prompt (`tools=`, verl's `data.tool_config_path`);
        `length_tool_schemas`: the schemas the length check renders with, when they differ (verl's
        `RLHFDataset.maybe_filter_out_long_prompts` renders with `data.tool_config_path`, which
        defaults to `multi_turn.tool_config_path`: the schemas the tool agent loop puts in its prompt);
        `tools`: the tool names rows may give arguments to (None: not checked); `default_agent`:
        the loop of a row without `agent_name`; `agents`: the loops a row may name (None: not
        checked); `rows`: the rows themselves, in verl's row format, in place of reading `files`
        (those a dataset class of the user's gives, :mod:`trainer.data_classes`)."""
        self.files = [str(f) for f in files]
        self.num_filtered = 0
        self.examples: list[Example] = []
        template = dict(chat_template_kwargs or {})
        if tool_schemas:
            template["tools"] = [dict(t) for t in tool_schemas]
        measured = dict(chat_template_kwargs or {})
        if length_tool_schemas:
            measured["tools"] = [dict(t) for t in length_tool_schemas]
        if rows is None:
            rows = read_rows(files, prompt_key, reward_fn_key, tools)
        elif tools is not None and (refusal := tools_refusal(rows, ", ".join(self.files), tools)) is not None:
            raise DataError(refusal)
        for index, row in enumerate(rows):
            where = f"row {index} of {', '.join(self.files)}"
            agent = row_agent_name(row, default_agent)
            if agents is not None and agent not in agents:
                known = ", ".join(f"`{a}`" for a in sorted(agents))
                raise DataError(
                    f"{where}: `agent_name={agent}` is not an agent loop here (known: {known}). Fix: name "
                    "one of them, or register yours in the file of "
                    "`actor_rollout_ref.rollout.agent.agent_loop_config_path`")
            messages = _check_messages(row[prompt_key], where)
            ids = chat_prompt_ids(tokenizer, messages, template)
            length = len(ids) if measured == template else len(chat_prompt_ids(tokenizer, messages, measured))
            if filter_overlong_prompts and length > max_prompt_length:
                self.num_filtered += 1
                continue
            if truncation == "error" and len(ids) <= max_prompt_length < length:
                raise DataError(
                    f"{where}: prompt has {length} tokens rendered with the tool schemas of "
                    "`actor_rollout_ref.rollout.multi_turn.tool_config_path` (as the tool agent loop renders "
                    f"it), more than `data.max_prompt_length`={max_prompt_length}; raise "
                    "`data.max_prompt_length` or set `data.filter_overlong_prompts=true` to drop such prompts")
            self.examples.append(Example(
                index=index,
                data_source=str(row[reward_fn_key]),
                prompt=messages,
                ability=str(row.get("ability") or ""),
                reward_model=dict(row["reward_model"] or {}),
                extra_info=dict(row.get("extra_info") or {}),
                prompt_ids=truncate(ids, max_prompt_length, truncation, where),
                agent_name=agent,
            ))
        if not self.examples:
            raise DataError(
                f"no usable prompts in {', '.join(self.files)} ({self.num_filtered} longer than "
                f"`data.max_prompt_length`={max_prompt_length} were filtered); raise "
                "`data.max_prompt_length` or check the files"
            )

    def __len__(self) -> int:
        return len(self.examples)

    @functools.cached_property
    def positions(self) -> dict[int, int]:
        """Each example's `index` (its row in the files) -> its position here (after filtering)."""
        return {e.index: i for i, e in enumerate(self.examples)}

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
    """Fixed-size batches over epochs; `(epoch, index)` is the position (checkpointed).

    The last incomplete batch of an epoch is dropped, as verl's training loader does. With a
    `sampler` (the user's `data.sampler`, :mod:`trainer.data_classes`) the order is the
    sampler's, as verl's loader draws it with `dataloader_num_workers=0`: one `iter(sampler)` per
    epoch, drawn a batch at a time (so an `update` after a step can change the batches after it),
    `len(sampler) // batch_size` batches. Its position in a checkpoint: the sampler's own
    `state_dict()` when it has `state_dict`/`load_state_dict` (torchdata's protocol, what verl's
    `StatefulDataLoader` saves), loaded at the resume, its iterator then continuing the epoch;
    else the resume replays the run's draws from a fresh sampler (every earlier epoch, then this
    one's batches so far) and checks them against a digest of the batches trained, refusing a
    sampler that draws others.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool, seed: int,
                 sampler: Any = None) -> None:
        self.sampler = sampler
        self.epoch_size = len(dataset) if sampler is None else len(sampler)
        if self.epoch_size < batch_size:
            what = "usable prompts in" if sampler is None else f"indices per epoch from the sampler `{_name(sampler)}` over"
            raise DataError(
                f"{self.epoch_size} {what} {', '.join(dataset.files)} is fewer than "
                f"`data.train_batch_size`={batch_size}; lower the batch size or add data"
            )
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, list[int]()
        self._draws: Iterator[Any] | None = None
        """The sampler's iterator of this epoch (None: not begun)."""
        self._digest = ""
        """A digest of the sampler's draws of this epoch, batch after batch."""
        self._ahead: list[int] | None = None
        """A batch a checkpoint's run had handed out and not trained: handed out first."""

    @property
    def batches_per_epoch(self) -> int:
        return self.epoch_size // self.batch_size

    @property
    def curriculum(self) -> bool:
        """Whether the sampler wants each trained batch (`update(batch)`, verl's
        `AbstractCurriculumSampler`)."""
        return callable(getattr(self.sampler, "update", None))

    def update(self, batch: Any) -> None:
        """Hand a trained batch to a curriculum sampler (verl calls `sampler.update(batch=batch)`
        after each step)."""
        if self.curriculum:
            self.sampler.update(batch=batch)

    def _order_of(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = epoch_order(len(self.dataset), epoch, shuffle=self.shuffle, seed=self.seed)
            self._order_epoch = epoch
        return self._order

    def example_at(self, position: int) -> Example:
        """The prompt at `position` of the run's prompt order, epoch after epoch (position
        `epoch * len(dataset) + i` is the `i`-th of that epoch's order): the fully-async
        rollouter hands prompts out one at a time by position."""
        if self.sampler is not None:  # `check_run` refuses a sampler under the fully-async loop
            raise DataError("a `data.sampler` draws its order lazily; prompts cannot be taken by position")
        epoch, i = divmod(position, len(self.dataset))
        return self.dataset[self._order_of(epoch)[i]]

    def _draw(self) -> list[int]:
        """The sampler's next batch of indices, checked."""
        if self._draws is None:
            self._draws = iter(self.sampler)
        picked = list(itertools.islice(self._draws, self.batch_size))
        name, size = _name(self.sampler), len(self.dataset)
        if len(picked) < self.batch_size:
            raise DataError(
                f"the sampler `{name}` stopped after {self.index * self.batch_size + len(picked)} indices in "
                f"epoch {self.epoch}, fewer than its `len()`={self.epoch_size}; the loader draws "
                f"{self.batches_per_epoch} batches of {self.batch_size} per epoch. Fix: make `__len__` "
                "return the number of indices `__iter__` yields")
        try:
            rows = [operator.index(i) for i in picked]
        except TypeError:
            rows = []
        if len(rows) < len(picked) or not all(0 <= i < size for i in rows):
            raise DataError(f"the sampler `{name}` yielded {picked[:8]!r}...: a sampler yields row indices, "
                            f"integers from 0 to {size - 1} (the dataset's {size} prompts). Fix its `__iter__`")
        self._digest = hashlib.sha256(f"{self._digest}:{rows}".encode()).hexdigest()
        return rows

    def next_batch(self) -> list[Example]:
        """The next batch; moves to the next epoch when this one is used up."""
        if self._ahead is not None:  # counted in the position already
            rows, self._ahead = self._ahead, None
            return [self.dataset[i] for i in rows]
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._draws, self._digest = None, ""
        if self.sampler is not None:
            rows = self._draw()
        else:
            start = self.index * self.batch_size
            rows = self._order_of(self.epoch)[start:start + self.batch_size]
        self.index += 1
        return [self.dataset[i] for i in rows]

    def state_dict(self, ahead: Sequence[Example] | None = None) -> dict[str, Any]:
        """The position; `ahead`: the last batch handed out, not trained yet (one-step-off's batch in
        flight when a curriculum sampler's update came after it), which a resume hands out first."""
        state: dict[str, Any] = {"epoch": self.epoch, "index": self.index, "num_rows": len(self.dataset),
                                 "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}
        if ahead is not None:
            state["ahead"] = [self.dataset.positions[e.index] for e in ahead]
        if self.sampler is not None:
            state["sampler"] = {"class": _name(self.sampler), "size": self.epoch_size, "digest": self._digest,
                                "state": _sampler_state(self.sampler)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine: dict[str, Any] = {"num_rows": len(self.dataset), "batch_size": self.batch_size, "seed": self.seed,
                                "shuffle": self.shuffle}
        changed = [k for k in ("num_rows", "batch_size", "seed", "shuffle") if state.get(k) != mine[k]]
        saved = state.get("sampler")
        had = None if saved is None else f"{saved['class']} of {saved['size']}"
        has = None if self.sampler is None else f"{_name(self.sampler)} of {self.epoch_size}"
        if had != has:
            changed.append("sampler")
            state, mine = {**state, "sampler": had}, {**mine, "sampler": has}
        if changed:
            detail = ", ".join(f"`{k}` {state.get(k)} -> {mine[k]}" for k in changed)
            raise DataError(
                f"the checkpoint's data-loader position does not fit this data ({detail}); "
                "resume with the same data and `data.*` settings, or start fresh with "
                "`trainer.resume_mode=disable`"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._draws, self._digest = None, ""
        self._ahead = None if state.get("ahead") is None else [int(i) for i in state["ahead"]]
        if saved is not None:
            self._resume_sampler(saved)

    def _resume_sampler(self, saved: dict[str, Any]) -> None:
        """Put the sampler where the checkpoint's run left it: its own state, or a replay of the
        run's draws checked against the digest of the batches trained."""
        midway = self.index < self.batches_per_epoch
        if saved["state"] is not None:
            if not _stateful(self.sampler):
                raise DataError(f"the checkpoint holds a state of the sampler `{saved['class']}`, which has no "
                                "`load_state_dict` now. Fix: resume with the sampler that wrote it")
            self.sampler.load_state_dict(saved["state"])
            self._digest = saved["digest"]
            self._draws = iter(self.sampler) if midway else None  # torchdata: the iterator continues
            return
        epoch, index = self.epoch, self.index
        for past in range(epoch + 1):  # `_draw` names the epoch and batch it is at
            self.epoch, self._draws, self._digest = past, None, ""
            for batch in range(self.batches_per_epoch if past < epoch else index):
                self.index = batch
                self._draw()
        self.index = index
        if self._digest != saved["digest"]:
            raise DataError(
                f"the sampler `{saved['class']}` draws other prompts on the resume's replay than the run trained "
                f"(the first {index} batch(es) of epoch {epoch}): its order does not follow from its "
                "construction (an unseeded generator, or an order its `update` changed), so the prompts not yet "
                "trained cannot be told. Fix: give it `state_dict()`/`load_state_dict()` that restore its order "
                "(torchdata's protocol, which verl's StatefulDataLoader saves), or seed it from "
                "`data_config.seed`; or start fresh with `trainer.resume_mode=disable`")
        if not midway:  # the next batch begins an epoch: a new iterator
            self._draws = None


def _name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _stateful(sampler: Any) -> bool:
    """torchdata's `Stateful`: callable `state_dict` and `load_state_dict`."""
    return callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))


def _sampler_state(sampler: Any) -> Any:
    """A copy of a stateful sampler's `state_dict()` (None for another), checked to load back
    from a checkpoint (tensors and plain containers: torch's `weights_only` load)."""
    if not _stateful(sampler):
        return None
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)
    except Exception as exc:  # torch's UnpicklingError naming the type
        raise DataError(
            f"the `state_dict()` of the sampler `{_name(sampler)}` cannot be loaded from a checkpoint ({exc}). "
            "Fix: keep tensors, numbers, strings and lists/dicts of them in it (no numpy arrays or objects)"
        ) from exc


def batches(dataset: PromptDataset, batch_size: int | None) -> list[list[Example]]:
    """The whole dataset in order, in batches of `batch_size` (None: one batch), last kept."""
    size = batch_size or len(dataset)
    return [list(dataset.examples[i:i + size]) for i in range(0, len(dataset), size)]
