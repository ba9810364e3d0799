"""Configuration: defaults, dotted overrides, unknown and unsupported keys, derived values."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer import config as C
from trainer.config import ConfigError, load_config

SEEDS = Path(__file__).parents[1] / "data" / "verl_seed_overrides.txt"
SEED_ENV = {
    "MODEL_PATH": "/models/Qwen2.5-0.5B-Instruct",
    "ENGINE": "vllm",
    "GPUS_PER_NODE": "8",
    "SLURM_GPUS_PER_NODE": "4",
    "SLURM_NNODES": "2",
    "train_files": "/data/gsm8k/train.parquet",
    "val_files": "/data/gsm8k/test.parquet",
}


def seed_command_lines() -> list[list[str]]:
    """Each blank-line separated block of the fixture, split into words as a shell would."""
    text = SEEDS.read_text()
    for name, value in SEED_ENV.items():
        text = text.replace("${" + name + "}", value).replace("$" + name, value)
    blocks = [b for b in text.split("\n\n") if b.strip()]
    lines = []
    for block in blocks:
        body = "\n".join(ln for ln in block.splitlines() if not ln.startswith("#"))
        lines.append(shlex.split(body.replace("\\\n", " ")))
    return lines


def test_seed_fixture_has_the_seed_command_lines() -> None:
    lines = seed_command_lines()
    assert len(lines) == 6
    assert sum(len(words) for words in lines) > 100


TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def supported_part(words: list[str]) -> list[str]:
    """The seed line as written, or, where it asks more tensor-parallel ranks than the one rank
    it leaves the world at (the ROCm GRPO line relies on its PPO line for the sizes), with that
    set back to 1 after checking that the line as written is refused naming the world size."""
    tp = [w for w in words if w.startswith(TP_KEY + "=") and w.split("=", 1)[1] != "1"]
    if not tp or any(w.startswith("trainer.nnodes=") for w in words):
        return words
    with pytest.raises(C.ConfigError, match=r"tensor_model_parallel_size=2` must divide the 1 ranks"):
        load_config(words)
    return [f"{TP_KEY}=1" if w in tp else w for w in words]


@pytest.mark.parametrize("words", seed_command_lines(), ids=lambda w: w[0])
def test_every_seed_override_parses(words: list[str]) -> None:
    words = supported_part(words)
    cfg = load_config(words)
    for word in words:
        key, text = word.split("=", 1)
        if key in C.ACCEPTED_ONLY_AS:
            continue
        node: object = cfg
        for part in key.split("."):
            node = getattr(node, part)
        # The value landed where the key says (last occurrence wins, as in Hydra).
        last = [w for w in words if w.startswith(key + "=")][-1].split("=", 1)[1]
        if word.split("=", 1)[1] == last and not key.endswith(("files", "path")):
            if isinstance(node, list):
                assert node and all(str(v) in last for v in node)
            elif isinstance(node, float):
                assert node == float(last)
            elif isinstance(node, bool):
                assert node == (last.lower() == "true")
            else:
                assert str(node) == last


def test_seed_values_are_typed() -> None:
    cfg = load_config(supported_part(seed_command_lines()[-1]))
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.project_name == "verl_example"
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    assert cfg.trainer.nnodes == 2 and cfg.trainer.n_gpus_per_node == 4
    assert cfg.derived.world_size == 8
    assert cfg.data.train_files == ["/data/gsm8k/train.parquet"]


def test_list_syntaxes() -> None:
    for text in ("['console','wandb']", '["console","wandb"]', "[console, wandb]"):
        assert load_config([f"trainer.logger={text}"]).trainer.logger == ["console", "wandb"]
    assert load_config(["trainer.logger=console"]).trainer.logger == ["console"]
    cfg = load_config(["data.train_files=[a.parquet,b.parquet]"])
    assert [Path(p).name for p in cfg.data.train_files] == ["a.parquet", "b.parquet"]


def test_defaults_file_matches_the_dataclasses_exactly() -> None:
    def keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k}  # {}: a mapping
        return out

    yaml_keys = keys(C.load_defaults())
    assert yaml_keys == {row[0] for row in C.describe_keys()}


def test_every_field_has_help() -> None:
    for key, _type, help_text in C.describe_keys():
        assert help_text.strip(), key


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.train_batch_size = 3  # type: ignore[misc]


def test_unknown_key_lists_valid_keys_at_that_level() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.ppo_mini_bach_size=4"])
    msg = str(err.value)
    assert "`ppo_mini_bach_size`" in msg and "`ppo_mini_batch_size`" in msg and "`clip_ratio_c`" in msg
    with pytest.raises(ConfigError, match="valid keys there: `data`"):
        load_config(["dta.train_batch_size=4"])


def test_unsupported_verl_keys_say_not_supported_yet() -> None:
    for item in ("critic.model.lora_rank=8",
                 "trainer.default_hdfs_dir=hdfs://x", "actor_rollout_ref.rollout.multi_turn.enable=True"):
        with pytest.raises(ConfigError, match="not supported yet"):
            load_config([item])
    # The verl defaults of those keys are accepted: that is what this trainer does.
    load_config(["trainer.default_hdfs_dir=null", "reward_model.enable=False",
                 "actor_rollout_ref.model.use_liger=false"])
    with pytest.raises(ConfigError, match="derived here; set `data.max_response_length`"):
        load_config(["actor_rollout_ref.rollout.response_length=64"])
    # features we do not have: one error each naming the feature, never "unknown key"
    for item, feature in (("reward_model.enable=True", "the reward model worker"),
                          ("reward_model.model.path=/m", "the reward model worker"),
                          ("reward_model.micro_batch_size_per_gpu=4", "the reward model worker"),
                          ("actor_rollout_ref.rollout.name=sglang", "SGLang rollout"),
                          ("actor_rollout_ref.actor.strategy=megatron", "Megatron-LM training"),
                          ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "Megatron-LM"),
                          ("data.image_key=images", "multimodal data")):
        with pytest.raises(ConfigError, match=feature) as err:
            load_config([item])
        assert "unknown key" not in str(err.value)


def test_bad_values_name_key_and_expected_type() -> None:
    with pytest.raises(ConfigError, match=r"`data.train_batch_size=lots`.*int"):
        load_config(["data.train_batch_size=lots"])
    with pytest.raises(ConfigError, match="one of error, left, right, middle"):
        load_config(["data.truncation=cut"])
    with pytest.raises(ConfigError, match="true or false"):
        load_config(["data.shuffle=maybe"])
    with pytest.raises(ConfigError, match="no `=`"):
        load_config(["data.shuffle"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(["data=3"])


def test_cross_key_rules() -> None:
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="needs `actor_rollout_ref.rollout.n` >= 2"):
        load_config(["algorithm.adv_estimator=grpo"])
    with pytest.raises(ConfigError, match="resume_from_path"):
        load_config(["trainer.resume_mode=resume_path"])


def test_derived_values() -> None:
    cfg = load_config(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.ppo_epochs=2",
                       "trainer.project_name=p", "trainer.experiment_name=e"])
    arr = cfg.actor_rollout_ref
    assert cfg.critic.model.path == "/m" and cfg.critic.ppo_epochs == 2
    assert arr.ref.log_prob_use_dynamic_bsz is True and arr.rollout.log_prob_use_dynamic_bsz is True
    assert arr.actor.clip_ratio_low == arr.actor.clip_ratio_high == 0.3
    assert cfg.trainer.default_local_dir == "checkpoints/p/e" == cfg.trainer.run_dir
    assert cfg.derived.use_critic and not cfg.derived.use_reference
    grpo = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                        "actor_rollout_ref.actor.use_kl_loss=true"])
    assert not grpo.derived.use_critic and grpo.derived.use_reference


def test_round_trip_through_dict() -> None:
    cfg = load_config(["trainer.logger=['console','jsonl']"])
    assert C.config_from_dict(C.config_to_dict(cfg)) == cfg


def test_hydra_plus_prefix_is_accepted_for_known_keys() -> None:
    assert load_config(["+data.seed=7"]).data.seed == 7


def test_cli_print_config_validates_and_prints() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "trainer", "--print-config", "data.train_batch_size=64",
         "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.logger=['console','wandb']"],
        capture_output=True, text=True, check=False,
    )
    assert run.returncode == 0, run.stderr
    printed = yaml.safe_load(run.stdout)
    assert printed["data"]["train_batch_size"] == 64
    assert printed["trainer"]["logger"] == ["console", "wandb"]
    bad = subprocess.run([sys.executable, "-m", "trainer", "--print-config", "data.nope=1"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "unknown key `data.nope`" in bad.stderr


# ------------------------------------------------------------------ verl's override grammar


def test_add_force_add_and_delete_follow_verls_grammar() -> None:
    assert load_config(["++data.seed=9"]).data.seed == 9
    restored = load_config(["data.max_prompt_length=77", "~data.max_prompt_length"])
    assert restored.data.max_prompt_length == load_config([]).data.max_prompt_length
    assert load_config(["data.max_prompt_length=77", "~data.max_prompt_length=77"]).data.max_prompt_length != 77
    with pytest.raises(ConfigError, match="only while it equals the given value, but it is 77"):
        load_config(["data.max_prompt_length=77", "~data.max_prompt_length=78"])
    with pytest.raises(ConfigError, match="unknown key `data.no_such_key`"):
        load_config(["~data.no_such_key"])
    # removing a verl key this trainer does not have leaves nothing to remove
    load_config(["~data.return_raw_input_ids"])


def test_null_lists_and_quoting_as_verl_writes_them() -> None:
    cfg = load_config(["trainer.logger=[console, 'wandb']", "data.train_files=['/d/a.parquet', \"/d/b.parquet\"]",
                       "trainer.experiment_name=007", "trainer.project_name='two words'",
                       "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.logger=[\"console\",\"jsonl\"]"])
    assert cfg.trainer.logger == ["console", "jsonl"]  # the last override of a key wins
    assert cfg.data.train_files == ["/d/a.parquet", "/d/b.parquet"]
    assert cfg.trainer.experiment_name == "007" and cfg.trainer.project_name == "two words"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert load_config(["data.val_batch_size=null"]).data.val_batch_size is None
    with pytest.raises(ConfigError, match="null is not allowed here"):
        load_config(["data.train_batch_size=null"])
    with pytest.raises(ConfigError, match="got a dict; expected a int"):
        load_config(["data.train_batch_size={a: 1}"])
    with pytest.raises(ConfigError, match="is a sweep in Hydra's grammar"):
        load_config(["data.train_files=a.parquet,b.parquet"])
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(["trainer.experiment_name=a=b"])


def test_interpolations_resolve_against_the_final_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_TEST_NAME", "from-env")
    cfg = load_config([
        "data.max_response_length=${data.max_prompt_length}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=${data.max_response_length}",
        "trainer.experiment_name=run_${data.max_prompt_length}_${oc.env:HPCRL_TEST_NAME}",
        "data.max_prompt_length=96",  # given after the references: they still see it
    ])
    assert cfg.data.max_response_length == 96
    assert cfg.actor_rollout_ref.rollout.max_num_batched_tokens == 96
    assert cfg.trainer.experiment_name == "run_96_from-env"
    with pytest.raises(ConfigError, match="the interpolation cannot be resolved"):
        load_config(["trainer.experiment_name=${data.no_such_key}"])
    with pytest.raises(ConfigError, match="expected a int"):
        load_config(["data.max_prompt_length=${trainer.experiment_name}"])


def test_the_launcher_reads_overrides_by_the_same_rules() -> None:
    values = C.override_values(["--flag", "data.max_prompt_length=64", "trainer.default_local_dir=/ck/${data.max_prompt_length}",
                                "~data.seed", "trainer.del_local_ckpt_after_load=false"])
    assert values == {"data.max_prompt_length": 64, "trainer.default_local_dir": "/ck/64",
                      "data.seed": load_config([]).data.seed}


def test_every_accepted_key_acts_or_is_marked_compatibility_only() -> None:
    """No silent no-ops: every key the trainer accepts is read by the trainer's code (attribute
    access outside its declaration, or by name in the derivation) or is listed in `COMPAT` with the reason nothing is lost.
    A static check: a new key without code behind it fails here."""
    trainer_dir = Path(C.__file__).parents[1]
    source = "\n".join(p.read_text() for p in trainer_dir.rglob("*.py"))
    silent = [key for key, _, _ in C.describe_keys()
              if key not in C.COMPAT and not re.search(rf'\.{key.split(".")[-1]}\b|\["{key.split(".")[-1]}"\]', source)]
    assert silent == [], f"keys accepted but read nowhere: {silent}; make them act, refuse them, or add to COMPAT"
    for key in C.COMPAT:  # only real keys, each shown as compatibility-only
        C._resolve_key(key)
    printed = C.dump_config(load_config([]))
    assert printed.count("# compatibility only:") == len(C.COMPAT)
    assert yaml.safe_load(printed) == C.config_to_dict(load_config([]))


def test_settings_that_would_do_nothing_are_refused() -> None:
    with pytest.raises(ConfigError, match="must divide the 1 ranks"):  # an engine of 2, world of 1
        load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="a separate rollout deployment is not supported"):
        load_config(["actor_rollout_ref.hybrid_engine=false"])
    with pytest.raises(ConfigError, match="one limit applies to both"):
        load_config(["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"])
    assert load_config(["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"]).trainer.max_critic_ckpt_to_keep == 2


def test_fused_kernel_keys_accept_off_and_refuse_on_naming_the_kernel() -> None:
    load_config(["actor_rollout_ref.model.use_liger=False", "actor_rollout_ref.model.use_fused_kernels=false"])
    for key, kernel in (("use_liger", "Liger fused kernels"), ("use_fused_kernels", "fused linear \\+ log-prob")):
        with pytest.raises(ConfigError, match=kernel):
            load_config([f"actor_rollout_ref.model.{key}=True"])


def test_each_section_module_has_its_defaults_beside_it() -> None:
    """`data.yaml` holds `data.*`, `rollout.yaml` `actor_rollout_ref.rollout.*`, ...: a key's
    default sits beside its type and help line, and no default is set in two files."""
    tops = {"data": ["data"], "actor": ["actor_rollout_ref"], "rollout": ["actor_rollout_ref"],
            "critic": ["critic"], "reward": ["reward_model", "custom_reward_function"],
            "algorithm": ["algorithm"], "trainer": ["trainer"]}
    for path in C.DEFAULTS_FILES:
        tree = yaml.safe_load(path.read_text())
        assert list(tree) == tops[path.stem], path
        assert path.with_suffix(".py").is_file(), path
    assert list(yaml.safe_load((C.DEFAULTS_DIR / "rollout.yaml").read_text())["actor_rollout_ref"]) == ["rollout"]
    assert "rollout" not in yaml.safe_load((C.DEFAULTS_DIR / "actor.yaml").read_text())["actor_rollout_ref"]


def test_lr_scheduler_type_and_its_deprecated_name() -> None:
    optim = load_config([]).actor_rollout_ref.actor.optim
    assert (optim.lr_scheduler_type, optim.num_cycles, optim.warmup_style) == ("constant", 0.5, None)
    cfg = load_config(["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                       "actor_rollout_ref.actor.optim.num_cycles=1.5", "critic.optim.warmup_style=cosine"])
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.actor_rollout_ref.actor.optim.num_cycles == 1.5
    assert cfg.critic.optim.lr_scheduler_type == "cosine"  # verl: `warmup_style`, when set, replaces it
    with pytest.raises(ConfigError, match="one of constant, cosine"):
        load_config(["actor_rollout_ref.actor.optim.lr_scheduler_type=linear"])


def test_reward_kwargs_are_mappings_set_whole_or_by_entry() -> None:
    cfg = load_config(["+custom_reward_function.reward_kwargs.scale=2",
                       "custom_reward_function.reward_kwargs.mode=strict"])
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 2, "mode": "strict"}
    cfg = load_config(["custom_reward_function.reward_kwargs={scale: 0.5, tags: [a, b]}"])
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 0.5, "tags": ["a", "b"]}
    cfg = load_config(["custom_reward_function.reward_kwargs.scale=2", "~custom_reward_function.reward_kwargs.scale"])
    assert cfg.custom_reward_function.reward_kwargs == {}
    with pytest.raises(ConfigError, match="not a mapping"):
        load_config(["custom_reward_function.reward_kwargs=3"])
    batch = load_config(["reward_model.reward_manager=batch", "+reward_model.reward_kwargs.bonus=0.5"])
    assert batch.reward_model.reward_kwargs == {"bonus": 0.5}
    assert C.config_from_dict(C.config_to_dict(batch)) == batch


def test_verl_s_current_overlong_keys_set_the_dapo_buffer() -> None:
    """verl's DAPO scripts: `+reward_model.reward_kwargs.overlong_buffer_cfg.*` and `max_resp_len`."""
    cfg = load_config(["data.max_response_length=64", "reward_model.reward_manager=dapo",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                       "+reward_model.reward_kwargs.max_resp_len=${data.max_response_length}"])
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.log) == (True, 16, 1.0, False)
    assert cfg.reward_model.reward_kwargs == {"max_resp_len": 64}
    with pytest.raises(ConfigError, match="overlong_buffer_cfg.size`; valid: `enable`, `len`"):
        load_config(["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.size=3"])
    with pytest.raises(ConfigError, match="`naive` reward manager does not take.*it takes none"):
        load_config(["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"])
    with pytest.raises(ConfigError, match="between 1 and the length the penalty counts to \\(8"):
        load_config(["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=8",
                     "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                     "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16"])
