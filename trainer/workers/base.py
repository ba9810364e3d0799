"""What every worker class shares: identity, its torch.distributed group, optimizer and
scheduler, the optimizer step and sharded (world-size free) checkpoints.

A worker is a plain class: a worker group runs one instance per rank, as a Ray actor
(:mod:`trainer.workers.ray_group`) or in the driver's process (:mod:`trainer.workers.group`,
one rank). One rank forms no process group: the model is a plain module on the configured
device. Several ranks form one group per worker group (gloo on CPU, NCCL/RCCL on GPUs) and shard
the model with FSDP2 on either, so each rank holds 1/W of the parameters, gradients and optimizer
state.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpcrl.devices import DEVICE_VARS, WorkerDevice, id_list, worker_device
from hpcrl.runtimes import running_in
from trainer import model_shards
from trainer import models as M
from trainer import parallel as P
from trainer.algos import core_algos
from trainer.batch import MiniBatchShare, StepBatch, seed_everything
from trainer.checkpoint import full_state as ckpt
from trainer.checkpoint import sharded
from trainer.checkpoint.hf_export import write_hf_config, write_hf_export
from trainer.config import Config, ConfigError
from trainer.phases import Phases

__all__ = ["WORKER_ENV", "Worker", "container_runtime", "node_ip", "require_visible_gpu", "resolve_device",
           "take_ray_device"]

#: Environment every worker process sets before heavy imports (vLLM's engine stays in-process).
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}


def node_ip() -> str:
    """This node's address as Ray knows it (the host name's address outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def ray_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): which pool's node a rank is on,
    where several Ray nodes share a host name."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


def container_runtime() -> str:
    """The container runtime this process runs in (`none` on the host): each runtime of
    `hpcrl.runtimes` says how it recognises its containers."""
    return running_in()


def take_ray_device(environ: dict[str, str] | None = None) -> WorkerDevice | None:
    """In a Ray actor holding a GPU: the device Ray assigned it (`get_accelerator_ids()`), with
    the visible-device variables made to agree and `LOCAL_RANK` set to its index
    (:func:`hpcrl.devices.worker_device`), in `environ` (`os.environ`). Must run before anything
    starts CUDA/HIP in the process. A Ray actor without a GPU gets `LOCAL_RANK=0`; outside a Ray
    actor (the driver, a rank in the driver's process) nothing changes and None is returned."""
    env = os.environ if environ is None else environ
    ray = sys.modules.get("ray")  # a Ray actor has Ray imported; the driver need not
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    ids = context.get_accelerator_ids().get("GPU", [])
    if not ids:
        env["LOCAL_RANK"] = "0"
        return None
    device = worker_device(env, ids, "amd" if torch.version.hip else "nvidia")
    env.update(device.env)
    return device


def require_visible_gpu(gpu: WorkerDevice | None, device: str, environ: dict[str, str] | os._Environ[str],
                        cuda_available: bool) -> None:
    """Refuse to go on when this worker was given a GPU that torch cannot see: Ray granted it
    one (`gpu`), a visible-device variable names one, or `trainer.device=cuda`. The process
    group would otherwise pick gloo and the worker train on the CPU, slowly and silently
    (a container started without its GPU flags, or a CPU build of torch in the image).
    `trainer.device=cpu` asks for the CPU on purpose and is let through."""
    if cuda_available or device == "cpu":
        return
    seen = [f"`{k}={environ[k]}`" for k in DEVICE_VARS if id_list(environ, k)]
    given = ([f"Ray granted GPU `{gpu.ray_id}`"] if gpu is not None else []) + seen + (
        ["`trainer.device=cuda`"] if device == "cuda" else [])
    if not given:
        return
    build = (f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
             if torch.version.hip else "CPU only")
    raise ConfigError(
        f"this worker was given a GPU ({', '.join(given)}) but torch cannot see one (torch "
        f"{torch.__version__}, built for {build}; `torch.cuda.is_available()` is false), so it would "
        "train on the CPU. Fix: start the container with the GPUs passed in (the site profile's "
        "`container` settings: `--gpus`/`--device nvidia.com/gpu=all` or `--nv` on NVIDIA, `devices: "
        "[/dev/kfd, /dev/dri]` with `group_add: [video]` on AMD), use an image whose torch is built "
        "for the node's GPUs, or train on the CPU on purpose with `trainer.device=cpu`")


def resolve_device(name: str) -> torch.device:
    """`trainer.device` of a single rank: `auto` is the GPU when torch sees one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`trainer.device=cuda` but torch sees no GPU; use `trainer.device=cpu`")
    return torch.device(name)


class Worker:
    """One rank of a worker group; subclasses build their models in :meth:`build`."""

    role = "worker"

    def __init__(self, cfg: Config, rank: int, world_size: int, total_steps: int) -> None:
        for key, value in WORKER_ENV.items():
            os.environ.setdefault(key, value)
        self.gpu = take_ray_device()  # first: before anything starts CUDA in this process
        require_visible_gpu(self.gpu, cfg.trainer.device, os.environ, torch.cuda.is_available())
        self.cfg, self.rank, self.world_size, self.total_steps = cfg, rank, world_size, total_steps
        self.ctx: P.DistContext | None = None
        self.model: Any = None
        self.optim: Any = None
        self.sched: Any = None
        self.phases: Phases = Phases(torch.device("cpu"), offload_optimizer=False)

    # ------------------------------------------------------------------ identity and group

    def node_info(self) -> dict[str, Any]:
        gpu = None if self.gpu is None else {
            "ray_id": self.gpu.ray_id, "index": self.gpu.index,
            **{k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "LOCAL_RANK")}}
        return {"role": self.role, "rank": self.rank, "hostname": socket.gethostname(),
                "ip": node_ip(), "pid": os.getpid(), "cuda": torch.cuda.is_available(),
                "container": container_runtime(), "gpu": gpu, "ray_node": ray_node_id()}

    def free_port(self) -> int:
        return P.free_port(node_ip())

    def init_dist(self, master_addr: str | None, master_port: int | None, *,
                  shard_alone: bool = False) -> dict[str, Any]:
        """Join the group (several ranks) or take the configured device (one rank), then build.
        `shard_alone`: one rank forms a group of one and shards with FSDP2 all the same (the
        one-GPU check's path, :func:`trainer.parallel.init_process_group`)."""
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        if self.world_size == 1 and not shard_alone:
            self.ctx = P.single_rank(resolve_device(self.cfg.trainer.device))
        else:
            assert master_addr is not None and master_port is not None, "several ranks need a rendezvous"
            self.ctx = P.init_process_group(self.rank, self.world_size, master_addr, master_port,
                                            timeout_s=self.cfg.actor_rollout_ref.nccl_timeout,
                                            device_index=0 if self.gpu is None else self.gpu.index,
                                            shard_alone=shard_alone)
        seed_everything(self.cfg.trainer.seed)
        self.phases = Phases(self.device, offload_optimizer=bool(self.fsdp_config.optimizer_offload))
        self.build()
        return {"backend": self.ctx.backend, "fsdp": self.ctx.fsdp, "threads": torch.get_num_threads()}

    def build(self) -> None:
        raise NotImplementedError

    @property
    def fsdp_config(self) -> Any:
        """This worker's `fsdp_config` section (`param_offload`, `optimizer_offload`)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        assert self.ctx is not None, "init_dist must run first"
        return self.ctx.device

    def _attention(self, fsdp_config: Any) -> str:
        """The attention implementation for a model placed with `fsdp_config`."""
        dtype = M.compute_dtype(fsdp_config.mixed_precision.param_dtype, self.device)
        return M.attention_implementation(self.device, dtype)

    def _place(self, model: torch.nn.Module, fsdp_config: Any, section: str) -> Any:
        """`model` on this rank's device, sharded with FSDP2 in a group. With `param_offload`
        its parameters then live in host memory between phases (:mod:`trainer.phases`): call
        :meth:`Phases.home` once the model is built. Mixed precision (`mixed_precision.param_dtype`
        below the model's `model_dtype`): FSDP2's policy in a group, `torch.autocast` on one rank;
        either way the model's own parameters stay the master weights."""
        assert self.ctx is not None
        mp = fsdp_config.mixed_precision
        param_dtype = M.compute_dtype(mp.param_dtype, self.device)
        mixed = param_dtype != M.resolve_dtype(fsdp_config.model_dtype)
        empty = any(p.is_meta for p in model.parameters())
        if empty and self.ctx.fsdp:
            # sharded while still on the meta device, then given memory: each rank allocates
            # its shards only, never the whole model (torchtitan's meta-device init; before,
            # `to_empty` on the device put the whole fp32 model on every GPU before sharding)
            placed = P.apply_fsdp2(model, param_dtype=param_dtype if mixed else None,
                                   reduce_dtype=M.resolve_dtype(mp.reduce_dtype))
            placed = M.materialize(placed, self.device)
            self.phases.register(placed, offload_params=bool(fsdp_config.param_offload))
            return placed
        model = M.materialize(model, self.device) if empty else model.to(self.device)
        if self.ctx.fsdp:
            placed = P.apply_fsdp2(model, param_dtype=param_dtype if mixed else None,
                                   reduce_dtype=M.resolve_dtype(mp.reduce_dtype))
        else:
            placed = P.apply_autocast(model, param_dtype) if mixed and param_dtype.itemsize < 4 else model
        self.phases.register(placed, offload_params=bool(fsdp_config.param_offload))
        return placed

    def _load_placed(self, path: str, fsdp_config: Any, section: str, *, frozen: bool = False,
                     gradient_checkpointing: bool = False, trust_remote_code: bool = False,
                     config_updates: Mapping[str, Any] | None = None) -> Any:
        """The actor's (or, `frozen`, the reference's) model placed by :meth:`_place`. From HF
        safetensors it is built empty, placed and sharded, and then each rank reads only its own
        shards from the files (:func:`trainer.model_shards.load_local_shards`): no rank reads the whole
        model into host memory (verl's FSDP workers read it whole on every rank). A GGUF file is
        read whole (its tensors are quantised blocks, not sliceable)."""
        model: Any
        dtype, attention = fsdp_config.model_dtype, self._attention(fsdp_config)
        if not model_shards.safetensors_files(path):
            model = M.load_actor(path, dtype=dtype, attn_implementation=attention,
                                 gradient_checkpointing=gradient_checkpointing,
                                 trust_remote_code=trust_remote_code, config_updates=config_updates)
        else:
            model = model_shards.empty_placed_actor(path, dtype=dtype, attn_implementation=attention,
                                         gradient_checkpointing=gradient_checkpointing,
                                         trust_remote_code=trust_remote_code, config_updates=config_updates)
        if frozen:
            model = model.eval().requires_grad_(False)
        placed = self._place(model, fsdp_config, section)
        if model_shards.safetensors_files(path):
            model_shards.load_local_shards(placed, path)
        return placed

    def _optimizer(self, optim: Any) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optim = torch.optim.AdamW(trainable, lr=optim.lr, betas=tuple(optim.betas),
                                       weight_decay=optim.weight_decay)
        warmup = core_algos.resolve_warmup_steps(optim.lr_warmup_steps, optim.lr_warmup_steps_ratio,
                                                 self.total_steps)
        self.sched = core_algos.build_lr_scheduler(self.optim, warmup, self.total_steps,
                                                   optim.lr_scheduler_type, optim.min_lr_ratio,
                                                   optim.num_cycles)

    # ------------------------------------------------------------------ shared pieces

    def _micro(self, batch: StepBatch, micro: int | None, dynamic: bool, max_len: int) -> list[list[int]]:
        lengths = batch.attention_mask.sum(-1).long().tolist()
        return P.rank_micro_batches(lengths, micro, dynamic, max_len)

    @property
    def global_normalisers(self) -> bool:
        """verl's model engine (`trainer.use_legacy_worker_impl=disable`): losses normalised by
        the whole mini-batch; otherwise verl's default worker: micro-batch means."""
        return str(self.cfg.trainer.use_legacy_worker_impl) == "disable"

    def _loss_scale(self, share: MiniBatchShare, micro_rows: int, mini_size: int, micro_size: int | None,
                    dynamic: bool, loss_scale_factor: float | None = None) -> tuple[dict[str, Any], float]:
        """`(normalisers for agg_loss, factor of the micro-batch loss)` of one micro-batch of
        `micro_rows` rows; `mini_size` counts the mini-batch's rows over all ranks.

        verl's default worker (verl/workers/actor/dp_actor.py `update_policy`, dp_critic.py
        `update_critic`) takes each micro-batch's own mean times `1 / gradient_accumulation`,
        `gradient_accumulation = (mini_size // world) // micro_size`, or with dynamic batch size
        the micro-batch's share `micro_rows / (mini_size // world)` (dp_actor.py:575-578 at verl
        b178a3c); gradients are averaged over ranks. verl's model engine
        (verl/workers/utils/losses.py:103-106 `ppo_loss`) divides by the whole
        mini-batch's tokens or rows times the world size instead, factor 1. Dr.GRPO divides by
        `loss_scale_factor` alone: the padded response length (`data.max_response_length`, the
        width verl pads responses to); verl's default worker passes no `loss_scale_factor`.
        """
        length = float(self.cfg.data.max_response_length)
        if self.global_normalisers:
            return {"dp_size": self.world_size, "batch_num_tokens": share.num_tokens,
                    "global_batch_size": share.num_seqs,
                    "loss_scale_factor": loss_scale_factor or length}, 1.0
        per_rank = max(mini_size // self.world_size, 1)
        if dynamic:
            return {"loss_scale_factor": length}, micro_rows / per_rank
        accumulation = per_rank // micro_size if micro_size else 1
        return {"loss_scale_factor": length}, 1.0 / max(accumulation, 1)

    def _zero_grads(self) -> None:
        """Zero gradients where no backward pass left one (this rank skipped every row of a
        mini-batch), so that the optimizer step matches one over zero-gradient rows."""
        P.reshard(self.model)  # the sharded parameters, not whole ones left by a log-prob pass
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _optimizer_step(self, grad_clip: float) -> float:
        """Clip and step (inside the update's phase: parameters, gradients and, with
        `optimizer_offload`, the moments are on the compute device, so the norm's all-reduce runs
        on device tensors)."""
        assert self.ctx is not None
        self.phases.require_resident(self.model, "the optimizer step (`clip_grad_norm_`)")
        if not self.ctx.fsdp:
            P.all_reduce_gradients(self.model, self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return float(grad_norm)

    def memory_metrics(self) -> dict[str, float]:
        """The peak device memory of each phase since the last call (:meth:`Phases.metrics`)."""
        return self.phases.metrics()

    def lr(self) -> float:
        return float(self.sched.get_last_lr()[0])

    def device_name(self) -> str:
        """This rank's device as verl's FLOPs table names it: the GPU's name, or `CPU`."""
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_name(self.device))
        return "CPU"

    # ------------------------------------------------------------------ checkpoints

    def save(self, tmp: str, prefix: str, hf_tokenizer_path: str | None = None, hf_weights: bool = True) -> float:
        """Write this rank's shards of the model and optimizer into `tmp/<prefix>/` (a collective,
        :mod:`~trainer.checkpoint.sharded`); rank 0 adds the scheduler (`<prefix>_sched.pt`) and,
        for the actor (`hf_tokenizer_path` given), `huggingface/` (:mod:`~trainer.checkpoint.hf_export`):
        with `hf_weights` every rank takes part in the streamed export of the weights, else rank 0
        writes the config and tokenizer alone. Returns seconds."""
        start = time.perf_counter()
        with self.phases.on_device("checkpoint", self.model, self.optim):  # DCP and the export gather
            sharded.save_group_state(Path(tmp) / prefix, self.model, self.optim)
            if self.rank == 0:
                ckpt.write_states(tmp, {f"{prefix}_sched": self.sched.state_dict()})
            if hf_tokenizer_path is not None:
                tokenizer = M.load_tokenizer(hf_tokenizer_path) if self.rank == 0 else None
                if hf_weights:
                    write_hf_export(Path(tmp) / ckpt.HF_DIR, self.model, self.rank, tokenizer=tokenizer)
                elif self.rank == 0:
                    write_hf_config(Path(tmp) / ckpt.HF_DIR, self.model, tokenizer)
        return time.perf_counter() - start

    def load(self, path: str, prefix: str) -> float:
        """Load `<prefix>/` (the shards that overlap this rank's) and `<prefix>_sched.pt` of a
        checkpoint written with any world size. Returns seconds."""
        start = time.perf_counter()
        with self.phases.on_device("checkpoint", self.model, self.optim):
            sharded.load_group_state(path, prefix, self.model, self.optim)
        self.sched.load_state_dict(ckpt.load_state(path, f"{prefix}_sched"))
        return time.perf_counter() - start

    def state_for_test(self) -> dict[str, torch.Tensor]:
        """The full model weights on every rank, on the CPU (a collective under FSDP)."""
        with self.phases.on_device("checkpoint", self.model):
            return {k: v.cpu() for k, v in P.full_model_state(self.model, every_rank=True).items()}

    def ping(self) -> int:
        return self.rank
