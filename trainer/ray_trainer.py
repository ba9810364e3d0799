"""The distributed PPO trainer: a driver on the Ray head, data-parallel worker groups on the nodes.

The driver keeps the loop, the data, the rewards, the advantages and the algorithm state (it is
the single-process :class:`PPOTrainer` with its model phases sent to workers): rollout ->
reward -> old/ref log-probs, values -> advantages -> critic update -> actor update -> metrics ->
checkpoint. Worker groups (:mod:`trainer.workers`) are placed one bundle per node; the
actor+reference+rollout group and the critic group each form their own torch.distributed group.

Data flow per step: the prompts are left-padded together and split into contiguous parts, one per
rank, which each rank answers with its rollout engine (weights synced first); log-probs and values
are computed on contiguous row shards; for the updates the driver forms the same shuffled
mini-batches as the single-process trainer and gives every rank its share of each.

Per-rank metrics (`dp/rank_<r>/...`: rows and tokens generated, seconds per phase) show every
node working; `<run_dir>/workers.json` maps ranks to nodes. A failing worker ends the run with
:class:`~trainer.worker_group.WorkerFailure` naming its node and rank.

Checkpoints hold the gathered full states (`actor.pt`, `actor_optim.pt` keyed by parameter name,
...), written by rank 0 of each group into the checkpoint's temporary directory; they resume on
any number of ranks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import checkpoint as ckpt
from trainer import models as M
from trainer.algos import core_algos
from trainer.config import Config, ConfigError
from trainer.data import Example
from trainer.deadline import Deadline
from trainer.parallel import balanced_split, split_rows
from trainer.ppo import PPOTrainer, StepBatch, step_seed
from trainer.rewards import load_reward_fn
from trainer.rollout import RolloutBatch
from trainer.stop import StopRequest

__all__ = ["RayPPOTrainer", "use_ray"]


def use_ray(cfg: Config) -> bool:
    """`trainer.distributed`, or when null: Ray as soon as there is more than one worker."""
    chosen = cfg.trainer.distributed
    return bool(chosen) if chosen is not None else cfg.derived.world_size > 1


def _tensors_only(batch: StepBatch) -> StepBatch:
    from dataclasses import replace

    return replace(batch, examples=[], uids=[])


class RayPPOTrainer(PPOTrainer):
    """:class:`PPOTrainer` whose model phases run on Ray worker groups."""

    def __init__(self, cfg: Config, stop: StopRequest | None = None) -> None:
        from trainer.worker_group import WorkerGroup, connect, make_placement_group
        from trainer.workers import ActorRolloutRefWorker, CriticWorker

        self.cfg = cfg
        t = cfg.trainer
        self.device = torch.device("cpu")
        self.ckpt_root = Path(t.default_local_dir or ".")
        self.run_dir = Path(t.run_dir) if t.run_dir else self.ckpt_root
        self.reward_fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        self.tokenizer = M.load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path)
        self._build_data()
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.stop = stop or StopRequest()
        self.stop.watch(self.run_dir)
        self.deadline = Deadline.from_env(os.environ, t.deadline_margin_s)
        self.global_step = 0
        self.world = cfg.derived.world_size
        self.n_workers = self.world
        self.actor = self.ref = self.critic = None
        self.rank_metrics: dict[str, float] = {}
        start = time.perf_counter()
        self.address = connect(self.world)
        groups = 2 if cfg.derived.use_critic else 1
        self.slot = make_placement_group(t.nnodes, t.n_gpus_per_node, groups)
        self.actor_group = WorkerGroup("actor_rollout_ref", ActorRolloutRefWorker, self.slot, self.world,
                                       cfg, self.total_steps)
        self.critic_group = (WorkerGroup("critic", CriticWorker, self.slot, self.world, cfg, self.total_steps)
                             if cfg.derived.use_critic else None)
        for group in self._groups():
            group.init_dist()
        self._write_workers()
        print(f"trainer: {self.world} rank(s) on {len({n['hostname'] for n in self.actor_group.nodes})} "
              f"node(s) via Ray at {self.address}, ready in {time.perf_counter() - start:.1f}s", flush=True)

    def _groups(self) -> list[Any]:
        return [g for g in (self.actor_group, self.critic_group) if g is not None]

    def _write_workers(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        layout = {g.name: g.nodes for g in self._groups()}
        (self.run_dir / "workers.json").write_text(json.dumps(layout, indent=1))

    # ------------------------------------------------------------------ per-rank bookkeeping

    def _note(self, phase: str, per_rank: list[float]) -> float:
        """Record a per-rank figure (`dp/rank_<r>/<phase>`); return the largest."""
        for rank, value in enumerate(per_rank):
            self.rank_metrics[f"dp/rank_{rank}/{phase}"] = float(value)
        return max(per_rank) if per_rank else 0.0

    # ------------------------------------------------------------------ phases

    def generate(self, examples: list[Example], validate: bool = False) -> StepBatch:
        ids, mask = M.left_pad([e.prompt_ids for e in examples], self.tokenizer.pad_token_id)
        parts = split_rows(len(examples), self.world)
        salt = 2000 if validate else 1000
        args = [(ids[p], mask[p], self._sampling(validate),
                 step_seed(self.cfg.trainer.seed, self.global_step, salt + rank)) for rank, p in enumerate(parts)]
        results = self.actor_group.run_each("generate", args)
        outs: list[RolloutBatch] = []
        for part, (out, _info) in zip(parts, results, strict=True):
            if out is not None:
                out.prompt_index = out.prompt_index + part[0]
                outs.append(out)
        if not validate:
            self._note("gen_rows", [len(p) for p in parts])
            self._note("gen_tokens", [info["gen_tokens"] for _, info in results])
            self._note("gen_s", [info["gen"] for _, info in results])
            self.rank_metrics["timing_s/weight_sync"] = self._note("weight_sync_s", [i["weight_sync"] for _, i in results])
        rows = torch.cat([o.prompt_index for o in outs]).tolist()  # prompts share one padded width
        return StepBatch(examples=[examples[i] for i in rows], uids=rows,
                         input_ids=torch.cat([o.input_ids for o in outs]),
                         attention_mask=torch.cat([o.attention_mask for o in outs]),
                         response_mask=torch.cat([o.response_mask for o in outs]).float())

    def _split(self, batch: StepBatch) -> list[list[int]]:
        """Rows of each rank: contiguous, or with `trainer.balance_batch` equal counts of similar
        token totals (the maths does not depend on the split, only the load does)."""
        if self.cfg.trainer.balance_batch:
            return balanced_split(batch.attention_mask.sum(-1).long().tolist(), self.world)
        return split_rows(len(batch), self.world)

    def _shards(self, batch: StepBatch) -> tuple[list[list[int]], list[tuple[StepBatch]]]:
        parts = self._split(batch)
        return parts, [(_tensors_only(batch.select(p)),) for p in parts]

    def _collect_rows(self, batch: StepBatch, parts: list[list[int]], results: list[dict[str, Any]], key: str) -> torch.Tensor:
        out = torch.zeros_like(batch.response_mask)
        for part, res in zip(parts, results, strict=True):
            if part:
                out[part] = res[key]
        return out

    def reuses_update_log_probs(self, batch: StepBatch) -> bool:
        """The workers' update does not hand back its log-probs: always recompute them."""
        return False

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        parts, args = self._shards(batch)
        results = self.actor_group.run_each("compute_log_probs", args)
        self._note("old_log_prob_s", [r["seconds"] for r in results])
        batch.old_log_probs = self._collect_rows(batch, parts, results, "log_probs")
        batch.entropy = self._collect_rows(batch, parts, results, "entropy")
        mode = self.cfg.actor_rollout_ref.actor.loss_agg_mode
        return {"actor/entropy": core_algos.agg_loss(batch.entropy, batch.response_mask, mode).item()}

    def compute_ref_log_probs(self, batch: StepBatch) -> None:
        parts, args = self._shards(batch)
        results = self.actor_group.run_each("compute_ref_log_probs", args)
        self._note("ref_s", [r["seconds"] for r in results])
        batch.ref_log_probs = self._collect_rows(batch, parts, results, "log_probs")

    def compute_values(self, batch: StepBatch) -> None:
        assert self.critic_group is not None
        parts, args = self._shards(batch)
        results = self.critic_group.run_each("compute_values", args)
        self._note("values_s", [r["seconds"] for r in results])
        batch.values = self._collect_rows(batch, parts, results, "values")

    def _rank_minis(self, batch: StepBatch, mini_size: int, shuffle: bool, epochs: int, salt: int) -> list[tuple[list[list[StepBatch]]]]:
        """Per rank: for each epoch, its share of every mini-batch (the mini-batches the
        single-process trainer forms)."""
        per_rank: list[list[list[StepBatch]]] = [[] for _ in range(self.world)]
        for epoch in range(epochs):
            minis = self._mini_batches(batch, mini_size, shuffle, salt + epoch)
            for rank in range(self.world):
                per_rank[rank].append([_tensors_only(m.select(self._split(m)[rank])) for m in minis])
        return [(epochs_of_rank,) for epochs_of_rank in per_rank]

    def _merge(self, results: list[dict[str, Any]], prefix: str) -> dict[str, float]:
        """Rank metrics merged: every value is the mean over ranks and mini-batches (loss shares
        average to the whole mini-batch's loss because each is scaled by the world size)."""
        keys = {k for r in results for k in r["metrics"]}
        merged = {k: float(np.mean([v for r in results for v in r["metrics"].get(k, [])])) for k in keys}
        self._note(f"{prefix}_s", [r["seconds"] for r in results])
        self._note(f"{prefix}_tokens", [r["tokens"] for r in results])
        return merged

    def update_critic(self, batch: StepBatch) -> dict[str, float]:
        assert self.critic_group is not None
        c, n = self.cfg.critic, self.cfg.actor_rollout_ref.rollout.n
        args = self._rank_minis(batch, int(c.ppo_mini_batch_size or 1) * n, bool(c.shuffle), int(c.ppo_epochs or 1), 100)
        return self._merge(self.critic_group.run_each("update_critic", args), "update_critic")

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        a, n = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout.n
        args = self._rank_minis(batch, a.ppo_mini_batch_size * n, a.shuffle, a.ppo_epochs, 0)
        return self._merge(self.actor_group.run_each("update_actor", args), "update_actor")

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        self.rank_metrics = {}
        metrics = super().train_step(examples)
        metrics.update(self.rank_metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Rank 0 of each group writes its gathered states into the temporary directory, the
        driver adds the loop state and the config, then commits."""
        from trainer.config import dump_config

        start = time.perf_counter()
        tmp = ckpt.begin_checkpoint(self.ckpt_root, self.global_step)
        try:
            for group in self._groups():
                group.run("save_checkpoint", str(tmp))
            state = {"global_step": self.global_step, "loader": self.loader.state_dict(),
                     "kl_ctrl": self.kl_ctrl.state_dict(), "rng": ckpt.capture_rng_state(),
                     "world_size": self.world}
            ckpt.write_states(tmp, {"trainer_state": state})
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        path = ckpt.commit_checkpoint(
            self.ckpt_root, self.global_step, tmp, files={"config.yaml": dump_config(self.cfg)},
            metadata={"global_step": self.global_step, "epoch": self.loader.epoch, "world_size": self.world},
            keep_last=self.cfg.trainer.max_actor_ckpt_to_keep)
        self.last_save_s = time.perf_counter() - start
        return path

    def load_checkpoint(self, path: Path) -> None:
        start = time.perf_counter()
        names = {str(f.relative_to(path))[:-3] for f in path.glob("*.pt")}
        if self.critic_group is not None and "critic" not in names:
            raise ConfigError(
                f"checkpoint `{path}` has no critic but `algorithm.adv_estimator=gae` needs one; "
                "resume with the estimator the run started with, or `trainer.resume_mode=disable`")
        for group in self._groups():
            group.run("load_checkpoint", str(path))
        state = ckpt.load_state(path, "trainer_state")
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.restore_rng_state(state["rng"])
        print(f"trainer: resumed {path} (saved on {state.get('world_size', '?')} rank(s)) on {self.world} "
              f"rank(s) in {time.perf_counter() - start:.1f}s", flush=True)


def run_distributed(cfg: Config, stop: StopRequest | None = None) -> int:
    """Build the distributed trainer, run it, shut Ray down; the return value is the exit code."""
    import ray

    try:
        return RayPPOTrainer(cfg, stop).fit()
    finally:
        if ray.is_initialized():
            ray.shutdown()
