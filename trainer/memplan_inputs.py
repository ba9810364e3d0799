"""What a memory plan (:mod:`trainer.memplan`) is made of: the model's shape, read from its
`config.json` alone (no weights), and the run's settings that size each phase, resolved from
the configuration as the trainer resolves them on a GPU."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config.async_training import has_rollout_pool
from trainer.config.rollout import server_mode
from trainer.rollout.vllm import SLEEP_LEVEL

GIB = 2**30


class PlanError(ValueError):
    """The plan cannot be made (unreadable `config.json`, unknown architecture)."""


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelShape:
    config: dict[str, Any]  # the config.json as read

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def _get(self, key: str) -> int:
        return int(self.config[key])

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self._get("hidden_size") // self._get("num_attention_heads"))

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self._get("num_attention_heads"))

    def params(self) -> int:
        """Parameters of the causal LM (attention with biases as Qwen2 has; an estimate within
        a fraction of a percent for Llama/Qwen-style decoders)."""
        h, i, v = self._get("hidden_size"), self._get("intermediate_size"), self._get("vocab_size")
        q, kv = self._get("num_attention_heads") * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.config.get("model_type") == "qwen2" else 0
        layer = h * q + 2 * h * kv + q * h + bias + 3 * h * i + 2 * h
        embed = v * h * (1 if self.config.get("tie_word_embeddings") else 2)
        return self.layers * layer + embed + h

    def tensors(self, fused: bool = False) -> list[int]:
        """Elements of each weight tensor, as the HF model holds them or (`fused`) as vLLM fuses
        them (`qkv_proj`, `gate_up_proj`); sums to :meth:`params`."""
        h, i, v = self._get("hidden_size"), self._get("intermediate_size"), self._get("vocab_size")
        q, kv = self._get("num_attention_heads") * self.head_dim, self.kv_heads * self.head_dim
        bias = self.config.get("model_type") == "qwen2"
        if fused:
            layer = [(q + 2 * kv) * h, *([q + 2 * kv] if bias else []), q * h, 2 * i * h, i * h, h, h]
        else:
            layer = [q * h, kv * h, kv * h, *([q, kv, kv] if bias else []), q * h, i * h, i * h, i * h, h, h]
        embed = [v * h] * (1 if self.config.get("tie_word_embeddings") else 2)
        return layer * self.layers + embed + [h]

    def largest_param(self) -> int:
        return self._get("vocab_size") * self._get("hidden_size")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def with_layers(self, n: int) -> dict[str, Any]:
        cfg = {k: v for k, v in self.config.items()
               if k not in ("layer_types", "architectures", "transformers_version", "torch_dtype", "dtype")}
        cfg["num_hidden_layers"] = n
        cfg["use_cache"] = False
        return cfg


def read_model(path: str, key: str = "actor_rollout_ref.model.path") -> ModelShape:
    """The model's `config.json` (a directory holding one, or the file itself; `key` sets it)."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if file.name != "config.json" or not file.is_file():
        raise PlanError(f"no `config.json` at `{path}`: the memory plan reads the model's config. Fix: "
                        f"point `{key}` at a local model directory (only its "
                        "`config.json` is read), or skip the plan (`--force`)")
    config = json.loads(file.read_text())
    missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                           "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise PlanError(f"`{file}` lacks {', '.join(f'`{k}`' for k in missing)}: the memory plan "
                        "knows decoder-only transformers (Llama, Qwen, Mistral style)")
    return ModelShape(config)


# ----------------------------------------------------------------------------- the settings


@dataclass(frozen=True)
class TrainSide:
    """One model's training micro-batch and sharding (actor or critic)."""

    rows: int
    seq_len: int
    param_offload: bool
    optimizer_offload: bool
    grad_ckpt: bool
    remove_padding: bool = False  # packed micro-batches (`use_remove_padding`), traced as such


@dataclass(frozen=True)
class Settings:
    world: int
    device_bytes: int
    response_len: int
    actor: TrainSide
    critic: TrainSide | None
    ref_resident: bool  # a reference model's shards stay on the device
    rollout_name: str
    tp: int
    gpu_memory_utilization: float
    free_cache_engine: bool
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    bucket_bytes: int
    entropy_grad: bool = False  # the entropy bonus is in the loss (`entropy_coeff` != 0)
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    rollout_dtype: str = "fp32"
    gpus_per_node: int = 1
    node_bytes: int = 0  # the job's host memory per node (`slurm.mem`); 0: not checked
    sleep_level: int = SLEEP_LEVEL  # vLLM's sleep between rollouts (level 1 backs weights up on the host)
    ref_offloaded: bool = False  # a reference model's shards live in host memory between phases
    server_mode: bool = False  # `rollout.mode=async`: vLLM's workers are processes of their own
    enforce_eager: bool = False  # vLLM without CUDA graphs
    reward_model_bytes: int = 0  # a discriminative reward model's weights (a copy per actor rank; asleep on the host)
    reward_model_forward_bytes: int = 0  # the activations of one of its forwards (a micro-batch, no gradients)
    pool: bool = False  # the rollout on a pool of its own (`hybrid_engine=false`): its devices hold the engine alone
    sync_buffers: int = 0  # the pools' weight broadcast: buckets held beside the gathered one (2 pipelined)


_SHORT = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16",
          "fp16": "fp16"}


def plan_dtype(name: str | None, default: str = "bf16") -> str:
    """A dtype setting as the trainer resolves it on a GPU (null: `default`), in the plan's names."""
    return default if name is None else _SHORT[str(name)]


def _rows(dynamic: bool, max_tokens: int, micro: int | None, seq: int, mini_rows: int) -> int:
    """Rows of the largest micro-batch: the token budget over the padded length with
    `use_dynamic_bsz` (verl's budget of prompt + response tokens), else the micro-batch size
    (null = the whole mini-batch share of this rank)."""
    if dynamic:
        return max(1, max_tokens // seq)
    return max(1, micro or mini_rows)


def settings_from_config(cfg: Any, device_gib: float, host_gib: float = 0.0) -> Settings:
    """The plan's inputs as the trainer resolves them from its configuration."""
    arr, d, c = cfg.actor_rollout_ref, cfg.data, cfg.critic
    a, r, ce = arr.actor, arr.rollout, cfg.async_training.checkpoint_engine
    world = cfg.derived.world_size
    seq = d.max_prompt_length + d.max_response_length
    mini_rows = max(1, a.ppo_mini_batch_size * r.n // world)
    actor = TrainSide(_rows(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu, seq,
                            mini_rows), seq, a.fsdp_config.param_offload, a.fsdp_config.optimizer_offload,
                      arr.model.enable_gradient_checkpointing, arr.model.use_remove_padding)
    critic = None
    if cfg.derived.use_critic:
        dyn = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
        critic = TrainSide(_rows(dyn, c.ppo_max_token_len_per_gpu, c.ppo_micro_batch_size_per_gpu, seq, mini_rows),
                           seq, c.model.fsdp_config.param_offload, c.model.fsdp_config.optimizer_offload,
                           c.model.enable_gradient_checkpointing, c.model.use_remove_padding)
    return Settings(
        world=world, device_bytes=int(device_gib * GIB), response_len=d.max_response_length, actor=actor,
        critic=critic, ref_resident=cfg.derived.use_reference and not arr.model.uses_lora
        and not arr.ref.fsdp_config.param_offload,
        rollout_name=str(r.name or "vllm"), tp=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization, free_cache_engine=r.free_cache_engine,
        max_model_len=r.max_model_len or seq, max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        bucket_bytes=r.update_weights_bucket_megabytes * 2**20, entropy_grad=a.entropy_coeff != 0,
        param_dtype=plan_dtype(a.fsdp_config.mixed_precision.param_dtype),
        reduce_dtype=plan_dtype(a.fsdp_config.mixed_precision.reduce_dtype, "fp32"),
        rollout_dtype=plan_dtype(r.dtype), gpus_per_node=max(1, world // max(1, cfg.trainer.nnodes)),
        node_bytes=int(host_gib * GIB), ref_offloaded=cfg.derived.use_reference and not arr.model.uses_lora
        and arr.ref.fsdp_config.param_offload, server_mode=server_mode(cfg), enforce_eager=r.enforce_eager,
        pool=has_rollout_pool(cfg), sync_buffers=(1 + ce.overlap_broadcast_and_consume) * ce.enable)
