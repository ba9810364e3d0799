"""The data-parallel workers: plain classes that Ray runs as actors, one per rank.

:class:`ActorRolloutRefWorker` holds the actor (trained), the reference policy (frozen, when a
KL term needs it) and the rollout engine in one process, so the rollout gets the actor's weights
in memory; :class:`CriticWorker` holds the value model. Each worker group forms its own
torch.distributed group (:mod:`trainer.parallel`).

The driver sends tensors only (`StepBatch` with empty `examples`/`uids`). For updates it sends,
per epoch, this rank's rows of every mini-batch, cut from the same mini-batches the
single-process trainer would form; each mini-batch is one optimizer step after a gradient
average, and every loss is normalised by counts summed over the ranks, so the update does not
depend on the number of ranks.

The classes do not import Ray: a test can run them in plain processes.
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer import models as M
from trainer import parallel as P
from trainer.algos import core_algos
from trainer.config import Config
from trainer.ppo import StepBatch, need, seed_everything
from trainer.rollout import RolloutBatch, SamplingParams

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "node_ip"]

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


def container_runtime() -> str:
    """`podman`, `apptainer` or `none`: the container this process runs in."""
    if os.path.exists("/run/.containerenv"):
        return "podman"
    return "apptainer" if os.environ.get("APPTAINER_CONTAINER") else "none"


def _mean(collected: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: v for k, v in collected.items() if v}


class _Worker:
    """What both groups share: identity, process group, optimizer, scheduler, update step."""

    role = "worker"

    def __init__(self, cfg: Config, rank: int, world_size: int, total_steps: int) -> None:
        for key, value in WORKER_ENV.items():
            os.environ.setdefault(key, value)
        self.cfg, self.rank, self.world_size, self.total_steps = cfg, rank, world_size, total_steps
        self.ctx: P.DistContext | None = None
        self.model: Any = None
        self.optim: Any = None
        self.sched: Any = None

    # ------------------------------------------------------------------ identity and group

    def node_info(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "hostname": socket.gethostname(),
                "ip": node_ip(), "pid": os.getpid(), "cuda": torch.cuda.is_available(),
                "container": container_runtime()}

    def free_port(self) -> int:
        return P.free_port(node_ip())

    def init_dist(self, master_addr: str, master_port: int) -> dict[str, Any]:
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        self.ctx = P.init_process_group(self.rank, self.world_size, master_addr, master_port)
        seed_everything(self.cfg.trainer.seed)
        self.build()
        return {"backend": self.ctx.backend, "fsdp": self.ctx.fsdp, "threads": torch.get_num_threads()}

    def build(self) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        assert self.ctx is not None, "init_dist must run first"
        return self.ctx.device

    def _place(self, model: torch.nn.Module) -> Any:
        model = model.to(self.device)
        return P.apply_fsdp2(model) if self.ctx is not None and self.ctx.fsdp else model

    def _optimizer(self, optim: Any) -> None:
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                       weight_decay=optim.weight_decay)
        warmup = core_algos.resolve_warmup_steps(optim.lr_warmup_steps, optim.lr_warmup_steps_ratio,
                                                 self.total_steps)
        self.sched = core_algos.build_lr_scheduler(self.optim, warmup, self.total_steps,
                                                   optim.warmup_style, optim.min_lr_ratio)

    # ------------------------------------------------------------------ shared pieces

    def _to_device(self, batch: StepBatch) -> StepBatch:
        from dataclasses import fields, replace

        moved = {f.name: getattr(batch, f.name).to(self.device) for f in fields(batch)
                 if isinstance(getattr(batch, f.name), torch.Tensor)}
        return replace(batch, **moved)

    def _micro(self, batch: StepBatch, micro: int | None, dynamic: bool, max_len: int) -> list[list[int]]:
        lengths = batch.attention_mask.sum(-1).long().tolist()
        return P.rank_micro_batches(lengths, micro, dynamic, max_len)

    def _agg_kwargs(self, mini: StepBatch) -> dict[str, Any]:
        tokens, seqs = P.global_normalizers(mini.response_mask)
        return {"global_num_tokens": tokens, "global_num_seqs": seqs, "dp_size": self.world_size,
                "norm_length": float(self.cfg.data.max_response_length)}

    def _optimizer_step(self, grad_clip: float) -> float:
        assert self.ctx is not None
        if not self.ctx.fsdp:
            P.all_reduce_gradients(self.model, self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return float(grad_norm)

    def lr(self) -> float:
        return float(self.sched.get_last_lr()[0])

    # ------------------------------------------------------------------ checkpoints

    def save(self, tmp: str, prefix: str, hf_tokenizer_path: str | None = None) -> float:
        """Gather the full model and optimizer (a collective) and let rank 0 write
        `<prefix>.pt`, `<prefix>_optim.pt`, `<prefix>_sched.pt` into `tmp`. Returns seconds."""
        start = time.perf_counter()
        model_state = P.full_model_state(self.model)
        optim_state = P.full_optim_state(self.model, self.optim)
        if self.rank == 0:
            states = {prefix: model_state, f"{prefix}_optim": optim_state,
                      f"{prefix}_sched": self.sched.state_dict()}
            if hf_tokenizer_path is None:  # no HF export (the critic)
                ckpt.write_states(tmp, states)
            else:
                ckpt.write_states(tmp, states, hf_model=self.model, hf_state_dict=model_state,
                                  hf_tokenizer=M.load_tokenizer(hf_tokenizer_path))
        return time.perf_counter() - start

    def load(self, path: str, prefix: str) -> float:
        """Load `<prefix>*.pt` of a checkpoint written with any world size. Returns seconds."""
        start = time.perf_counter()
        P.load_full_model_state(self.model, ckpt.load_state(path, prefix))
        P.load_full_optim_state(self.model, self.optim, ckpt.load_state(path, f"{prefix}_optim"))
        self.sched.load_state_dict(ckpt.load_state(path, f"{prefix}_sched"))
        return time.perf_counter() - start

    def ping(self) -> int:
        return self.rank


class ActorRolloutRefWorker(_Worker):
    """Actor + reference + rollout of one rank."""

    role = "actor_rollout_ref"

    def build(self) -> None:
        arr = self.cfg.actor_rollout_ref
        self.tokenizer = M.load_tokenizer(self.cfg.data.tokenizer or arr.model.path)
        self.model = self._place(M.load_actor(
            arr.model.path, gradient_checkpointing=arr.model.enable_gradient_checkpointing))
        self.model.train()
        self.ref: Any = None
        if self.cfg.derived.use_reference:
            self.ref = self._place(M.load_actor(arr.model.path).eval().requires_grad_(False))
        self._optimizer(arr.actor.optim)
        self.rollout, self.shares_weights = self._build_rollout()

    def _build_rollout(self) -> tuple[Any, bool]:
        """The engine, and whether it generates with the training model itself (no sync)."""
        from trainer.rollout import HFRolloutEngine

        arr = self.cfg.actor_rollout_ref
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        if arr.rollout.name == "vllm":
            from trainer.vllm_rollout import VLLMRolloutEngine

            return VLLMRolloutEngine.from_config(self.cfg, self.tokenizer, seed=self.cfg.trainer.seed + self.rank), False
        assert self.ctx is not None
        if not self.ctx.fsdp:
            return HFRolloutEngine(self.model, pad, eos), True
        # A sharded model cannot generate rank by rank (its forwards are collectives): keep a
        # full copy for generation and sync it from the gathered weights.
        copy: Any = M.load_actor(arr.model.path)
        copy = copy.to(self.device).eval()
        return HFRolloutEngine(copy, pad, eos, offload=True), False

    # ------------------------------------------------------------------ rollout

    def sync_rollout_weights(self) -> float:
        """Copy the actor's current weights into the rollout engine (a collective under FSDP)."""
        start = time.perf_counter()
        if not self.shares_weights:
            self.rollout.sync_weights(P.full_model_state(self.model, every_rank=True))
        return time.perf_counter() - start

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Sync weights, then sample `params.n` responses per prompt row (rows may be none)."""
        sync_s = self.sync_rollout_weights()
        if prompt_ids.shape[0] == 0:
            return None, {"weight_sync": sync_s, "gen": 0.0, "gen_tokens": 0.0}
        start = time.perf_counter()
        torch.manual_seed(seed)
        self.rollout.wake_up()
        try:
            out = self.rollout.generate(prompt_ids.to(self.device), prompt_mask.to(self.device), params)
        finally:
            self.rollout.sleep()
        out = RolloutBatch(*(t.cpu() for t in (out.prompt_ids, out.prompt_mask, out.response_ids,
                                              out.response_mask, out.log_probs, out.prompt_index)))
        return out, {"weight_sync": sync_s, "gen": time.perf_counter() - start,
                     "gen_tokens": float(out.response_mask.sum())}

    # ------------------------------------------------------------------ log-probs

    @torch.no_grad()
    def _log_probs(self, model: Any, batch: StepBatch, section: Any, entropy: bool) -> dict[str, Any]:
        start = time.perf_counter()
        batch = self._to_device(batch)
        rows = self._micro(batch, section.log_prob_micro_batch_size_per_gpu,
                           bool(section.log_prob_use_dynamic_bsz), int(section.log_prob_max_token_len_per_gpu or 0))
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        lp = torch.zeros_like(batch.response_mask)
        ent = torch.zeros_like(batch.response_mask) if entropy else None
        was_training = model.training
        model.eval()
        for part in rows:
            mb = batch.select(part)
            out, e = M.compute_log_probs(model, mb.input_ids, mb.attention_mask, batch.response_length,
                                         temperature=temperature, calculate_entropy=entropy)
            lp[part] = out
            if ent is not None and e is not None:
                ent[part] = e
        model.train(was_training)
        return {"log_probs": lp.cpu(), "entropy": None if ent is None else ent.cpu(),
                "seconds": time.perf_counter() - start}

    def compute_log_probs(self, batch: StepBatch) -> dict[str, Any]:
        return self._log_probs(self.model, batch, self.cfg.actor_rollout_ref.rollout, True)

    def compute_ref_log_probs(self, batch: StepBatch) -> dict[str, Any]:
        return self._log_probs(self.ref, batch, self.cfg.actor_rollout_ref.ref, False)

    # ------------------------------------------------------------------ update

    def _micro_loss(self, mb: StepBatch, agg: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg.actor_rollout_ref.actor
        log_prob, entropy = M.compute_log_probs(
            self.model, mb.input_ids, mb.attention_mask, mb.response_length,
            temperature=self.cfg.actor_rollout_ref.rollout.temperature, calculate_entropy=a.entropy_coeff != 0)
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
            need(mb.old_log_probs, "old_log_probs"), log_prob, need(mb.advantages, "advantages"),
            mb.response_mask, float(a.clip_ratio_low or a.clip_ratio), float(a.clip_ratio_high or a.clip_ratio),
            a.clip_ratio_c, a.loss_agg_mode, **agg)
        loss, info = pg_loss, {"actor/pg_loss": pg_loss.item(), "actor/pg_clipfrac": clipfrac.item(),
                               "actor/ppo_kl": ppo_kl.item(), "actor/pg_clipfrac_lower": clipfrac_lower.item()}
        if a.entropy_coeff != 0 and entropy is not None:
            loss = loss - a.entropy_coeff * core_algos.agg_loss(entropy, mb.response_mask, a.loss_agg_mode, **agg)
        if a.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, need(mb.ref_log_probs, "ref_log_probs"), a.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, mb.response_mask, a.loss_agg_mode, **agg)
            loss = loss + a.kl_loss_coef * kl_loss
            info["actor/kl_loss"] = kl_loss.item()
            info["actor/kl_coef"] = a.kl_loss_coef
        return loss, info

    def update_actor(self, epochs: list[list[StepBatch]]) -> dict[str, Any]:
        """One optimizer step per mini-batch; `epochs[e][m]` is this rank's part of mini-batch m."""
        a = self.cfg.actor_rollout_ref.actor
        start, tokens = time.perf_counter(), 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for minis in epochs:
            for mini in minis:
                mini = self._to_device(mini)
                tokens += float(mini.attention_mask.sum())
                agg, sums = self._agg_kwargs(mini), defaultdict[str, float](float)
                for rows in self._micro(mini, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                        a.ppo_max_token_len_per_gpu):
                    loss, info = self._micro_loss(mini.select(rows), agg)
                    loss.backward()
                    sums["actor/pg_loss"] += info.pop("actor/pg_loss")
                    sums["actor/kl_loss"] += info.pop("actor/kl_loss", 0.0)
                    for key, value in info.items():
                        collected[key].append(value)
                collected["actor/pg_loss"].append(sums["actor/pg_loss"])
                if a.use_kl_loss:
                    collected["actor/kl_loss"].append(sums["actor/kl_loss"])
                collected["actor/grad_norm"].append(self._optimizer_step(a.grad_clip))
        self.sched.step()
        collected["actor/lr"].append(self.lr())
        return {"metrics": _mean(collected), "seconds": time.perf_counter() - start, "tokens": tokens}

    def save_checkpoint(self, tmp: str) -> float:
        arr = self.cfg.actor_rollout_ref
        return self.save(tmp, "actor", self.cfg.data.tokenizer or arr.model.path)

    def load_checkpoint(self, path: str) -> float:
        return self.load(path, "actor")

    def state_for_test(self) -> dict[str, torch.Tensor]:
        """The full actor weights on every rank (a collective under FSDP)."""
        return {k: v.cpu() for k, v in P.full_model_state(self.model, every_rank=True).items()}


class CriticWorker(_Worker):
    """The value model of one rank."""

    role = "critic"

    def build(self) -> None:
        c = self.cfg.critic
        assert c.model.path is not None
        self.model = self._place(M.load_critic(c.model.path, gradient_checkpointing=c.model.enable_gradient_checkpointing))
        self.model.train()
        self._optimizer(c.optim)

    @torch.no_grad()
    def compute_values(self, batch: StepBatch) -> dict[str, Any]:
        start = time.perf_counter()
        c = self.cfg.critic
        batch = self._to_device(batch)
        values = torch.zeros_like(batch.response_mask)
        self.model.eval()
        for part in self._micro(batch, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                int(c.forward_max_token_len_per_gpu or 0)):
            mb = batch.select(part)
            values[part] = M.compute_values(self.model, mb.input_ids, mb.attention_mask, batch.response_length)
        self.model.train()
        return {"values": (values * batch.response_mask).cpu(), "seconds": time.perf_counter() - start}

    def update_critic(self, epochs: list[list[StepBatch]]) -> dict[str, Any]:
        c = self.cfg.critic
        start, tokens = time.perf_counter(), 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for minis in epochs:
            for mini in minis:
                mini = self._to_device(mini)
                tokens += float(mini.attention_mask.sum())
                agg, vf_loss = self._agg_kwargs(mini), 0.0
                for rows in self._micro(mini, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                        c.ppo_max_token_len_per_gpu):
                    mb = mini.select(rows)
                    vpreds = M.compute_values(self.model, mb.input_ids, mb.attention_mask, mini.response_length)
                    loss, clipfrac = core_algos.compute_value_loss(
                        vpreds, need(mb.returns, "returns"), need(mb.values, "values"), mb.response_mask,
                        c.cliprange_value, str(c.loss_agg_mode), **agg)
                    loss.backward()
                    vf_loss += loss.item()
                    collected["critic/vf_clipfrac"].append(clipfrac.item())
                collected["critic/vf_loss"].append(vf_loss)
                collected["critic/grad_norm"].append(self._optimizer_step(c.grad_clip))
        self.sched.step()
        collected["critic/lr"].append(self.lr())
        return {"metrics": _mean(collected), "seconds": time.perf_counter() - start, "tokens": tokens}

    def save_checkpoint(self, tmp: str) -> float:
        return self.save(tmp, "critic")

    def load_checkpoint(self, path: str) -> float:
        return self.load(path, "critic")

