"""A discriminative reward model (`reward_model.enable=true`, `reward_model.model.path`): verl's
two reward schemas read as one config, the prompt rendered and the score placed as verl 0.9.1's
reward loop does (checked against verl's own `_preprocess_reward_inputs` and
`assemble_rm_scores`), the score read at the last token, and a training step scored by it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.trainer.test_driver import toy_overrides
from tests.verl_env import verl_python
from trainer.config import load_config
from trainer.config.base import ConfigError
from trainer.driver import PPODriver
from trainer.rewards.model import SequenceClassifierRM, render_rm_prompt, rm_dtype
from trainer.rewards.toy import write_toy_digits
from trainer.stages.reward import ModelRewardEngine, RuleRewardEngine, build_reward_engine


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama sequence classifier (one label) with the tiny tokenizer, its chat
    template starting with the BOS as Llama's does."""
    from trainer.tiny import save_tiny_rm

    return save_tiny_rm(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=64, val_size=8, seed=0)
    return out


# ------------------------------------------------------------------------------ config

def test_both_schemas_give_one_config() -> None:
    new = load_config(["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm",
                       "reward.reward_manager.name=dapo", "reward.reward_model.rollout.name=vllm",
                       "reward.num_workers=4", "reward.reward_model.rollout.dtype=float32"], env={})
    legacy = load_config(["reward_model.enable=true", "reward_model.model.path=/rm",
                          "reward_model.reward_manager=dapo", "reward_model.rollout.name=vllm",
                          "reward_model.num_workers=4", "reward_model.rollout.dtype=float32"], env={})
    assert new == legacy
    assert new.reward_model.enable and new.reward_model.model.path == "/rm"
    # the same value under both names is no conflict
    load_config(["reward_model.enable=true", "reward.reward_model.enable=true", "reward_model.model.path=/rm"], env={})


def test_a_conflicting_pair_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["reward_model.model.path=/a", "reward.reward_model.model_path=/b"], env={})
    assert "`reward_model.model.path=/a`" in str(err.value) and "`reward.reward_model.model_path=/b`" in str(err.value)
    with pytest.raises(ConfigError, match="reward.reward_manager.name=batch"):
        load_config(["reward.reward_manager.name=batch", "reward_model.reward_manager=dapo"], env={})


@pytest.mark.parametrize(("items", "says"), [
    (["reward_model.enable=true"], "set `reward_model.model.path=<dir>`"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "custom_reward_function.path=/f.py",
      "reward_model.rollout.name=sglang"], "served here by vLLM's OpenAI-compatible server only"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.launch_reward_fn_async=true"],
     "the model scores on the actor's ranks"),
    (["reward.reward_model.enable_resource_pool=true"], "a reward model on a resource pool of its own"),
    (["reward_model.n_gpus_per_node=4"], "a reward model on a resource pool of its own"),
])
def test_what_is_not_built_is_refused_naming_the_fix(items: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match="Fix|remove the override") as err:
        load_config(items, env={})
    assert says in str(err.value)


# ------------------------------------------------------------------------------ against verl

VERL_SIDE = """
import asyncio, json, sys
import numpy as np, torch
from transformers import AutoTokenizer
from verl import DataProto
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

spec = json.loads(sys.stdin.read())
worker = object.__new__(RewardLoopWorker)  # only the tokenizers: no Ray, no config
worker.input_tokenizer = AutoTokenizer.from_pretrained(spec["policy"])
worker.reward_model_tokenizer = AutoTokenizer.from_pretrained(spec["rm"])
prompts, responses = torch.tensor(spec["prompts"]), torch.tensor(spec["responses"])
attention = torch.tensor(spec["attention_mask"])
texts = []
for i in range(len(responses)):
    raw = np.empty(1, dtype=object)
    raw[0] = spec["raw_prompts"][i]
    row = DataProto.from_dict(tensors={"responses": responses[i:i + 1], "attention_mask": attention[i:i + 1]},
                              non_tensors={"raw_prompt": raw})
    texts.append(asyncio.run(worker._preprocess_reward_inputs(row)))
whole = DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": attention})
print(json.dumps({"texts": texts, "rm_scores": RewardManagerBase.assemble_rm_scores(whole, spec["scores"]).tolist()}))
"""


def test_rendering_and_score_placement_are_verls(tiny_model_dir: Path, tiny_rm_dir: Path, toy_data: Path,
                                                  tmp_path: Path) -> None:
    python = verl_python()
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "reward_model.enable=true",
        f"reward_model.model.path={tiny_rm_dir}"))
    driver = PPODriver(cfg)
    batch = driver.generate(driver.loader.next_batch())
    for i in range(len(batch)):  # the tiny model rarely stops: end rows early, as an EOS would
        cut = i % 4
        if cut:
            batch.attention_mask[i, -cut:] = 0
            batch.response_mask[i, -cut:] = 0
            batch.input_ids[i, -cut - 1] = driver.tokenizer.eos_token_id  # its text is dropped
    engine = driver.reward
    assert isinstance(engine, ModelRewardEngine)
    engine.score(batch)
    lengths = batch.response_attention.sum(-1).long().tolist()
    assert len(set(lengths)) > 1, lengths  # responses of several lengths: the placement is tested
    ours = [render_rm_prompt([dict(m) for m in e.prompt], batch.responses[i, :lengths[i]].tolist(),
                             driver.tokenizer, engine.rm_tokenizer) for i, e in enumerate(batch.examples)]

    prompt_len = batch.input_ids.shape[1] - batch.response_length
    spec = {"policy": str(tiny_model_dir), "rm": str(tiny_rm_dir),
            "prompts": batch.input_ids[:, :prompt_len].tolist(), "responses": batch.responses.tolist(),
            "attention_mask": batch.attention_mask.tolist(),
            "raw_prompts": [[dict(m) for m in e.prompt] for e in batch.examples],
            "scores": batch.sequence_scores.tolist()}
    done = subprocess.run([python, "-c", VERL_SIDE], input=json.dumps(spec), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == theirs["texts"]
    assert all("<|assistant|>" in t and not t.startswith("<s>") for t in ours), ours
    assert sum(t.count("</s>") for t in ours) == 2 * len(ours)  # the template's own; the response's EOS is dropped
    assert torch.equal(batch.token_scores, torch.tensor(theirs["rm_scores"]))
    # the engine's scores are the model's on those texts, scored on the actor's rank
    alone = SequenceClassifierRM(str(tiny_rm_dir), torch.device("cpu"))
    assert batch.sequence_scores.tolist() == pytest.approx(alone.score_texts(ours))
    assert engine.group is driver.actor_group and engine.local is None
    assert batch.reward_extras == {}


def test_the_score_is_the_last_labels_logit_at_the_last_token(tiny_rm_dir: Path) -> None:
    """vLLM's `/classify` pools at the last token and verl takes `probs[-1]` without activation:
    here the classifier head applied to the last token's hidden state, by hand."""
    rm = SequenceClassifierRM(str(tiny_rm_dir), torch.device("cpu"))
    texts = ["<|user|> 1 + 2 <|assistant|> 3", "<|user|> 4 <|assistant|> 5 6 7"]
    got = rm.score_texts(texts)
    for text, score in zip(texts, got, strict=True):
        ids = rm.tokenizer(text, add_special_tokens=True, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = rm.model.model(input_ids=ids).last_hidden_state
            by_hand = rm.model.score(hidden[0, -1])[-1]
        assert score == pytest.approx(float(by_hand), abs=1e-6)
    assert got[0] != got[1]
    assert not rm.awake or next(rm.model.parameters()).device.type == "cpu"


def test_a_step_is_scored_by_the_reward_model_alone(tiny_model_dir: Path, tiny_rm_dir: Path, toy_data: Path,
                                                    tmp_path: Path) -> None:
    """GRPO on the reward model's scores: the rule reward is not called, the dumped scores are
    the model's, and the model, loaded on the actor's rank, sleeps on the CPU between scorings."""
    dump = tmp_path / "dump"
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path / "run", "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1", "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={tiny_rm_dir}", "reward.reward_model.rollout.name=vllm",
        f"trainer.rollout_data_dir={dump}"))
    driver = PPODriver(cfg)
    assert driver.fit() == 0
    engine = driver.reward
    assert isinstance(engine, ModelRewardEngine) and engine.local is None
    on_rank = driver.actor_group.workers[0]._reward_model  # type: ignore[attr-defined]
    assert not on_rank.awake and next(on_rank.model.parameters()).device.type == "cpu"
    rows = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r) == {"input", "output", "gts", "score", "step"} for r in rows)
    rule = [float(r["output"].strip() == r["gts"]) for r in rows]
    assert [r["score"] for r in rows] != rule  # the random model's logits, not the toy rule's 0/1
    assert len({round(r["score"], 6) for r in rows}) > 1
    driver.reward.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.score(driver.generate(driver.loader.next_batch()))


def test_without_a_reward_model_the_rule_engine_scores(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    cfg = load_config(toy_overrides(tiny_model_dir, toy_data, tmp_path, "data.train_batch_size=4",
                                    "actor_rollout_ref.actor.ppo_mini_batch_size=4"))
    assert isinstance(build_reward_engine(cfg, None), RuleRewardEngine)


class SplitGroup:
    """Three ranks, each scoring its share with the same model in this process: the group seam."""

    world_size = 3

    def __init__(self, rm: SequenceClassifierRM) -> None:
        self.rm, self.shares = rm, []  # type: ignore[var-annotated]

    def run_each(self, method: str, per_rank: list[tuple[str, str | None, list[str], int | None]]) -> list[list[float]]:
        assert method == "score_reward_model"
        self.shares = [texts for _, _, texts, _ in per_rank]
        return [self.rm.score_texts(texts, rows) for _, _, texts, rows in per_rank]


def test_ranks_score_contiguous_shares_and_in_process_scores_the_same(
        tiny_model_dir: Path, tiny_rm_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "reward_model.enable=true",
        f"reward_model.model.path={tiny_rm_dir}"))
    driver = PPODriver(cfg)
    batch = driver.generate(driver.loader.next_batch())
    driver.reward.score(batch)  # on the actor's rank
    on_ranks = batch.sequence_scores.clone()

    alone = ModelRewardEngine(cfg, driver.tokenizer)  # never attached: in this process
    alone.score(batch)
    assert torch.equal(batch.sequence_scores, on_ranks) and alone.local is not None and not alone.local.awake

    split = ModelRewardEngine(cfg, driver.tokenizer)
    group = SplitGroup(SequenceClassifierRM(str(tiny_rm_dir), torch.device("cpu")))
    split.attach(group)  # type: ignore[arg-type]
    split.score(batch)
    assert [len(s) for s in group.shares] == [3, 3, 2]
    # other shares, so other micro-batches and padding: the same scores up to rounding
    assert batch.sequence_scores.tolist() == pytest.approx(on_ranks.tolist(), abs=1e-6)


def test_micro_batched_scores_equal_each_response_scored_alone(tiny_rm_dir: Path) -> None:
    """Sorted, left-padded micro-batches give each response its unpadded forward's logit (fp32, up
    to rounding), in the caller's order, whatever the batching; a response ending in the pad
    token is pooled at that token, as vLLM pools."""
    from trainer.rewards.model import micro_batches

    rm = SequenceClassifierRM(str(tiny_rm_dir), torch.device("cpu"))
    words = ["one", "two", "three", "plus", "is", "<|assistant|>", "<|user|>"]
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=g))
             for n in torch.randint(1, 40, (13,), generator=g)]
    pad = rm.tokenizer.pad_token_id
    ids = [list(rm.tokenizer(t, add_special_tokens=True).input_ids) for t in texts]
    ids.append([*ids[0], pad])  # its last token is the pad token: still the pooled one
    alone = rm.score_texts(ids, rows_per_forward=1)
    for rows in (None, 2, 5):
        assert rm.score_texts(ids, rows_per_forward=rows) == pytest.approx(alone, abs=1e-6), rows
    assert len(set(alone)) == len(alone)  # all differ: a row's score cannot have come from another row
    with torch.no_grad():  # the pad-ended row by hand: the head at its last token
        hidden = rm.model.model(input_ids=torch.tensor([ids[-1]])).last_hidden_state
        assert alone[-1] == pytest.approx(float(rm.model.score(hidden[0, -1])[-1]), abs=1e-6)
    assert micro_batches([5, 1, 3, 9, 2], None, 12) == [[1, 4, 2], [0], [3]]  # 3 x 3 <= 12; 5; 9 alone
    assert micro_batches([5, 1, 3, 9, 2], 2, 100) == [[1, 4], [2, 0], [3]]
    assert micro_batches([50], None, 12) == [[0]]  # longer than the budget: alone


def test_the_weights_dtype_follows_verls_serving_dtype(tiny_rm_dir: Path) -> None:
    """verl serves the reward model in `reward_model.rollout.dtype` (bf16 by default); null here is
    bf16 on a GPU and fp32 on the CPU."""
    assert rm_dtype(None, torch.device("cpu")) == torch.float32
    assert rm_dtype(None, torch.device("cuda")) == torch.bfloat16
    rm = SequenceClassifierRM(str(tiny_rm_dir), torch.device("cpu"), "bfloat16")
    assert next(rm.model.parameters()).dtype == torch.bfloat16
    assert isinstance(rm.score_texts(["<|user|> 1 <|assistant|> 2"])[0], float)
    with pytest.raises(ValueError, match="reward_model.rollout.dtype=int8"):
        rm_dtype("int8", torch.device("cpu"))


# ------------------------------------------------------------------------------ verl's legacy worker

#: verl b178a3cd's legacy `RewardModelWorker` (`verl/workers/fsdp_workers.py`; removed in 0.9.1,
#: whose own helpers it calls): `_switch_chat_template` and `_forward_micro_batch` (padded
#: branch) as written there, the model built as `_build_model` builds it (a one-label
#: `AutoModelForTokenClassification` in bf16), on the CPU.
VERL_LEGACY_SIDE = """
import json, sys
import numpy as np, torch
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer
import verl.utils.torch_functional as verl_F
from verl.utils.model import compute_position_id_with_mask

spec = json.loads(sys.stdin.read())
src_tokenizer = AutoTokenizer.from_pretrained(spec["policy"])
target_tokenizer = AutoTokenizer.from_pretrained(spec["rm"])
model_config = AutoConfig.from_pretrained(spec["rm"])
model_config.num_labels = 1
model_config.classifier_dropout = 0.0
reward_module = AutoModelForTokenClassification.from_pretrained(spec["rm"], config=model_config,
                                                                torch_dtype=torch.bfloat16).eval()
responses, attention = torch.tensor(spec["responses"]), torch.tensor(spec["attention_mask"])
max_length = spec["max_length"]
rm_input_ids, rm_attention_mask = [], []
for i in range(len(responses)):
    chat = list(spec["raw_prompts"][i])
    response_ids = responses[i]
    response_length = response_ids.shape[-1]
    valid_response_length = attention[i][-response_length:].sum()
    valid_response_ids = response_ids[:valid_response_length]
    response = src_tokenizer.decode(valid_response_ids)
    response = response.replace(src_tokenizer.eos_token, "")
    chat.append({"role": "assistant", "content": response})
    prompt_with_chat_template = target_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    model_inputs = target_tokenizer(prompt_with_chat_template, return_tensors="pt", add_special_tokens=False)
    input_ids, attention_mask = verl_F.postprocess_data(
        input_ids=model_inputs["input_ids"], attention_mask=model_inputs["attention_mask"], max_length=max_length,
        pad_token_id=target_tokenizer.pad_token_id, left_pad=False, truncation="right")
    rm_input_ids.append(input_ids)
    rm_attention_mask.append(attention_mask)
input_ids, attention_mask = torch.cat(rm_input_ids, dim=0), torch.cat(rm_attention_mask, dim=0)
position_ids = compute_position_id_with_mask(attention_mask)
with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
    output = reward_module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False)
    rm_score = output.logits.squeeze(-1)
    eos_mask_idx = torch.argmax(position_ids * attention_mask, dim=-1)
    rm_score = rm_score[torch.arange(input_ids.shape[0]), eos_mask_idx]
print(json.dumps({"scores": rm_score.float().tolist(), "lengths": attention_mask.sum(-1).tolist()}))
"""


def test_legacy_worker_scores_as_verls(tiny_model_dir: Path, tiny_rm_dir: Path, toy_data: Path,
                                       tmp_path: Path) -> None:
    """`reward_model.use_reward_loop=false` (verl's `*_rm_legacy.sh`): the scores are those of verl
    b178a3cd's legacy worker on the same rows (its BOS kept, no special tokens added, the input cut
    at `reward_model.max_length`, bf16), and differ from the reward loop's where the cut acts."""
    python = verl_python()
    max_length = 12  # shorter than most rendered rows: the cut acts
    common = ("data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "reward_model.enable=true", f"reward_model.model.path={tiny_rm_dir}")
    cfg = load_config(toy_overrides(tiny_model_dir, toy_data, tmp_path, *common, "reward_model.use_reward_loop=false",
                                    f"reward_model.max_length={max_length}"))
    driver = PPODriver(cfg)
    batch = driver.generate(driver.loader.next_batch())
    engine = ModelRewardEngine(cfg, driver.tokenizer)
    assert engine.legacy and engine.dtype == "bfloat16"
    engine.score(batch)
    ours = batch.sequence_scores.tolist()

    spec = {"policy": str(tiny_model_dir), "rm": str(tiny_rm_dir), "responses": batch.responses.tolist(),
            "attention_mask": batch.attention_mask.tolist(), "max_length": max_length,
            "raw_prompts": [[dict(m) for m in e.prompt] for e in batch.examples]}
    done = subprocess.run([python, "-c", VERL_LEGACY_SIDE], input=json.dumps(spec), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(theirs["lengths"]) == max_length and min(theirs["lengths"]) <= max_length
    assert ours == pytest.approx(theirs["scores"], abs=1e-3)  # bf16 both sides (equal on the CPU here)
    assert len({round(s, 3) for s in ours}) > 1

    loop = ModelRewardEngine(load_config(toy_overrides(tiny_model_dir, toy_data, tmp_path, *common)), driver.tokenizer)
    loop.score(batch)
    assert batch.sequence_scores.tolist() != pytest.approx(ours, abs=2e-2)  # the cut and bf16 change the scores


@pytest.mark.parametrize(("items", "says"), [
    (["reward_model.max_length=64"], "set `reward_model.use_reward_loop=false` with it"),
    (["reward_model.use_reward_loop=false", "reward_model.max_length=0"], "whole number of tokens >= 1"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.use_reward_loop=false",
      "custom_reward_function.path=/f.py"], "scores with the discriminative model only"),
])
def test_legacy_settings_out_of_place_are_refused(items: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match="Fix") as err:
        load_config(items, env={})
    assert says in str(err.value)
