"""`data.*`: the training and validation prompts (verl's `data` section). Defaults:
`trainer/config/data.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.base import h, require


@dataclass(frozen=True)
class CustomClsConfig:
    path: str | None = h(
        "Python file (or `pkg://module`) defining a dataset class that replaces the parquet reader, as "
        "verl's `load_extern_object` loads it; its items are read as verl's (`trainer/data_classes.py`)")
    name: str | None = h("the dataset class's name in `data.custom_cls.path`")


@dataclass(frozen=True)
class SamplerConfig:
    class_path: str | None = h(
        "Python file (or `pkg://module`) defining a sampler class that orders the training prompts "
        "(verl's `AbstractSampler`; one with `update(batch)` is called after every step, as verl's "
        "curriculum samplers); needs `data.dataloader_num_workers=0`, as in verl")
    class_name: str | None = h("the sampler class's name in `data.sampler.class_path`")


@dataclass(frozen=True)
class DataConfig:
    tokenizer: str | None = h("tokenizer path; null uses the actor model's tokenizer")
    train_files: list[str] = h("training parquet file(s) in verl's format")
    val_files: list[str] = h("validation parquet file(s) in verl's format")
    prompt_key: str = h("column holding the prompt as a chat list")
    reward_fn_key: str = h("column that selects the reward function (e.g. `data_source`)")
    max_prompt_length: int = h("longest prompt in tokens after the chat template")
    max_response_length: int = h("longest generated response in tokens")
    train_batch_size: int = h("prompts per training step")
    gen_batch_size: int | None = h(
        "prompts the dataloader hands the rollout at once; null = `train_batch_size` (verl's "
        "`ray_trainer.py`); 1 with a rollout pool: verl's fully-async rollouter streams prompt by prompt")
    val_batch_size: int | None = h("prompts per validation batch; null = whole set at once")
    shuffle: bool = h("shuffle the training prompts every epoch")
    seed: int = h("seed of the training-data shuffle")
    filter_overlong_prompts: bool = h("drop prompts longer than `max_prompt_length`")
    return_raw_chat: bool = h("keep the prompt's chat messages (compatibility only, see COMPAT)")
    truncation: Literal["error", "left", "right", "middle"] = h(
        "what to do with a prompt longer than `max_prompt_length` that was not filtered"
    )
    trust_remote_code: bool = h(
        "allow code shipped with the tokenizer (verl loads the trainer's tokenizer with it); the "
        "tokenizer loads with remote code when this or `actor_rollout_ref.model.trust_remote_code` is set")
    use_shm: bool = h("verl: copy the data files to shared memory first (compatibility only, see COMPAT)")
    dataloader_num_workers: int = h("verl: the data loader's worker processes (compatibility only, see COMPAT)")
    filter_overlong_prompts_workers: int = h(
        "verl: processes filtering over-long prompts (compatibility only, see COMPAT)")
    apply_chat_template_kwargs: dict[str, Any] = h(
        "extra keyword arguments of the tokenizer's `apply_chat_template` when the prompts are "
        "rendered, as verl passes them (e.g. `data.apply_chat_template_kwargs.enable_thinking=false`); "
        "they change the prompt text")
    tool_config_path: str | None = h(
        "verl's tool config YAML whose tool schemas every prompt is rendered with (`tools=` of the "
        "chat template), as verl's dataset and single-turn agent loop render them; null = none")
    custom_cls: CustomClsConfig = h("a dataset class of your own (verl's `data.custom_cls`)")
    sampler: SamplerConfig = h("a sampler class of your own (verl's `data.sampler`)")


def check_data_classes(data: DataConfig) -> None:
    """`data.custom_cls` and `data.sampler` name both the file and the class, or neither; a sampler
    needs `data.dataloader_num_workers=0` (verl's `create_rl_sampler` asserts it). Raises ConfigError."""
    for section, path_key, name_key in (("custom_cls", "path", "name"), ("sampler", "class_path", "class_name")):
        values = getattr(data, section)
        path, name = getattr(values, path_key), getattr(values, name_key)
        given, missing = (f"data.{section}.{path_key}", f"data.{section}.{name_key}")
        if path is None and name is not None:
            given, missing = missing, given
        require((path is None) == (name is None),
                f"`{given}={path or name}` without `{missing}`: verl loads the class named by both "
                f"(`load_extern_object(path, name)`). Fix: set `{missing}` too, or remove `{given}`")
    require(data.sampler.class_path is None or data.dataloader_num_workers == 0,
            f"`data.sampler.class_path={data.sampler.class_path}` with `data.dataloader_num_workers="
            f"{data.dataloader_num_workers}`: verl's `create_rl_sampler` asserts 0 for a sampler of your own ('If "
            "using curriculum, num_workers must be 0 to prevent data caching': worker processes would draw "
            "ahead of the sampler's updates). Fix: `data.dataloader_num_workers=0`")


#: verl's `data.*` keys this trainer does not implement (the reason, when there is more to say).
NOT_SUPPORTED: dict[str, str] = {
    "data.return_raw_input_ids": "",
    "data.return_full_prompt": "",
    # refused even at verl's defaults (`images`, `videos`, `audios`): verl feeds a dataset's column of
    # that name to the model, which this trainer would not (it reads the prompt's text only)
    **{f"data.{kind}_key": (f"multimodal data: verl's default `{kind}s` feeds a dataset's `{kind}s` column "
                            "to the model, which this trainer would leave out")
       for kind in ("image", "video", "audio")},
    "data.datagen": "",
}

#: verl keys accepted only with their verl default value (which is what this trainer does).
ACCEPTED_ONLY_AS: dict[str, Any] = {}

#: `data.*` keys accepted that change nothing here, and why nothing is lost.
COMPAT: dict[str, str] = {
    "data.return_raw_chat": ("every prompt's chat messages are kept with its batch anyway "
                             "(`Example.prompt`)"),
    "data.use_shm": "the data files are read from their path; verl's copy to shared memory only speeds the read",
    "data.dataloader_num_workers": ("verl's data-loader worker processes only read ahead (its sampler, in the "
                                    "main process, fixes the order); the batches are the same"),
    "data.filter_overlong_prompts_workers": ("verl's processes for filtering over-long prompts only filter "
                                             "faster; the same prompts are kept"),
}
