"""verl's own generated config, key by key and whole: every key at verl's default is accepted
(`tests/trainer/verl_defaults.py` counts them), a value other than the default of a feature not
built here is refused naming it, and the defaults kept in `trainer/config/at_default.yaml` are
verl's (so that a verl upgrade that changes one fails here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.verl_defaults import (
    VERL_ENV,
    VERSIONS,
    counts,
    is_interpolation,
    is_mandatory,
    leaves,
    outcomes,
    verl_tree,
)
from trainer.config import ConfigError, _resolve_key, compat_notes, expand_args, load_config
from trainer.config.at_default import AT_DEFAULT, GROUPS, same_value

#: (leaves, interpolations, mandatory) of each file, as issue 43 counted them.
SIZES = {"0.9.1": (829, 107, 2), "b178a3cd": (507, 62, 2)}


#: Refused even at verl's default: verl feeds a dataset's column of that name to the model (its
#: default is no "off"), which this trainer would leave out.
MULTIMODAL = ("data.image_key", "data.video_key", "data.audio_key")


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_key_of_verls_config_at_its_default_is_accepted(version: str) -> None:
    judged = outcomes(version)  # one load_config per leaf: judged once, counted from the same
    refused = {k: o for k, o in judged.items() if o != "accepted"}
    assert sorted(refused) == sorted(k for k in MULTIMODAL if k in dict(leaves(verl_tree(version))))
    assert all(o.startswith("refused: ") and "multimodal data" in o for o in refused.values()), refused
    found = counts(version, judged)
    leaves_n, interpolations, mandatory = SIZES[version]
    assert (found["leaves"], found["interpolations"], found["mandatory"]) == SIZES[version]
    assert found["accepted"] == leaves_n - interpolations - mandatory - len(refused)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_verls_whole_config_loads_as_a_config_name_file(version: str, tmp_path: Path) -> None:
    """The whole generated file, interpolations included, through `--config-path/--config-name`
    (`_target_` keys and `???` values are not keys or values: skipped, as Hydra leaves them),
    once its multimodal column names are removed."""
    shutil.copy(VERSIONS[version], tmp_path / "verl_ppo.yaml")
    with pytest.raises(ConfigError, match="multimodal data"):
        load_config(expand_args(["--config-path", str(tmp_path), "--config-name", "verl_ppo"]), env=VERL_ENV)
    args = expand_args(["--config-path", str(tmp_path), "--config-name", "verl_ppo",
                        "actor_rollout_ref.rollout.name=vllm", *(f"~{k}" for k in MULTIMODAL)])
    cfg = load_config(args, env=VERL_ENV)
    arr = cfg.actor_rollout_ref
    assert (arr.rollout.tensor_model_parallel_size, arr.rollout.name, cfg.trainer.n_gpus_per_node) == (2, "vllm", 8)
    assert arr.actor.fsdp_config.mixed_precision.param_dtype == "bfloat16"  # verl's `fsdp_config.dtype`
    notes = compat_notes(args, cfg)
    assert any("is accepted at verl's default" in n for n in notes)
    assert len(notes) < 100  # one per group, not one per key


def test_the_defaults_kept_here_are_verls() -> None:
    """Each value of the table is a default of its key in one of verl's files, and each file's
    default of a table key is among the table's values (for a key of this trainer's own, those
    of its values it takes as they are need no row)."""
    trees = {v: dict(leaves(verl_tree(v))) for v in VERSIONS}
    for key, group in AT_DEFAULT.items():
        allowed = group.defaults[key]
        in_files = [tree[key] for tree in trees.values() if key in tree and not is_mandatory(tree[key])]
        assert in_files, f"`{key}` ({group.name}) is in no verl config kept: remove it from at_default.yaml"
        for value in allowed:
            assert any(same_value(value, v) and type(value) is type(v) for v in in_files), (key, value, in_files)
        for value in in_files:
            assert any(same_value(value, a) for a in allowed) or _trainer_key(key), (key, value, allowed)


def _trainer_key(key: str) -> bool:
    try:
        _resolve_key(key)
    except ConfigError:
        return False
    return True


def test_every_group_names_its_feature_and_why_nothing_changes() -> None:
    for group in GROUPS.values():
        assert group.feature.strip() and group.note.strip() and group.defaults, group.name


REFUSED = [  # a value other than verl's default: refused, naming the feature (never "unknown key")
    ("actor_rollout_ref.model.mtp.enable=true", "multi-token prediction"),
    ("trainer.esi_redundant_time=10", "Elastic Server Instance"),
    ("ray_kwargs.ray_init.num_cpus=4", "verl's Ray settings"),
    ("algorithm.filter_groups.enable=true", "DAPO group filtering"),
    ("actor_rollout_ref.actor.optim.optimizer=SGD", "optimizers other than torch's AdamW"),
    ("actor_rollout_ref.actor.fsdp_config.use_orig_params=true", "FSDP wrapping"),
    ("actor_rollout_ref.actor.fsdp_config.seed=7", "`trainer.seed`"),
    ("actor_rollout_ref.actor.calculate_entropy=true", "computing the entropy"),
    ("actor_rollout_ref.actor.entropy_checkpointing=true", "memory-saving"),
    ("reward_model.strategy=megatron", "the reward model worker"),
    ("reward.reward_model.enable_resource_pool=true", "a reward model on a resource pool of its own"),
    ("actor_rollout_ref.actor.optim.total_training_steps=100", "derived here; set `trainer.total_training_steps`"),
    ("actor_rollout_ref.rollout.quantization=fp8", "quantized rollout"),
    ("trainer.v1.trainer_mode=separate_async", "asynchronous trainer modes"),
    ("distillation.enabled=true", "distillation"),
]


@pytest.mark.parametrize(("item", "feature"), REFUSED, ids=[r[0].split("=")[0] for r in REFUSED])
def test_another_value_is_refused_naming_the_feature(item: str, feature: str) -> None:
    with pytest.raises(ConfigError, match=feature) as err:
        load_config([item], env=VERL_ENV)
    assert "unknown key" not in str(err.value)


def test_defaults_give_one_note_per_group_and_the_same_config() -> None:
    items = ["actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.method=mtp",
             "trainer.esi_redundant_time=0", "ray_kwargs.ray_init.num_cpus=null",
             "reward_model.strategy=fsdp", "actor_rollout_ref.rollout.name=hf"]
    cfg = load_config(items, env={})
    assert cfg == load_config(["actor_rollout_ref.rollout.name=hf"], env={})
    notes = compat_notes(items, cfg)
    assert len(notes) == 4 and all("the numbers are the same" in n for n in notes), notes
    assert notes[0].startswith("`actor_rollout_ref.model.mtp.enable` (and 1 more of its group)")


def test_a_trainer_key_whose_verl_default_means_unset_keeps_acting() -> None:
    """verl's null `data.seed`, `reward_model.enable`, `custom_reward_function.name` (0.9.1's
    legacy keys) leave this trainer's defaults; any other value acts as usual."""
    base = load_config([], env={})
    cfg = load_config(["data.seed=null", "reward_model.enable=null", "custom_reward_function.name=null"], env={})
    assert (cfg.data.seed, cfg.reward_model.enable, cfg.custom_reward_function.name) == (
        base.data.seed, False, "compute_score")
    assert load_config(["data.seed=7"], env={}).data.seed == 7
    assert load_config(["custom_reward_function.name=my_score"], env={}).custom_reward_function.name == "my_score"


def test_verl_091_reward_and_critic_sections_are_read_as_this_trainers_keys() -> None:
    cfg = load_config(["reward.custom_reward_function.path=/r.py", "reward.custom_reward_function.name=score",
                       "reward.reward_manager.name=batch", "critic.fsdp.param_offload=true",
                       "critic.fsdp.dtype=fp32"], env={})
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("/r.py", "score")
    assert cfg.reward_model.reward_manager == "batch"
    assert cfg.critic.model.fsdp_config.param_offload is True
    assert cfg.critic.model.fsdp_config.mixed_precision.param_dtype == "fp32"


def test_sglang_only_knobs_change_nothing_under_vllm_with_a_note() -> None:
    """verl's multi-turn example sets `rollout.sglang_rollout_mode`; SGLang's engine and server
    settings are read by SGLang only."""
    items = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.sglang_rollout_mode=server",
             "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
             "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters=32",
             "actor_rollout_ref.rollout.server={timeout: 60, max_attempts: 3}"]
    cfg = load_config(items, env={})
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.sglang == {"attention_backend": "triton"}
    notes = compat_notes(items, cfg)
    assert [n.split("`")[1] for n in notes] == [
        "actor_rollout_ref.rollout.sglang_rollout_mode", "actor_rollout_ref.rollout.engine_kwargs.sglang.*",
        "actor_rollout_ref.rollout.engine_kwargs.trtllm.*", "actor_rollout_ref.rollout.server"]
    assert all("changes nothing" in n for n in notes)
    assert not any(is_interpolation(n) for n in notes)


def test_vllm_engine_kwargs_are_accepted_and_those_the_rollout_depends_on_refused() -> None:
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm", "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
                       "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8"], env={})
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {"swap_space": 4, "kv_cache_dtype": "fp8"}
    with pytest.raises(ConfigError, match=r"engine_kwargs.vllm.tensor_parallel_size` is an engine argument this "
                       r"trainer sets itself.*Fix: set `actor_rollout_ref.rollout.tensor_model_parallel_size`"):
        load_config(["actor_rollout_ref.rollout.engine_kwargs.vllm.tensor_parallel_size=2"], env={})
    # a null value is dropped, as verl drops it
    load_config(["actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=null"], env={})
