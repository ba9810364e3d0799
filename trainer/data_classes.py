"""verl's `data.custom_cls` (a dataset class of the user's) and `data.sampler` (a sampler class of
the user's), loaded and checked as verl loads them, and plugged into the trainer's data path.

**The dataset class** (`data.custom_cls.path` + `.name`): loaded as verl's `load_extern_object`
loads it (a file path, `file://` or `pkg://module`), required, as verl requires it, to subclass
`torch.utils.data.Dataset` (a map-style one: `__len__` and `__getitem__`), and constructed as
verl's `create_rl_dataset` constructs it: `cls(data_files=..., tokenizer=..., processor=None,
config=<the data section as an OmegaConf DictConfig>, max_samples=-1)` (no processor: the
trainer reads text; `data.train_max_samples` is accepted only at -1). It serves the training and
the validation files, as in verl. Each item is read once, at the start, through one adapter
(:func:`item_row`) into the row the parquet reader gives, and from there into an `Example`
exactly as a parquet row is (chat template, truncation or filtering, agent loop and tool checks):

- the chat: `raw_prompt` (what verl's `RLHFDataset.__getitem__` returns, rendered by verl's agent
  loop), else the `data.prompt_key` column; messages with text content only;
- `data.reward_fn_key` (`data_source`), `reward_model` (`ground_truth`), `extra_info`,
  `ability`, `agent_name`; a top-level `tools_kwargs`/`interaction_kwargs` (where verl's dataset
  copies them) goes into `extra_info` when the item's `extra_info` lacks it;
- `input_ids`, `attention_mask`, `position_ids`, `raw_prompt_ids`, `full_prompts`, `index`,
  `dummy_tensor`: what verl derives again (verl's agent loop renders `raw_prompt` too).

Anything else is refused naming the key: images, videos, audio (the trainer reads text), and
keys this trainer would not pass on (move them into `extra_info`, which reaches the reward
function). A class with `on_batch_end` (verl's dynamic-dataset hook, changing items while
training) is refused: the items are read once.

**The sampler class** (`data.sampler.class_path` + `.class_name`): verl's `AbstractSampler`
duck-typed (hpcrl does not import verl): constructed as `cls(data_source=dataset,
data_config=...)`, with `__iter__` yielding row indices and `__len__`; one with `update(batch)`
is a curriculum sampler (verl's `AbstractCurriculumSampler`) and gets each trained batch
(:class:`TrainedBatch`, verl's `DataProto` names) after the step's update, before its
checkpoint (verl calls it after saving, so its resume misses the last step's update). The order
and the resume: :class:`trainer.data.PromptLoader`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.data import DataError

__all__ = ["SamplerSource", "TrainedBatch", "build_sampler", "class_rows", "data_config", "item_row", "load_extern_object"]

PKG, FILE = "pkg://", "file://"
DERIVED_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "raw_prompt_ids", "full_prompts",
                          "index", "dummy_tensor", "uid"})
"""Item keys verl derives again from the chat (`raw_prompt`) or the batch; not read."""
ROW_KEYS = frozenset({"raw_prompt", "reward_model", "extra_info", "ability", "agent_name", "tools_kwargs",
                      "interaction_kwargs"})
MEDIA_KEYS = frozenset({"images", "videos", "audios", "multi_modal_data", "multi_modal_inputs"})


def _module(path: str, key: str) -> Any:
    """The module of `path` as verl's `load_module` finds it; a DataError naming `key` otherwise."""
    if path.startswith(PKG):
        name = path[len(PKG):].replace("/", ".")
        try:
            return importlib.import_module(name)
        except Exception as exc:
            raise DataError(f"`{key}={path}`: the module `{name}` cannot be imported ({type(exc).__name__}: "
                            f"{exc}). Fix: put its package on `PYTHONPATH`, or give the file's path") from exc
    file = Path(path[len(FILE):] if path.startswith(FILE) else path).expanduser()
    if not file.is_file():
        raise DataError(f"`{key}={path}`: no such file (looked for `{file.resolve()}`). Fix: give the path of "
                        "the Python file defining the class (absolute, or relative to the trainer's directory), "
                        "or `pkg://package.module`")
    name = f"hpcrl_extern_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]}_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise DataError(f"`{key}={path}`: `{file}` is not a Python module. Fix: name a `.py` file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a stable name: the class's name is part of the checkpoint
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise DataError(f"`{key}={path}`: running `{file}` failed ({type(exc).__name__}: {exc}). Fix the file "
                        "(a class written for verl imports verl: install it where the trainer runs)") from exc
    return module


def load_extern_object(path: str, name: str, key: str) -> Any:
    """`name` in the module at `path` (verl's `load_extern_object`); `key` is the config key the
    errors name (`data.custom_cls` or `data.sampler`)."""
    path_key, name_key = (f"{key}.path", f"{key}.name") if key == "data.custom_cls" else \
        (f"{key}.class_path", f"{key}.class_name")
    module = _module(path, path_key)
    if not hasattr(module, name):
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise DataError(f"`{name_key}={name}`: `{path}` defines no `{name}` (its classes: "
                        f"{', '.join(f'`{c}`' for c in classes) or 'none'}). Fix: name one of them")
    return getattr(module, name)


def data_config(data: Any) -> Any:
    """The data section as verl hands it to the classes: an OmegaConf `DictConfig`."""
    from omegaconf import OmegaConf

    return OmegaConf.create(dataclasses.asdict(data))


def dataset_class(data: Any) -> type:
    """The class of `data.custom_cls`, checked as verl's `get_dataset_class` checks it."""
    from torch.utils.data import Dataset, IterableDataset

    c = data.custom_cls
    cls = load_extern_object(c.path, c.name, "data.custom_cls")
    where = f"`data.custom_cls.name={c.name}` (`{c.path}`)"
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise DataError(f"{where} must inherit from torch.utils.data.Dataset, as verl's `get_dataset_class` "
                        f"requires; it is {cls!r}. Fix: `class {c.name}(torch.utils.data.Dataset)` (or verl's "
                        "RLHFDataset) with `__len__` and `__getitem__`")
    if issubclass(cls, IterableDataset):
        raise DataError(f"{where} is an IterableDataset; the loader draws rows by index, as verl's does (its "
                        "sampler). Fix: a map-style dataset with `__len__` and `__getitem__`")
    if callable(getattr(cls, "on_batch_end", None)):
        raise DataError(f"{where} defines `on_batch_end`, verl's hook for a dataset that changes its items "
                        "while training; this trainer reads every item once, at the start, so the changes would "
                        "not act. Fix: remove `on_batch_end`, or order the rows with `data.sampler` instead")
    return cls


def _plain(value: Any) -> Any:
    """A cell as plain Python: numpy arrays and scalars (pandas, `datasets`) to lists and numbers."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    return value


def _given(value: Any) -> bool:
    return value is not None and not (hasattr(value, "__len__") and len(value) == 0)


def item_row(item: Any, where: str, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> dict[str, Any]:
    """A dataset item (verl's dict) as the parquet row the trainer reads (`prompt_key`,
    `reward_fn_key`, `reward_model`, `extra_info`, `ability`, `agent_name`); refuse what cannot
    be mapped."""
    if not isinstance(item, Mapping):
        raise DataError(f"{where} is a {type(item).__name__}; verl's dataset items are dicts (`raw_prompt`, "
                        f"`{reward_fn_key}`, `reward_model`, ...). Fix: return a dict from `__getitem__`")
    media = sorted(k for k in MEDIA_KEYS if _given(item.get(k)))
    if media:
        raise DataError(f"{where} holds {', '.join(f'`{k}`' for k in media)}: multimodal data, which this trainer "
                        "would leave out (it reads the prompt's text). Fix: a text-only dataset")
    unknown = sorted(set(item) - DERIVED_KEYS - ROW_KEYS - MEDIA_KEYS - {prompt_key, reward_fn_key})
    if unknown:
        raise DataError(f"{where} has key(s) {', '.join(f'`{k}`' for k in unknown)} this trainer would not pass on "
                        "(verl hands them to agent loops as keyword arguments). Fix: move them into `extra_info`, "
                        "which reaches the reward function, or drop them")
    chat = item.get("raw_prompt") if _given(item.get("raw_prompt")) else item.get(prompt_key)
    if not _given(chat):
        raise DataError(f"{where} has no chat: neither `raw_prompt` (what verl's RLHFDataset returns) nor "
                        f"`{prompt_key}` (`data.prompt_key`); keys: {', '.join(sorted(map(str, item)))}. Fix: return "
                        "the chat messages as `raw_prompt` (the trainer renders them with the chat template itself, "
                        "as verl's agent loop does; an item's `input_ids` are not read)")
    chat = _plain(chat)
    if isinstance(chat, list) and any(isinstance(m, Mapping) and not isinstance(m.get("content"), str) for m in chat):
        raise DataError(f"{where}: a message's `content` is not text (a list of parts is verl's multimodal "
                        "format). Fix: give each message its text as a string")
    missing = [k for k in (reward_fn_key, "reward_model") if not _given(item.get(k))]
    if missing:
        raise DataError(f"{where} lacks {', '.join(f'`{k}`' for k in missing)}: `{reward_fn_key}` "
                        "(`data.reward_fn_key`) selects the reward function and `reward_model.ground_truth` is "
                        "what it scores against. Fix: return them as verl's format has them")
    reward = _plain(item["reward_model"])
    if not isinstance(reward, Mapping):
        raise DataError(f"{where}: `reward_model` is {reward!r}; verl's format has a dict "
                        "(`{\"ground_truth\": ..., \"style\": \"rule\"}`). Fix: return one")
    extra = dict(_plain(item.get("extra_info") or {}))
    for key in ("tools_kwargs", "interaction_kwargs"):
        if _given(item.get(key)) and not _given(extra.get(key)):
            extra[key] = _plain(item[key])
    row = {prompt_key: chat, reward_fn_key: _plain(item[reward_fn_key]), "reward_model": dict(reward),
           "extra_info": extra, "ability": _plain(item.get("ability"))}
    if _given(item.get("agent_name")):
        row["agent_name"] = str(_plain(item["agent_name"]))
    return row


def class_rows(data: Any, files: Sequence[str], tokenizer: Any, config: Any) -> list[dict[str, Any]]:
    """The rows of `files` as the `data.custom_cls` class gives them (:func:`item_row` each)."""
    cls = dataset_class(data)
    name = f"`{data.custom_cls.name}`"
    try:
        dataset = cls(data_files=list(files), tokenizer=tokenizer, processor=None, config=config, max_samples=-1)
    except TypeError as exc:
        if "max_samples" not in str(exc):
            raise DataError(f"constructing {name} failed ({exc}); verl constructs it as `cls(data_files=..., "
                            "tokenizer=..., processor=..., config=..., max_samples=...)`. Fix its `__init__`") from exc
        raise DataError(f"{name} takes no `max_samples` ({exc}): verl's `create_rl_dataset` passes it "
                        "(`data.train_max_samples`). Fix: accept `max_samples=-1` in its `__init__`") from exc
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"constructing {name} on {', '.join(files)} failed: {type(exc).__name__}: {exc}") from exc
    where = f"item {{}} of {name} on {', '.join(files)}"
    return [item_row(dataset[i], where.format(i), data.prompt_key, data.reward_fn_key) for i in range(len(dataset))]


class SamplerSource:
    """The training prompts as a sampler's `data_source` sees them: `len()` and, by index, verl's
    item (the dict verl's `RLHFDataset.__getitem__` returns: `raw_prompt`, the `data.prompt_key`
    chat, `data_source`, `reward_model`, `extra_info`, `ability`, `agent_name`, `index`,
    `tools_kwargs`, `interaction_kwargs`). Index `i` is the `i`-th usable prompt (after
    `data.filter_overlong_prompts`, as verl's dataset filters before its sampler sees it);
    `examples` the trainer's own."""

    def __init__(self, dataset: Any, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> None:
        self.examples, self.files = dataset.examples, dataset.files
        self.prompt_key, self.reward_fn_key = prompt_key, reward_fn_key

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        e = self.examples[i]
        return {"raw_prompt": e.prompt, self.prompt_key: e.prompt, self.reward_fn_key: e.data_source,
                "reward_model": e.reward_model, "extra_info": e.extra_info, "ability": e.ability,
                "agent_name": e.agent_name, "index": e.extra_info.get("index", 0),
                "tools_kwargs": e.extra_info.get("tools_kwargs", {}),
                "interaction_kwargs": e.extra_info.get("interaction_kwargs", {})}


def build_sampler(data: Any, dataset: Any, config: Any) -> Any:
    """The `data.sampler` class's sampler over `dataset` (a :class:`trainer.data.PromptDataset`,
    seen as a :class:`SamplerSource`), checked as verl's `create_rl_sampler` checks it (its
    `AbstractSampler` interface, duck-typed)."""
    s = data.sampler
    cls = load_extern_object(s.class_path, s.class_name, "data.sampler")
    where = f"`data.sampler.class_name={s.class_name}` (`{s.class_path}`)"
    lacks = [m for m in ("__iter__", "__len__") if not callable(getattr(cls, m, None))] if isinstance(cls, type) else []
    if not isinstance(cls, type) or lacks:
        raise DataError(f"{where} must be a sampler class, verl's `AbstractSampler`: `__init__(self, data_source, "
                        "data_config)`, `__iter__` yielding row indices, `__len__` (and `update(self, batch)` for a "
                        f"curriculum sampler); it is {cls!r}{' without ' + ', '.join(lacks) if lacks else ''}. "
                        "Fix: define them (verl's own samplers subclass `AbstractSampler`)")
    try:
        return cls(data_source=SamplerSource(dataset, data.prompt_key, data.reward_fn_key), data_config=config)
    except Exception as exc:
        raise DataError(f"constructing {where} failed ({type(exc).__name__}: {exc}); verl constructs it as "
                        "`cls(data_source=dataset, data_config=data_config)`. Fix its `__init__`") from exc


class TrainedBatch:
    """A trained batch as a curriculum sampler's `update(batch)` reads it, in the names of verl's
    `DataProto`: `batch` (tensors: `prompts`, `responses`, `input_ids`, `attention_mask`,
    `response_mask`, `token_level_scores`, `token_level_rewards`, `advantages`, `returns`,
    `old_log_probs`, `ref_log_prob`, `values`, where the step made them), `non_tensor_batch`
    (numpy arrays per row: `dataset_index`, the row's index in the sampler's `data_source`;
    `index`, verl's (`extra_info.index`, else 0); `uid`, `data_source`, `reward_model`,
    `extra_info`, `ability`, `agent_name`), `meta_info` (`global_step`) and `step_batch`, the
    trainer's own :class:`trainer.batch.StepBatch`."""

    FIELDS = {"token_scores": "token_level_scores", "token_rewards": "token_level_rewards",
              "advantages": "advantages", "returns": "returns", "old_log_probs": "old_log_probs",
              "ref_log_probs": "ref_log_prob", "values": "values", "response_mask": "response_mask",
              "attention_mask": "attention_mask", "input_ids": "input_ids"}

    def __init__(self, step_batch: Any, step: int, positions: Mapping[int, int]) -> None:
        """`positions`: each example's `index` -> its index in the sampler's `data_source`."""
        import numpy as np

        self.step_batch = step_batch
        self.batch = {name: getattr(step_batch, f) for f, name in self.FIELDS.items()
                      if getattr(step_batch, f) is not None}
        width = step_batch.response_length
        self.batch["responses"] = step_batch.input_ids[:, -width:]
        self.batch["prompts"] = step_batch.input_ids[:, :-width]
        rows = step_batch.examples

        def column(values: list[Any]) -> Any:
            out = np.empty(len(values), dtype=object)
            out[:] = values
            return out

        self.non_tensor_batch = {
            "dataset_index": np.array([positions[e.index] for e in rows], dtype=np.int64),
            "index": column([e.extra_info.get("index", 0) for e in rows]),
            "uid": np.array(list(step_batch.uids), dtype=np.int64),
            "data_source": column([e.data_source for e in rows]),
            "reward_model": column([e.reward_model for e in rows]),
            "extra_info": column([e.extra_info for e in rows]),
            "ability": column([e.ability for e in rows]),
            "agent_name": column([e.agent_name for e in rows]),
        }
        self.meta_info = {"global_step": step}

    def __len__(self) -> int:
        return len(self.step_batch)
