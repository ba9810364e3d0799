"""Configuration: defaults, dotted overrides, unknown and unsupported keys, derived values."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer import config as C
from trainer.config import ConfigError, load_config
from trainer.config.async_training import ACT_IN_POOL_LOOPS

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
    mappings = {key for key, type_name, _ in C.describe_keys() if type_name.startswith("mapping")}

    def keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            nested = isinstance(v, dict) and prefix + k not in mappings  # a free-form mapping is one key
            out |= keys(v, f"{prefix}{k}.") if nested else {prefix + k}
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


def test_unknown_key_names_the_closest_key_whole() -> None:
    """A misspelt section or leaf is answered with the whole key it was probably meant to be;
    a name close to nothing gets no guess."""
    with pytest.raises(ConfigError, match=r"\(did you mean `data\.train_batch_size`\?\)"):
        load_config(["dta.train_batch_size=4"])
    with pytest.raises(ConfigError, match=r"\(did you mean `actor_rollout_ref\.actor\.ppo_mini_batch_size`\?\)"):
        load_config(["actor_rollout_ref.actor.ppo_mini_bach_size=4"])
    with pytest.raises(ConfigError) as err:
        load_config(["zzzzqqq.x=1"])
    assert "did you mean" not in str(err.value)


def test_unsupported_verl_keys_say_not_supported_yet() -> None:
    for item in ("critic.model.lora_rank=8",
                 "trainer.default_hdfs_dir=hdfs://x"):
        with pytest.raises(ConfigError, match="not supported"):
            load_config([item])
    # The verl defaults of those keys are accepted: that is what this trainer does.
    load_config(["trainer.default_hdfs_dir=null", "reward_model.enable=False",
                 "actor_rollout_ref.model.use_liger=false"])
    with pytest.raises(ConfigError, match="derived here; set `data.max_response_length`"):
        load_config(["actor_rollout_ref.rollout.response_length=64"])
    # features we do not have: one error each naming the feature, never "unknown key"
    for item, feature in (("reward_model.strategy=megatron", "the reward model worker"),
                          ("reward_model.nnodes=2", "a reward model on a resource pool of its own"),
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


def test_clip_ratios_kl_names_and_the_worker_switch() -> None:
    """verl's clip-ratio rule: `clip_ratio` stands in only for a null `clip_ratio_low`/`high`; an
    explicit 0 is kept. KL names: verl's seven and their `+` variants. The worker switch takes
    verl's three values."""
    actor = load_config(["actor_rollout_ref.actor.clip_ratio_low=0"]).actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.0, 0.2)
    actor = load_config(["actor_rollout_ref.actor.clip_ratio_high=null",
                         "actor_rollout_ref.actor.clip_ratio=0.28"]).actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    for name in ("k1", "k2", "k3", "k3+", "low_var_kl+", "kl+"):
        cfg = load_config([f"actor_rollout_ref.actor.kl_loss_type={name}", f"algorithm.kl_penalty={name}"])
        assert cfg.actor_rollout_ref.actor.kl_loss_type == cfg.algorithm.kl_penalty == name
    with pytest.raises(ConfigError, match="`algorithm.kl_penalty=full` is not a KL estimator; valid values: kl, k1"):
        load_config(["algorithm.kl_penalty=full"])
    for impl in ("auto", "enable", "disable"):
        assert load_config([f"trainer.use_legacy_worker_impl={impl}"]).trainer.use_legacy_worker_impl == impl
    with pytest.raises(ConfigError, match="use_legacy_worker_impl"):
        load_config(["trainer.use_legacy_worker_impl=yes"])


def test_derived_values() -> None:
    cfg = load_config(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.ppo_epochs=2",
                       "trainer.project_name=p", "trainer.experiment_name=e"])
    arr = cfg.actor_rollout_ref
    assert cfg.critic.model.path == "/m" and cfg.critic.ppo_epochs == 2
    assert arr.ref.log_prob_use_dynamic_bsz is True and arr.rollout.log_prob_use_dynamic_bsz is True
    # as in verl, `clip_ratio` alone changes nothing: `clip_ratio_low`/`high` default to 0.2
    assert arr.actor.clip_ratio_low == arr.actor.clip_ratio_high == 0.2
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
    noted = subprocess.run([sys.executable, "-m", "trainer", "--print-config",
                            "actor_rollout_ref.model.use_shm=true", "data.train_batch_size=512", HF],
                           capture_output=True, text=True, check=False)
    assert noted.returncode == 0, noted.stderr
    [note] = noted.stderr.splitlines()  # one line on stderr; stdout stays YAML
    assert note.startswith("python -m trainer: note: `actor_rollout_ref.model.use_shm`")
    assert "the numbers are the same" in note
    assert yaml.safe_load(noted.stdout)["actor_rollout_ref"]["model"]["use_shm"] is True


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
    with pytest.raises(ConfigError, match="got a dict; expected an int"):
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
    with pytest.raises(ConfigError, match="expected an int"):
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
              if key not in C.COMPAT and key not in ACT_IN_POOL_LOOPS and not re.search(rf'\.{key.split(".")[-1]}\b|\["{key.split(".")[-1]}"\]', source)]
    assert silent == [], f"keys accepted but read nowhere: {silent}; make them act, refuse them, or add to COMPAT"
    for key in C.COMPAT:  # only real keys, each shown as compatibility-only
        C._resolve_key(key)
    printed = C.dump_config(load_config([]))
    assert printed.count("# compatibility only:") == len(C.COMPAT)
    assert yaml.safe_load(printed) == C.config_to_dict(load_config([]))


def test_settings_that_would_do_nothing_are_refused() -> None:
    with pytest.raises(ConfigError, match="must divide the 1 ranks"):  # an engine of 2, world of 1
        load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="the rollout pool is empty"):
        load_config(["actor_rollout_ref.hybrid_engine=false"])
    with pytest.raises(ConfigError, match="one limit applies to both"):
        load_config(["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"])
    assert load_config(["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"]).trainer.max_critic_ckpt_to_keep == 2


def test_each_section_module_has_its_defaults_beside_it() -> None:
    """`data.yaml` holds `data.*`, `rollout.yaml` `actor_rollout_ref.rollout.*`, ...: a key's
    default sits beside its type and help line, and no default is set in two files."""
    tops = {"data": ["data"], "actor": ["actor_rollout_ref"], "rollout": ["actor_rollout_ref"],
            "critic": ["critic"], "reward": ["reward_model", "custom_reward_function"],
            "algorithm": ["algorithm"], "trainer": ["trainer", "global_profiler"],
            "async_training": ["async_training", "rollout"]}
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
    with pytest.raises(ConfigError, match="a mapping is expected"):
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


# ------------------------------------------------- verl keys that change no number: accepted

HF = "actor_rollout_ref.rollout.name=hf"
NO_OPS = [  # (override, the key --print-config marks, a word of what runs instead)
    ("actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.use_fused_kernels", "full logits"),
    ("actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
     "actor_rollout_ref.model.fused_kernel_options", "do not run"),
    ("actor_rollout_ref.model.use_liger=True", "actor_rollout_ref.model.use_liger", "own layers"),
    ("actor_rollout_ref.model.use_shm=True", "actor_rollout_ref.model.use_shm", "shared memory"),
    ("data.use_shm=True", "data.use_shm", "shared memory"),
    ("actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.load_format", "every sync"),
    ("actor_rollout_ref.rollout.layered_summon=True", "actor_rollout_ref.rollout.layered_summon", "buckets"),
    ("actor_rollout_ref.rollout.enable_prefix_caching=False",
     "actor_rollout_ref.rollout.enable_prefix_caching", "always on"),
    ("actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler", "nothing is profiled"),
    ("actor_rollout_ref.ref.profiler.tool_config.npu.contents=[npu,cpu]", "actor_rollout_ref.ref.profiler",
     "nothing is profiled"),
    ("actor_rollout_ref.rollout.profiler.ranks=[0,4]", "actor_rollout_ref.rollout.profiler", "nothing is profiled"),
    ("critic.profiler.all_ranks=True", "critic.profiler", "nothing is profiled"),
    ("global_profiler.tool=nsys", "global_profiler", "nothing is profiled"),
    ("actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.actor.use_torch_compile", "eagerly"),
    ("actor_rollout_ref.ref.use_torch_compile=False", "actor_rollout_ref.ref.use_torch_compile", "eagerly"),
    ("actor_rollout_ref.ref.strategy=fsdp2", "actor_rollout_ref.ref.strategy", "FSDP2"),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable",
     "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "SGLang multi-turn rollout only"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.enable", "agent_name"),
    ("actor_rollout_ref.rollout.agent.num_workers=2", "actor_rollout_ref.rollout.agent.num_workers", "which worker"),
    ("actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.rollout.over_sample_rate", "no code"),
    ("actor_rollout_ref.rollout.multi_stage_wake_up=true", "actor_rollout_ref.rollout.multi_stage_wake_up",
     "peak memory"),
]


@pytest.mark.parametrize(("item", "key", "instead"), NO_OPS, ids=[n[0].split("=")[0] for n in NO_OPS])
def test_verl_keys_that_change_no_number_are_accepted_with_one_note(item: str, key: str, instead: str) -> None:
    """verl keys whose setting changes no number load, print one note naming what runs instead,
    and are marked in --print-config."""
    items = [HF, item]  # the engine named: no note about a derived one
    notes = C.compat_notes(items, load_config(items))
    assert len(notes) == 1 and instead in notes[0] and "the numbers are the same" in notes[0], notes
    assert notes[0].startswith(f"`{key}")
    marked = [line for line in C.dump_config(load_config(items)).splitlines() if "# compatibility only:" in line]
    assert any(line.strip().startswith(key.rsplit(".", 1)[-1] + ":") and instead in line for line in marked)


def test_no_note_for_acting_keys_or_verl_defaults() -> None:
    items = ["data.train_batch_size=512", "actor_rollout_ref.model.use_fused_kernels=false",
             "actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.actor.use_torch_compile=true", HF]
    assert C.compat_notes(items, load_config(items)) == []


def test_newer_verl_spellings_are_read_as_this_trainers_keys() -> None:
    items = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=32",
             "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096", HF]
    cfg = load_config(items)
    arr = cfg.actor_rollout_ref
    assert (arr.model.lora_rank, arr.model.lora_alpha, arr.rollout.update_weights_bucket_megabytes) == (8, 32, 4096)
    notes = C.compat_notes(items, cfg)
    assert [n.split("`")[1] for n in notes] == [i.split("=")[0] for i in items[:-1]]
    assert "read as it" in notes[0] and "`actor_rollout_ref.model.lora_rank`" in notes[0]
    assert C.override_values(items)["actor_rollout_ref.model.lora_rank"] == 8
    # the rest of Megatron's LoRA section and other checkpoint-engine options change numbers or
    # select what is not here: refused, naming the feature
    for item, feature in (("actor_rollout_ref.model.lora.dropout=0.1", "Megatron's LoRA options"),
                          ("actor_rollout_ref.rollout.checkpoint_engine.backend=mooncake",
                           "the Mooncake checkpoint engine is not supported.*Fix: set .*backend=nccl"),
                          ("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs={a: 1}", "checkpoint engine plug-ins")):
        with pytest.raises(ConfigError, match=feature):
            load_config([item])


def test_lora_with_reference_offload_is_accepted_with_a_note() -> None:
    items = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.fsdp_config.param_offload=true", HF]
    [note] = C.compat_notes(items, load_config(items))
    assert "adapters disabled" in note and "the numbers are the same" in note


def test_free_form_mappings_take_any_sub_key() -> None:
    """verl's profiler sections and `apply_chat_template_kwargs` are mappings: sub-keys are set,
    replaced, deleted and printed as given."""
    cfg = load_config(["data.apply_chat_template_kwargs.enable_thinking=false",
                       "+data.apply_chat_template_kwargs.reasoning_effort=medium",
                       "actor_rollout_ref.actor.profiler.tool_config.npu.level=level0",
                       "global_profiler={tool: nsys, steps: [1, 2]}"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "medium"}
    assert cfg.actor_rollout_ref.actor.profiler == {"tool_config": {"npu": {"level": "level0"}}}
    assert cfg.global_profiler == {"tool": "nsys", "steps": [1, 2]}
    assert yaml.safe_load(C.dump_config(cfg))["global_profiler"] == {"tool": "nsys", "steps": [1, 2]}
    cfg = load_config(["data.apply_chat_template_kwargs.enable_thinking=false",
                       "~data.apply_chat_template_kwargs.enable_thinking"])
    assert cfg.data.apply_chat_template_kwargs == {}
    assert load_config().actor_rollout_ref.model.fused_kernel_options == {"impl_backend": "torch"}
    with pytest.raises(ConfigError, match="a mapping is expected"):
        load_config(["data.apply_chat_template_kwargs=3"])
    with pytest.raises(ConfigError, match="holds a value, not a mapping"):
        load_config(["global_profiler.tool=nsys", "global_profiler.tool.x=1"])


# ------------------------------------------------------------------ verl's defaults, here

ROCM_GRPO = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024",
             "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.use_dynamic_bsz=True",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
             "actor_rollout_ref.ref.fsdp_config.param_offload=True"]


def test_gpus_per_node_follows_the_gpus_granted_under_hpcrl() -> None:
    """verl defaults `trainer.n_gpus_per_node` to 8; here it is the GPUs per node hpcrl asked
    Slurm for (`HPCRL_GPUS_PER_NODE`), so a verl line that sets none runs on what was granted."""
    cfg = load_config(ROCM_GRPO, env={C.GPUS_ENV: "8"})
    assert (cfg.trainer.n_gpus_per_node, cfg.derived.world_size) == (8, 8)
    assert load_config(["trainer.nnodes=2"], env={C.GPUS_ENV: "4"}).derived.world_size == 8
    assert load_config(["trainer.n_gpus_per_node=2"], env={C.GPUS_ENV: "8"}).trainer.n_gpus_per_node == 2
    assert load_config([], env={C.GPUS_ENV: "0"}).trainer.n_gpus_per_node == 1  # CPU nodes: one worker
    with pytest.raises(ConfigError, match="`HPCRL_GPUS_PER_NODE=eight` is not a whole number"):
        load_config([], env={C.GPUS_ENV: "eight"})


def test_gpus_per_node_standalone_counts_the_visible_gpus_without_initialising_cuda() -> None:
    import torch

    cfg = load_config([], env={})
    assert cfg.trainer.n_gpus_per_node == max(torch.cuda.device_count(), 1)
    assert not torch.cuda.is_initialized()
    run = subprocess.run([sys.executable, "-m", "trainer", "--print-config"], capture_output=True,
                         text=True, check=False, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert yaml.safe_load(run.stdout)["trainer"]["n_gpus_per_node"] == 1, run.stderr  # no GPU seen: 1


def test_rollout_engine_is_vllm_where_installed_else_hf_with_a_note(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    items = ["data.train_batch_size=512"]
    if importlib.util.find_spec("vllm") is None:
        cfg = load_config(items)
        assert cfg.actor_rollout_ref.rollout.name == "hf"
        [note] = C.compat_notes(items, cfg)
        assert "vLLM (verl's default engine) is not installed" in note and "`hf`" in note
    (tmp_path / "vllm").mkdir()  # an installed vLLM, as the lookup sees it (nothing imports it)
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('not imported by the config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(items)
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert C.compat_notes(items, cfg) == []
    assert load_config(["actor_rollout_ref.rollout.name=hf"]).actor_rollout_ref.rollout.name == "hf"


def test_a_critic_without_a_micro_batch_size_is_refused_at_the_start_as_verl_refuses_it() -> None:
    """verl's `CriticConfig` (built when `validate_config` runs at the trainer's start) refuses a
    critic with neither `ppo_micro_batch_size_per_gpu` nor dynamic batching. Reading the config
    does not refuse it (verl's Hydra compose does not); the start does, and so does the
    launcher's check (`check_overrides`), before the queue."""
    from trainer.driver import PPODriver

    bare = load_config([])  # verl's defaults: gae, no micro-batch size
    with pytest.raises(ConfigError, match=r"`critic.ppo_micro_batch_size_per_gpu` \(e.g. 4\)") as err:
        C.check_run(bare)
    assert "`algorithm.adv_estimator=gae` trains a critic" in str(err.value)
    with pytest.raises(ConfigError, match="trains a critic"):
        C.check_overrides([])
    with pytest.raises(ConfigError, match="trains a critic"):
        PPODriver(bare)  # refused before any model or data is read
    for ok in (["critic.ppo_micro_batch_size_per_gpu=4"], ["critic.use_dynamic_bsz=true"],
               ["actor_rollout_ref.actor.use_dynamic_bsz=true"],  # the critic follows the actor's
               ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]):  # no critic
        C.check_run(load_config(ok))
        C.check_overrides(ok)
    with pytest.raises(ConfigError, match="trains a critic"):  # the critic's own setting wins
        C.check_run(load_config(["actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=false"]))


@pytest.mark.parametrize(("override", "needle"), [
    ("actor_rollout_ref.actor.optim.lr=-1", "`actor_rollout_ref.actor.optim.lr=-1.0` must be a number 0 or more"),
    ("actor_rollout_ref.actor.optim.lr=nan", "`actor_rollout_ref.actor.optim.lr=nan` must be a number 0 or more"),
    ("critic.optim.weight_decay=-0.1", "`critic.optim.weight_decay=-0.1` must be a number 0 or more"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5", "must be a number from 0 to 1"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=-0.5", "`actor_rollout_ref.actor.optim.min_lr_ratio=-0.5`"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps=-2", "must be -1 (use `lr_warmup_steps_ratio`)"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", "must be two numbers from 0 up to (not including) 1"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "must be two numbers"),
])
def test_optimizer_values_adamw_cannot_use_are_refused_naming_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert needle in str(err.value), str(err.value)


def test_optimizer_values_at_their_edges_are_accepted() -> None:
    cfg = load_config(["actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.min_lr_ratio=1",
                       "actor_rollout_ref.actor.optim.betas=[0.0,0.999]", "critic.optim.lr_warmup_steps=0"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 0.0
