"""The data and settings of verl's agent loops: rows keep their `agent_name` and tool arguments,
a row whose tool is not configured is refused (by the trainer and before the queue), the agent
loops' settings are accepted with their values, those not built are refused by name, the ones
that change no number are noted, and verl's `--config-path`/`--config-name` entry reads a
user's config file over verl's `ppo_trainer`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from hpcrl import preflight as pf
from trainer.__main__ import main
from trainer.config import (
    ConfigError,
    check_overrides,
    compat_notes,
    expand_args,
    file_overrides,
    load_config,
    override_values,
    split_config_flags,
)
from trainer.data import (
    DataError,
    PromptDataset,
    configured_tool_names,
    tools_file_refusal,
    tools_refusal,
)

HF = "actor_rollout_ref.rollout.name=hf"
ROLLOUT = "actor_rollout_ref.rollout"


def _row(i: int, **extra: Any) -> dict[str, Any]:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)}, **extra}


def _tool_agent_row(i: int) -> dict[str, Any]:
    """A row as verl's `examples/data_preprocess/gsm8k_tool_agent_loop.py` writes it."""
    return _row(i, agent_name="tool_agent", extra_info={
        "split": "train", "index": i, "need_tools_kwargs": True,
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(i)}}},
        "interaction_kwargs": {"query": f"q{i}", "ground_truth": str(i)}})


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ------------------------------------------------------------------------ data rows


class _Words:
    """A tokenizer seam: one id per character of the rendered text (what the data loader
    needs of a tokenizer); it records the keyword arguments of each rendering."""

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        self.kwargs.append(kwargs)
        tools = "".join(t["function"]["name"] for t in kwargs.get("tools") or [])
        return tools + "|".join(m["content"] for m in messages)

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_verl_tool_agent_rows_keep_their_agent_and_tool_arguments(tmp_path: Path) -> None:
    path = _write(tmp_path / "train.parquet", [_tool_agent_row(i) for i in range(3)]
                  + [_row(3, agent_name=None, extra_info={"index": 3, "tools_kwargs": None})])
    data = PromptDataset([path], _Words(), max_prompt_length=64, tools={"calc_gsm8k_reward"},
                         agents={"single_turn_agent", "tool_agent"})
    assert [e.agent_name for e in data.examples] == ["tool_agent"] * 3 + ["single_turn_agent"]
    assert data[1].extra_info["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "1"}
    other = PromptDataset([path], _Words(), max_prompt_length=64, default_agent="tool_agent")
    assert other[3].agent_name == "tool_agent"  # `rollout.agent.default_agent_loop` for rows without one


def test_rows_whose_tool_is_not_configured_are_refused_before_tokenizing(tmp_path: Path) -> None:
    """Trained without the tool they were made for, they would be silently single-turn."""
    plain = _row(0, agent_name=None, extra_info={"split": "train", "index": 0, "need_tools_kwargs": None,
                                                 "tools_kwargs": None, "interaction_kwargs": None})
    path = _write(tmp_path / "train.parquet", [plain, _tool_agent_row(1)])

    class Untouchable:
        def apply_chat_template(self, *a: Any, **k: Any) -> Any:
            raise AssertionError("tokenized a refused file")

        def __call__(self, *a: Any, **k: Any) -> Any:
            raise AssertionError("tokenized a refused file")

    with pytest.raises(DataError) as err:
        PromptDataset([path], Untouchable(), max_prompt_length=64, tools=set())
    msg = str(err.value)
    assert "1 of 2 rows (the first: row 1)" in msg and "`calc_gsm8k_reward`" in msg
    assert "tools configured: none" in msg and "multi_turn.tool_config_path" in msg
    assert tools_refusal([_tool_agent_row(0)], path, {"calc_gsm8k_reward"}) is None
    assert "`other`" in (tools_refusal([_row(0, extra_info={"tools_kwargs": {"other": {"x": 1}}})], path,
                                       {"calc_gsm8k_reward"}) or "")
    empty = _row(0, extra_info={"tools_kwargs": {"calc": {"x": None}}})  # a struct column's blank
    assert tools_refusal([empty], path, set()) is None


def test_an_unknown_agent_name_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.parquet", [_row(0, agent_name="react_agent")])
    with pytest.raises(DataError, match="`agent_name=react_agent` is not an agent loop here .*`tool_agent`"):
        PromptDataset([path], _Words(), max_prompt_length=64, agents={"single_turn_agent", "tool_agent"})


def test_data_tool_config_renders_every_prompt_with_the_tools(tmp_path: Path) -> None:
    """verl's `data.tool_config_path`: its dataset and single-turn loop pass `tools=`."""
    words = _Words()
    schema = {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {}}}
    data = PromptDataset([_write(tmp_path / "t.parquet", [_row(0)])], words, max_prompt_length=64,
                         tool_schemas=[schema])
    assert words.kwargs[0]["tools"] == [schema]
    assert "".join(map(chr, data[0].prompt_ids)) == "calcq0"


def test_the_length_check_renders_with_the_tool_loop_s_schemas(tmp_path: Path) -> None:
    """verl's multi-turn scripts set only `multi_turn.tool_config_path`; verl's
    `data.tool_config_path` defaults to it, so its length filter renders every prompt with those
    schemas, as the tool agent loop renders its prompt. The prompt ids stay as
    `data.tool_config_path` (unset) renders them."""
    from tests.trainer.agent.test_tools import VERL_GSM8K_TOOL_CONFIG
    from trainer import tiny
    from trainer.agent.manager import agent_data_args
    from trainer.data import chat_prompt_ids

    tok = tiny.build_tokenizer(tools=True)
    tools = tmp_path / "tools.yaml"
    tools.write_text(VERL_GSM8K_TOOL_CONFIG)
    args = agent_data_args(load_config([f"{ROLLOUT}.multi_turn.tool_config_path={tools}"]))
    assert args["tool_schemas"] is None and [s["function"]["name"] for s in args["length_tool_schemas"]] == [
        "calc_gsm8k_reward"]
    short = [{"role": "user", "content": "what is 1 plus 2?"}]
    long = [{"role": "user", "content": "what is 1 plus 2? " * 3}]
    limit = len(chat_prompt_ids(tok, short, {"tools": args["length_tool_schemas"]}))
    assert len(chat_prompt_ids(tok, long)) <= limit < len(chat_prompt_ids(tok, long, {"tools": args["length_tool_schemas"]}))
    path = _write(tmp_path / "t.parquet", [{**_tool_agent_row(0), "prompt": short}, {**_tool_agent_row(1), "prompt": long}])
    data = PromptDataset([path], tok, max_prompt_length=limit, filter_overlong_prompts=True, **args)
    assert [e.index for e in data.examples] == [0] and data.num_filtered == 1
    assert data[0].prompt_ids == chat_prompt_ids(tok, short)  # rendered without `tools=`, as before
    with pytest.raises(DataError, match=r"row 1 .* rendered with the tool schemas of `actor_rollout_ref.rollout.multi"):
        PromptDataset([path], tok, max_prompt_length=limit, **args)


def _tool_config(tmp_path: Path, name: str = "calc_gsm8k_reward") -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool",
                                               "config": {"type": "native"},
                                               "tool_schema": {"type": "function", "function": {"name": name}}}]}))
    return path


def test_hpcrl_preflight_refuses_rows_without_their_tool_before_the_queue(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "float32"}')
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    path = _write(tmp_path / "train.parquet", [_tool_agent_row(0)])
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={path}", "trainer.val_before_train=false",
            "critic.ppo_micro_batch_size_per_gpu=4"]
    problems = pf.check_trainer_job(base, tmp_path / "run")
    assert problems == [f"`data.train_files`: {tools_file_refusal(path, set())}"]
    assert configured_tool_names(_tool_config(tmp_path)) == {"calc_gsm8k_reward"}
    tools = f"{ROLLOUT}.multi_turn.tool_config_path={_tool_config(tmp_path)}"
    assert pf.check_trainer_job([*base, tools], tmp_path / "run") == []
    wrong = f"{ROLLOUT}.multi_turn.tool_config_path={_tool_config(tmp_path, 'calculator')}"
    assert "`calc_gsm8k_reward`" in pf.check_trainer_job([*base, wrong], tmp_path / "run")[0]


def test_agent_rows_on_a_tensor_parallel_engine_pass_the_preflight(tmp_path: Path) -> None:
    """The first rank of a tensor-parallel engine runs the loops, the others follow it
    (`tests/trainer/agent/test_training.py::test_a_tensor_parallel_engine_trains_multi_turn_rows`):
    such rows are no longer refused before the queue."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "float32"}')
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    path = _write(tmp_path / "train.parquet", [_row(0, agent_name="single_turn_agent"), _row(1, agent_name="tool_agent")])
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={path}", "trainer.val_before_train=false",
            "trainer.n_gpus_per_node=2", f"{ROLLOUT}.tensor_model_parallel_size=2", "critic.ppo_micro_batch_size_per_gpu=4"]
    assert pf.check_trainer_job(base, tmp_path / "run") == []


# ------------------------------------------------------------------------ settings


@pytest.mark.parametrize(("item", "feature"), [
    (f"{ROLLOUT}.agent.custom_async_server.path=/srv.py", "custom async rollout servers"),
    (f"{ROLLOUT}.agent.agent_loop_manager_class=my.Manager", "custom agent-loop manager"),
])
def test_settings_not_built_are_refused_by_name(item: str, feature: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([item])
    msg = str(err.value)
    assert "not supported yet" in msg and feature in msg and "unknown key" not in msg, msg
    load_config([f"{item.split('=', 1)[0]}=null"])  # verl's default: what runs here


def test_agent_loop_settings_are_accepted_with_their_values() -> None:
    cfg = load_config([HF, "data.tool_config_path=/cfg/tools.yaml", f"{ROLLOUT}.multi_turn.tool_config_path=/t.yaml",
                       f"{ROLLOUT}.multi_turn.interaction_config_path=/i.yaml", f"{ROLLOUT}.multi_turn.max_user_turns=3",
                       f"{ROLLOUT}.agent.default_agent_loop=tool_agent", f"{ROLLOUT}.agent.agent_loop_config_path=/l.yaml",
                       f"{ROLLOUT}.multi_turn.tool_response_truncate_side=left"])
    r = cfg.actor_rollout_ref.rollout
    assert cfg.data.tool_config_path == "/cfg/tools.yaml" and r.multi_turn.tool_config_path == "/t.yaml"
    assert r.multi_turn.interaction_config_path == "/i.yaml" and r.multi_turn.max_user_turns == 3
    assert r.agent.default_agent_loop == "tool_agent" and r.agent.agent_loop_config_path == "/l.yaml"
    with pytest.raises(ConfigError, match="tool_response_truncate_side"):
        load_config([HF, f"{ROLLOUT}.multi_turn.tool_response_truncate_side=top"])


def test_an_unknown_agent_key_is_still_unknown() -> None:
    with pytest.raises(ConfigError, match="unknown key `actor_rollout_ref.rollout.agent.num_workerz`"):
        load_config([f"{ROLLOUT}.agent.num_workerz=2"])


def test_rollout_mode_chooses_vllm_s_engine_and_is_noted_where_it_changes_nothing() -> None:
    """`sync` (the default here: faster for single-turn rows) is the in-process engine; `async`
    a server-mode replica per engine on vLLM (over its `tensor_model_parallel_size` ranks, which
    must be one node's); elsewhere it is accepted with a note saying what runs."""
    from trainer.rollout.vllm_server import server_mode

    vllm = f"{ROLLOUT}.name=vllm"
    assert load_config([HF]).actor_rollout_ref.rollout.mode == "sync"
    assert server_mode(load_config([vllm, f"{ROLLOUT}.mode=async"]))
    assert not server_mode(load_config([vllm])) and not server_mode(load_config([HF, f"{ROLLOUT}.mode=async"]))
    items = [vllm, f"{ROLLOUT}.mode=async", f"{ROLLOUT}.multi_turn.enable=false"]
    assert compat_notes(items, load_config(items)) == []
    items = [HF, f"{ROLLOUT}.mode=async"]
    [note] = compat_notes(items, load_config(items))
    assert "changes nothing with `rollout.name=hf`" in note
    items = [vllm, f"{ROLLOUT}.mode=async", f"{ROLLOUT}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]
    cfg = load_config(items)
    assert compat_notes(items, cfg) == [] and server_mode(cfg)
    with pytest.raises(ConfigError, match=r"one node's\. Fix: a `tensor_model_parallel_size` that divides"):
        load_config([vllm, f"{ROLLOUT}.mode=async", f"{ROLLOUT}.tensor_model_parallel_size=2",
                     "trainer.nnodes=2", "trainer.n_gpus_per_node=1"])
    # the in-process engine may span nodes (vLLM's external launcher forms its group from torch's)
    assert not server_mode(load_config([vllm, f"{ROLLOUT}.tensor_model_parallel_size=2", "trainer.nnodes=2",
                                        "trainer.n_gpus_per_node=1"]))


def test_multi_turn_notes_say_the_data_chooses_the_loop() -> None:
    items = [HF, f"{ROLLOUT}.multi_turn.enable=true", f"{ROLLOUT}.multi_turn.max_user_turns=3",
             f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode=disable"]
    notes = compat_notes(items, load_config(items))
    assert len(notes) == 2  # max_user_turns acts: no note
    assert "`agent_name`" in notes[0] and "SGLang multi-turn rollout only" in notes[1]


def test_sglang_refusal_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="Fix: set `actor_rollout_ref.rollout.name=vllm`"):
        load_config([f"{ROLLOUT}.name=sglang"])


def test_a_later_override_replaces_a_refused_value_as_in_hydra() -> None:
    """The value a key ends with is checked: a refused value that a later override replaces is
    not refused (the fix appended to a verl script's line), its key still is checked."""
    cfg = load_config([f"{ROLLOUT}.name=sglang", f"{ROLLOUT}.name=hf",
                       "actor_rollout_ref.actor.use_kl_loss=", "actor_rollout_ref.actor.use_kl_loss=true"])
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.actor.use_kl_loss
    with pytest.raises(ConfigError, match="unknown key `data.nope`"):
        load_config(["data.nope=1", "data.nope=2"])
    with pytest.raises(ConfigError, match="SGLang"):
        load_config([f"{ROLLOUT}.name=hf", f"{ROLLOUT}.name=sglang"])


# ------------------------------------------------------------------------ --config-path / --config-name


def _user_config(tmp_path: Path, body: dict[str, Any], name: str = "my_grpo") -> Path:
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return tmp_path


VERL_STYLE = {  # as verl's examples/sglang_multiturn/config/*.yaml are written
    "hydra": {"searchpath": ["file://verl/trainer/config"]},
    "defaults": ["ppo_trainer", "_self_"],
    "data": {"max_prompt_length": 256, "train_batch_size": 32, "return_raw_chat": True},
    "algorithm": {"adv_estimator": "grpo"},
    "actor_rollout_ref": {"hybrid_engine": True, "actor": {"ppo_mini_batch_size": 16}, "rollout": {
        "name": "sglang", "n": 4, "multi_turn": {"enable": True, "max_assistant_turns": 5,
                                                 "_target_": "verl.workers.config.MultiTurnConfig"}}},
}


def test_config_file_keys_apply_over_the_defaults_and_the_command_line_over_them(tmp_path: Path) -> None:
    folder = _user_config(tmp_path, VERL_STYLE)
    args = [f"--config-path={folder}", "--config-name=my_grpo", HF, "data.train_batch_size=64"]
    cfg = load_config(expand_args(args))
    assert cfg.data.max_prompt_length == 256 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.train_batch_size == 64  # the command line wins
    assert cfg.actor_rollout_ref.rollout.name == "hf"  # the file's sglang replaced: not refused
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5
    assert override_values(args)["data.max_prompt_length"] == 256  # the launcher reads it too
    assert check_overrides(args).actor_rollout_ref.rollout.n == 4
    with pytest.raises(ConfigError, match="SGLang rollout is not supported"):
        load_config(expand_args([f"--config-path={folder}", "--config-name=my_grpo.yaml"]))


def test_the_file_s_refusals_name_the_file(tmp_path: Path) -> None:
    body = {"defaults": ["ppo_trainer", "_self_"], "actor_rollout_ref": {"rollout": {"trace": {
        "backend": "weave"}}}}
    folder = _user_config(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_config(file_overrides(str(folder), "my_grpo"))
    assert "rollout tracing to Weave" in str(err.value) and str(folder / "my_grpo.yaml") in str(err.value)


def test_defaults_compose_in_order_and_refuse_what_is_not_here(tmp_path: Path) -> None:
    _user_config(tmp_path, {"defaults": ["ppo_trainer", "_self_"], "data": {"max_prompt_length": 100,
                                                                           "seed": 3}}, "base")
    _user_config(tmp_path, {"defaults": ["base", "_self_"], "data": {"max_prompt_length": 200}}, "top")
    _user_config(tmp_path, {"defaults": ["_self_", "base"], "data": {"max_prompt_length": 300}}, "under")
    read = lambda name: load_config(file_overrides(str(tmp_path), name)).data  # noqa: E731
    assert (read("top").max_prompt_length, read("top").seed) == (200, 3)
    assert read("under").max_prompt_length == 100  # `_self_` first: the defaults after it win
    _user_config(tmp_path, {"defaults": ["ppo_megatron_trainer", "_self_"]}, "mega")
    with pytest.raises(ConfigError, match="Megatron-LM training is not supported"):
        file_overrides(str(tmp_path), "mega")
    _user_config(tmp_path, {"defaults": [{"actor@actor_rollout_ref.actor": "dp_actor"}, "_self_"]}, "group")
    with pytest.raises(ConfigError, match="selects a config group"):
        file_overrides(str(tmp_path), "group")
    with pytest.raises(ConfigError, match="does not exist"):
        file_overrides(str(tmp_path), "nope")
    with pytest.raises(ConfigError, match="without `--config-path`"):
        file_overrides(None, "top")
    assert file_overrides(None, "ppo_trainer") == []  # verl's own: the defaults here


def test_config_flags_in_every_spelling() -> None:
    for words in (["--config-path=/c", "--config-name=x", "a.b=1"], ["--config-path", "/c", "--config-name", "x", "a.b=1"],
                  ["-cp", "/c", "-cn=x", "a.b=1"], ["--config-path='/c'", "--config-name='x'", "a.b=1"]):
        assert split_config_flags(words) == ("/c", "x", ["a.b=1"])


def test_python_m_trainer_takes_config_path_and_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _user_config(tmp_path, VERL_STYLE)
    assert main(["--print-config", "--config-path", str(folder), "--config-name", "my_grpo", HF]) == 0
    out = capsys.readouterr()
    printed = yaml.safe_load(out.out)
    assert printed["data"]["max_prompt_length"] == 256
    assert "multi_turn.enable" in out.err and "agent_name" in out.err  # the file's no-op, noted
    run = subprocess.run([sys.executable, "-m", "trainer", "--print-config", f"--config-path={folder}",
                          "--config-name=my_grpo"], capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "set `actor_rollout_ref.rollout.name=vllm`" in run.stderr
