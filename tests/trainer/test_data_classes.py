"""verl's `data.custom_cls` and `data.sampler`: a dataset class of the user's feeding real GSM8K
rows, samplers ordering the prompts (reversed, weighted, a curriculum updated after every step),
a resume mid-epoch handing out exactly the rest, each bad input refused naming the fix, verl's
own dataset and data loader as the reference, and short training runs with both in the loop."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.trainer.async_rl.conftest import stopped_after
from tests.verl_env import verl_python
from trainer.config import ConfigError, check_run, load_config
from trainer.data import DataError, PromptDataset, PromptLoader
from trainer.data_classes import build_sampler, class_rows, data_config, item_row

DATA = Path(__file__).parents[1] / "data"
SAMPLE = DATA / "gsm8k_train_sample.parquet"
TEST_SAMPLE = DATA / "gsm8k_test_sample.parquet"
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' </s> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

#: A dataset class as users write them for verl: it reads its files itself and returns verl's
#: `RLHFDataset.__getitem__` dict (the row, `raw_prompt`, `index`, `tools_kwargs`, ...).
DATASET_FILE = '''
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset


class GSM8KDataset(Dataset):
    def __init__(self, data_files, tokenizer, processor=None, config=None, max_samples=-1):
        self.rows = [r for f in data_files for r in pq.read_table(f).to_pylist()]
        self.prompt_key = config.get("prompt_key", "prompt")
        self.config = config

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, item):
        row = dict(self.rows[item])
        row["raw_prompt"] = row.pop(self.prompt_key)
        row["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        extra = row.get("extra_info") or {}
        row["index"] = extra.get("index", 0)
        row["tools_kwargs"] = extra.get("tools_kwargs", {})
        row["interaction_kwargs"] = extra.get("interaction_kwargs", {})
        return row


class NotADataset:
    def __init__(self, **kwargs):
        pass


class Dynamic(GSM8KDataset):
    def on_batch_end(self, batch):
        pass


class NoMaxSamples(GSM8KDataset):
    def __init__(self, data_files, tokenizer, processor=None, config=None):
        super().__init__(data_files, tokenizer, processor, config)
'''

#: Samplers as users write them for verl (`AbstractSampler`'s interface, duck-typed: verl is not
#: imported). `Curriculum` draws lazily, the next index the one with the highest weight left,
#: and `update` raises the weights of the next rows of a trained batch's; its `state_dict`
#: holds the weights and what it drew this epoch (torchdata's protocol).
SAMPLER_FILE = '''
import torch


class Reversed:
    def __init__(self, data_source, data_config):
        self.n = len(data_source)

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class Weighted:
    """Draws with replacement, weighted by the prompt's length; one generator for the run."""

    def __init__(self, data_source, data_config):
        weights = [len(data_source[i]["raw_prompt"][0]["content"]) for i in range(len(data_source))]
        self.generator = torch.Generator().manual_seed(data_config.seed)
        self.sampler = torch.utils.data.WeightedRandomSampler(weights, len(weights), generator=self.generator)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self):
        return len(self.sampler)


class Curriculum:
    def __init__(self, data_source, data_config):
        self.weights = [float(i % 5) for i in range(len(data_source))]
        self.drawn = []
        self.updates = []

    def __iter__(self):
        if len(self.drawn) >= len(self.weights):
            self.drawn = []
        while len(self.drawn) < len(self.weights):
            left = [i for i in range(len(self.weights)) if i not in self.drawn]
            best = max(left, key=lambda i: (self.weights[i], -i))
            self.drawn.append(best)
            yield best

    def __len__(self):
        return len(self.weights)

    def update(self, batch):
        rows = list(dict.fromkeys(int(i) for i in batch.non_tensor_batch["dataset_index"]))
        self.updates.append(rows)
        for i in rows:  # a prompt trained makes its neighbour come sooner
            self.weights[(i + 1) % len(self.weights)] += 2.5

    def state_dict(self):
        return {"weights": list(self.weights), "drawn": list(self.drawn)}

    def load_state_dict(self, state):
        self.weights, self.drawn = list(state["weights"]), list(state["drawn"])


class ForgetfulCurriculum(Curriculum):
    """The same curriculum without `state_dict`: its order cannot be replayed."""

    state_dict = None
    load_state_dict = None


class NumpyState(Reversed):
    def state_dict(self):
        import numpy
        return {"order": numpy.arange(3)}

    def load_state_dict(self, state):
        pass


class Short(Reversed):
    def __len__(self):
        return 2 * self.n


class OutOfRange(Reversed):
    def __iter__(self):
        return iter(range(self.n, 0, -1))


class NoLen:
    def __init__(self, data_source, data_config):
        pass

    def __iter__(self):
        return iter(())
'''


@pytest.fixture(scope="module")
def tokenizer():
    """A whitespace word-level tokenizer over the samples' words, with a chat template."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "</s>", "<|user|>", "<|assistant|>"]
    for path in (SAMPLE, TEST_SAMPLE):
        for row in pq.read_table(path).to_pylist():
            words += row["prompt"][0]["content"].split()
    tok = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_input_names=["input_ids", "attention_mask"])
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture()
def classes(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "my_dataset.py").write_text(DATASET_FILE)
    (tmp_path / "my_sampler.py").write_text(SAMPLER_FILE)
    return tmp_path / "my_dataset.py", tmp_path / "my_sampler.py"


def data_cfg(*extra: str) -> Any:
    return load_config([f"data.train_files={SAMPLE}", f"data.val_files={TEST_SAMPLE}", "data.max_prompt_length=512",
                        *extra]).data


def class_dataset(path: Path, tokenizer: Any, name: str = "GSM8KDataset", *extra: str) -> PromptDataset:
    data = data_cfg(f"data.custom_cls.path={path}", f"data.custom_cls.name={name}", *extra)
    rows = class_rows(data, data.train_files, tokenizer, data_config(data))
    return PromptDataset(data.train_files, tokenizer, max_prompt_length=data.max_prompt_length, rows=rows)


def loader_with(sampler_file: Path, name: str, dataset: PromptDataset, batch_size: int = 4) -> PromptLoader:
    data = data_cfg(f"data.sampler.class_path={sampler_file}", f"data.sampler.class_name={name}",
                    "data.dataloader_num_workers=0", "data.seed=3")
    return PromptLoader(dataset, batch_size, shuffle=True, seed=3, sampler=build_sampler(data, dataset, data_config(data)))


def rows_of(batch: list[Any], dataset: PromptDataset) -> list[int]:
    return [dataset.positions[e.index] for e in batch]


class FakeBatch:
    """What a curriculum sampler's `update` reads of a trained batch (`TrainedBatch`'s names)."""

    def __init__(self, rows: list[int]) -> None:
        self.non_tensor_batch = {"dataset_index": rows}


# ----------------------------------------------------------------------------- the dataset class


def test_a_dataset_class_gives_the_examples_the_parquet_reader_gives(classes, tokenizer) -> None:
    mine = class_dataset(classes[0], tokenizer)
    parquet = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    assert len(mine) == len(parquet) == 16
    assert mine.examples == parquet.examples  # chat template, ground truth, extra_info, agent: the same


def test_a_dataset_class_feeds_the_length_policies(classes, tokenizer) -> None:
    data = data_cfg(f"data.custom_cls.path={classes[0]}", "data.custom_cls.name=GSM8KDataset")
    rows = class_rows(data, data.train_files, tokenizer, data_config(data))
    kept = PromptDataset(data.train_files, tokenizer, max_prompt_length=60, filter_overlong_prompts=True, rows=rows)
    assert 0 < len(kept) < 16 and all(len(e.prompt_ids) <= 60 for e in kept.examples)
    with pytest.raises(DataError, match="data.filter_overlong_prompts=true"):
        PromptDataset(data.train_files, tokenizer, max_prompt_length=20, rows=rows)


def test_item_adapter_maps_verl_items_and_refuses_what_it_cannot(tokenizer) -> None:
    chat = [{"role": "user", "content": "q"}]
    base = {"data_source": "openai/gsm8k", "raw_prompt": chat, "reward_model": {"ground_truth": "1"},
            "extra_info": {"index": 4}, "tools_kwargs": {"calc": {"create_kwargs": {}}}, "input_ids": [1, 2],
            "agent_name": "tool_agent", "ability": "math"}
    row = item_row(base, "item 0")
    assert row["prompt"] == chat and row["extra_info"] == {"index": 4, "tools_kwargs": {"calc": {"create_kwargs": {}}}}
    assert row["agent_name"] == "tool_agent" and "input_ids" not in row
    refusals = {
        "multimodal data": {**base, "images": [b"png"]},
        "`question` this trainer would not pass on": {**base, "question": "q"},
        "neither `raw_prompt`": {k: v for k, v in base.items() if k != "raw_prompt"},
        "lacks `reward_model`": {k: v for k, v in base.items() if k != "reward_model"},
        "is not text": {**base, "raw_prompt": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
        "verl's dataset items are dicts": ["not", "a", "dict"],
    }
    for phrase, item in refusals.items():
        with pytest.raises(DataError, match=phrase.replace("(", r"\(")) as err:
            item_row(item, "item 0")
        assert "Fix:" in str(err.value), phrase


def test_bad_dataset_classes_are_refused_naming_the_fix(classes, tokenizer, tmp_path) -> None:
    cases = {
        ("nowhere.py", "GSM8KDataset"): "no such file",
        (str(classes[0]), "Missing"): "defines no `Missing` (its classes: `Dynamic`, `GSM8KDataset`, `NoMaxSamples`, "
                                      "`NotADataset`)",
        (str(classes[0]), "NotADataset"): "must inherit from torch.utils.data.Dataset",
        (str(classes[0]), "Dynamic"): "defines `on_batch_end`",
        (str(classes[0]), "NoMaxSamples"): "takes no `max_samples`",
        ("pkg://no_such_package.datasets", "X"): "cannot be imported",
    }
    for (path, name), phrase in cases.items():
        data = data_cfg(f"data.custom_cls.path={path}", f"data.custom_cls.name={name}")
        with pytest.raises(DataError) as err:
            class_rows(data, data.train_files, tokenizer, data_config(data))
        assert phrase in str(err.value) and "Fix" in str(err.value), str(err.value)
    broken = tmp_path / "broken.py"
    broken.write_text("import verl\n")
    data = data_cfg(f"data.custom_cls.path={broken}", "data.custom_cls.name=X")
    with pytest.raises(DataError, match="install it where the trainer runs"):
        class_rows(data, data.train_files, tokenizer, data_config(data))


def test_config_refuses_half_a_class_and_a_sampler_with_worker_processes() -> None:
    for extra, phrase in (
            (["data.custom_cls.path=x.py"], "without `data.custom_cls.name`"),
            (["data.custom_cls.name=X"], "`data.custom_cls.name=X` without `data.custom_cls.path`"),
            (["data.sampler.class_path=x.py", "data.sampler.class_name=X"], "`data.dataloader_num_workers=0`"),
            (["data.sampler.class_name=X", "data.dataloader_num_workers=0"], "without `data.sampler.class_path`")):
        with pytest.raises(ConfigError, match=phrase.replace("(", r"\(")):
            data_cfg(*extra)
    cfg = load_config([f"data.train_files={SAMPLE}", "data.sampler.class_path=x.py", "data.sampler.class_name=X",
                       "data.dataloader_num_workers=0"])
    with pytest.raises(ConfigError, match="under the fully-async loop"):
        check_run(cfg, "fully_async")


# ----------------------------------------------------------------------------- the sampler


def test_a_sampler_orders_the_batches(classes, tokenizer) -> None:
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    loader = loader_with(classes[1], "Reversed", dataset, batch_size=5)
    assert loader.batches_per_epoch == 3  # the last partial batch dropped, as verl's loader does
    order = [rows_of(loader.next_batch(), dataset) for _ in range(4)]
    assert order == [[15, 14, 13, 12, 11], [10, 9, 8, 7, 6], [5, 4, 3, 2, 1], [15, 14, 13, 12, 11]]
    assert loader.epoch == 1 and not loader.curriculum


def test_a_weighted_sampler_resumes_mid_epoch_with_exactly_the_rest(classes, tokenizer) -> None:
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    whole = loader_with(classes[1], "Weighted", dataset)
    drawn = [rows_of(whole.next_batch(), dataset) for _ in range(10)]  # 2.5 epochs of 4 batches
    assert len({i for b in drawn for i in b}) < 16 or drawn[0] != drawn[4]  # weighted, with replacement
    first = loader_with(classes[1], "Weighted", dataset)
    for _ in range(6):  # into the second epoch
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader_with(classes[1], "Weighted", dataset)
    resumed.load_state_dict(state)
    assert [rows_of(resumed.next_batch(), dataset) for _ in range(4)] == drawn[6:10]


def test_a_curriculum_sampler_is_updated_and_resumes_from_its_state(classes, tokenizer) -> None:
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)

    def run(loader: PromptLoader, steps: int) -> list[list[int]]:
        out = []
        for _ in range(steps):
            rows = rows_of(loader.next_batch(), dataset)
            loader.update(FakeBatch(rows))
            out.append(rows)
        return out

    whole = loader_with(classes[1], "Curriculum", dataset)
    assert whole.curriculum
    straight = run(whole, 7)
    assert whole.sampler.updates == straight
    fixed = loader_with(classes[1], "Curriculum", dataset)  # no updates: the order of its first weights
    unchanged = [rows_of(fixed.next_batch(), dataset) for _ in range(4)]
    assert straight[0] == unchanged[0] == [4, 9, 14, 3]
    assert straight[1] == [8, 13, 5, 10] != unchanged[1]  # the update made 5, 10 and 15 come sooner
    assert sorted(i for b in straight[:4] for i in b) == list(range(16))  # each prompt once per epoch
    first = loader_with(classes[1], "Curriculum", dataset)
    run(first, 2)
    state = first.state_dict()
    resumed = loader_with(classes[1], "Curriculum", dataset)
    resumed.load_state_dict(state)
    assert run(resumed, 5) == straight[2:]


def test_one_step_off_order_resumes_with_its_batch_in_flight(classes, tokenizer) -> None:
    """One-step-off draws batch n+1 before batch n's update; its checkpoint keeps the sampler's
    state after that update and hands the batch in flight out first (`state_dict(ahead=...)`)."""
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)

    def run(loader: PromptLoader, steps: int, stop_at: int = 0) -> tuple[list[list[int]], dict[str, Any], Any]:
        trained, ahead, saved, before = [], loader.next_batch(), {}, None
        for step in range(1, steps + 1):
            batch = ahead
            if step == stop_at:
                before = loader.state_dict()  # the position before the batch drawn ahead
            ahead = loader.next_batch() if step < steps else None
            loader.update(FakeBatch(rows_of(batch, dataset)))
            trained.append(rows_of(batch, dataset))
            if step == stop_at:
                saved = json.loads(json.dumps(loader.state_dict(ahead=ahead)))
        return trained, saved, before

    straight, _, _ = run(loader_with(classes[1], "Curriculum", dataset), 7)
    _, state, before = run(loader_with(classes[1], "Curriculum", dataset), 7, stop_at=3)
    resumed = loader_with(classes[1], "Curriculum", dataset)
    resumed.load_state_dict(state)
    assert run(resumed, 4)[0] == straight[3:]
    early = loader_with(classes[1], "Curriculum", dataset)  # without step 3's update: another order later
    early.load_state_dict(before)
    assert run(early, 4)[0] != straight[3:]


def test_resume_refuses_a_sampler_whose_order_cannot_be_replayed(classes, tokenizer) -> None:
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    first = loader_with(classes[1], "ForgetfulCurriculum", dataset)
    for _ in range(2):
        first.update(FakeBatch(rows_of(first.next_batch(), dataset)))
    state = first.state_dict()
    resumed = loader_with(classes[1], "ForgetfulCurriculum", dataset)
    with pytest.raises(DataError, match="draws other prompts on the resume's replay") as err:
        resumed.load_state_dict(state)
    assert "`state_dict()`/`load_state_dict()`" in str(err.value)
    plain = PromptLoader(dataset, 4, shuffle=True, seed=3)
    with pytest.raises(DataError, match="my_sampler.ForgetfulCurriculum of 16 -> None"):
        plain.load_state_dict(state)


def test_bad_samplers_are_refused_naming_the_fix(classes, tokenizer) -> None:
    dataset = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    with pytest.raises(DataError, match="without __len__"):
        loader_with(classes[1], "NoLen", dataset)
    with pytest.raises(DataError, match="defines no `Nope`"):
        loader_with(classes[1], "Nope", dataset)
    with pytest.raises(DataError, match="no such file"):
        loader_with(classes[1].with_name("gone.py"), "Reversed", dataset)
    with pytest.raises(DataError, match="fewer than `data.train_batch_size`=32"):
        loader_with(classes[1], "Reversed", dataset, batch_size=32)
    with pytest.raises(DataError, match="no numpy arrays"):
        loader_with(classes[1], "NumpyState", dataset).state_dict()
    short = loader_with(classes[1], "Short", dataset)
    for _ in range(4):
        short.next_batch()
    with pytest.raises(DataError, match=r"stopped after 16 indices in epoch 0, fewer than its `len\(\)`=32"):
        short.next_batch()
    with pytest.raises(DataError, match="integers from 0 to 15"):
        loader_with(classes[1], "OutOfRange", dataset).next_batch()


# ----------------------------------------------------------------------------- against verl

VERL_SIDE = r"""
import json, sys
import torch
from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset, get_dataset_class
from verl.utils.import_utils import load_extern_object

spec = json.loads(sys.stdin.read())
config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 512, "seed": 3,
                           "filter_overlong_prompts": False, "return_raw_chat": True, "truncation": "error",
                           "custom_cls": {"path": spec["dataset_file"], "name": "GSM8KDataset"}})
tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
ours = get_dataset_class(config)
wrong = OmegaConf.merge(config, {"custom_cls": {"name": "NotADataset"}})
try:
    get_dataset_class(wrong)
    refused = None
except TypeError as exc:
    refused = str(exc)
reference = RLHFDataset(data_files=[spec["sample"]], tokenizer=tokenizer, processor=None, config=config)
items = []
for i in range(len(reference)):
    item = reference[i]
    item.pop("dummy_tensor")
    items.append(item)
orders = {}
for name, steps in spec["samplers"].items():
    cls = load_extern_object(spec["sampler_file"], name)
    def loader():
        return StatefulDataLoader(list(range(len(items))), batch_size=4, drop_last=True, num_workers=0,
                                  collate_fn=lambda rows: rows, sampler=cls(data_source=reference, data_config=config))
    whole, batches = loader(), []
    while len(batches) < 2 * len(whole):
        batches += [list(b) for b in whole]
    first = loader()
    it = iter(first)
    for _ in range(steps):
        next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    orders[name] = {"batches": batches, "resumed": [list(b) for b in resumed]}
print(json.dumps({"class": ours.__name__, "refused": refused, "items": items, "orders": orders}, default=str))
"""


def test_against_verls_dataset_and_data_loader(classes, tokenizer, tmp_path) -> None:
    """verl's own `RLHFDataset` items, read through the adapter, are the parquet reader's
    examples; verl's `get_dataset_class` takes and refuses the classes this trainer takes and
    refuses; verl's `StatefulDataLoader` over the same samplers draws the same batches, and its
    resume in the first epoch hands out the same rest (later epochs: verl's fast-forward replays
    the epoch from a fresh sampler, which this loader does not; see docs)."""
    python = verl_python()
    tokenizer.save_pretrained(tmp_path / "tok")
    spec = {"sample": str(SAMPLE), "tokenizer": str(tmp_path / "tok"), "dataset_file": str(classes[0]),
            "sampler_file": str(classes[1]), "samplers": {"Reversed": 2, "Weighted": 1, "Curriculum": 2}}
    done = subprocess.run([python, "-c", VERL_SIDE], input=json.dumps(spec), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["class"] == "GSM8KDataset"
    assert "must inherit from torch.utils.data.Dataset" in theirs["refused"]
    parquet = PromptDataset([SAMPLE], tokenizer, max_prompt_length=512)
    rows = [item_row(item, f"item {i}") for i, item in enumerate(theirs["items"])]
    assert PromptDataset([SAMPLE], tokenizer, max_prompt_length=512, rows=rows).examples == parquet.examples
    for name, steps in spec["samplers"].items():
        loader = loader_with(classes[1], name, parquet)
        ours = [rows_of(loader.next_batch(), parquet) for _ in range(len(theirs["orders"][name]["batches"]))]
        assert ours == theirs["orders"][name]["batches"], name
        first = loader_with(classes[1], name, parquet)
        for _ in range(steps):
            first.next_batch()
        resumed = loader_with(classes[1], name, parquet)
        resumed.load_state_dict(first.state_dict())
        rest = [rows_of(resumed.next_batch(), parquet) for _ in range(resumed.batches_per_epoch - steps)]
        assert rest == theirs["orders"][name]["resumed"], name


# ----------------------------------------------------------------------------- in the loop


def gsm8k_run(model: Path, run: Path, classes: tuple[Path, Path], *extra: str) -> list[str]:
    return [
        f"data.train_files={SAMPLE}", f"data.val_files={TEST_SAMPLE}", f"data.custom_cls.path={classes[0]}",
        "data.custom_cls.name=GSM8KDataset", f"data.sampler.class_path={classes[1]}",
        "data.sampler.class_name=Curriculum", "data.dataloader_num_workers=0", "data.truncation=left",
        "data.max_prompt_length=24", "data.max_response_length=6", "data.train_batch_size=4",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.device=cpu", f"trainer.default_local_dir={run}", "trainer.logger=jsonl", "trainer.seed=7",
        *extra]


def test_training_runs_on_the_class_with_the_curriculum_and_resumes_it(tiny_model_dir, tmp_path, classes) -> None:
    from trainer.driver import PPODriver
    from trainer.exit_codes import REQUEUE_EXIT_CODE
    from trainer.metrics import read_jsonl

    straight = PPODriver(load_config(gsm8k_run(tiny_model_dir, tmp_path / "straight", classes,
                                               "trainer.total_training_steps=3", "trainer.test_freq=3")))
    assert straight.val_set is not None and len(straight.val_set) == len(pq.read_table(TEST_SAMPLE))  # the class
    handed: list[list[int]] = []
    original = straight.loader.next_batch
    straight.loader.next_batch = lambda: (b := original(), handed.append(rows_of(b, straight.train_set)))[0]
    trained: list[Any] = []
    update = straight.loader.update
    straight.loader.update = lambda batch: (trained.append(batch), update(batch))[1]
    assert straight.fit() == 0
    names = {"prompts", "responses", "response_mask", "token_level_scores", "token_level_rewards", "advantages"}
    assert all(names <= set(b.batch) and len(b) == 8 and b.meta_info["global_step"] == i + 1  # 4 prompts x n=2
               and list(b.non_tensor_batch["data_source"]) == ["openai/gsm8k"] * 8 for i, b in enumerate(trained))
    assert straight.loader.sampler.updates == handed and len(handed) == 3  # each step's batch, its rows
    assert handed[0] == [4, 9, 14, 3]  # the curriculum's first order (weight i % 5, highest first)
    rows = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all("critic/score/mean" in r for r in rows)
    assert any(k.startswith("val-core/openai/gsm8k/") for k in rows[-1])  # validated on the class's items

    broken = tmp_path / "broken"
    first = stopped_after(PPODriver, 2)(load_config(gsm8k_run(tiny_model_dir, broken, classes,
                                                             "trainer.total_training_steps=3")))
    first.stop.install = lambda *a: None  # type: ignore[method-assign]
    assert first.fit() == REQUEUE_EXIT_CODE
    resumed = PPODriver(load_config(gsm8k_run(tiny_model_dir, broken, classes, "trainer.total_training_steps=3")))
    assert resumed.fit() == 0
    assert resumed.loader.sampler.updates == handed[2:]  # the third batch: the curriculum's after two updates
