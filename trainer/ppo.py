"""The single-process PPO trainer (CPU or one GPU).

The loop reads top to bottom, one method per phase:
`resume -> for step: rollout -> reward -> old/ref log-probs, values -> advantages ->
critic update -> actor update -> metrics -> maybe validate -> maybe checkpoint -> stop if asked`.

A stop request (SIGUSR2/SIGTERM or `<run_dir>/STOP`) ends the run after the current step with a
checkpoint and `REQUEUE_EXIT_CODE`; the next run resumes from that checkpoint.
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import checkpoint as ckpt
from trainer import models as M
from trainer.algos import core_algos
from trainer.config import Config, ConfigError, config_to_dict
from trainer.data import Example, PromptDataset, PromptLoader, batches
from trainer.deadline import Deadline
from trainer.exit_codes import OK_EXIT_CODE, REQUEUE_EXIT_CODE
from trainer.metrics import MetricsLogger, data_metrics, throughput_metrics, timing_metrics
from trainer.rewards import load_reward_fn, score_responses
from trainer.stop import StopRequest


@dataclass
class StepBatch:
    """One step's samples: prompt (left-padded) + response (right-padded), and what PPO adds."""

    examples: list[Example]
    uids: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    sequence_scores: torch.Tensor | None = None
    token_scores: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_length:]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: list[int]) -> StepBatch:
        """The rows `rows` of every per-sample field."""
        index = torch.as_tensor(rows, dtype=torch.long)
        picked: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[index.to(value.device)]
            elif isinstance(value, list) and value:  # workers get tensors only (empty lists)
                picked[f.name] = [value[i] for i in rows]
        return replace(self, **picked)


def micro_batch_rows(
    lengths: list[int], micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int
) -> list[list[int]]:
    """Split rows 0..n-1 into micro-batches: by count, or greedily by token budget."""
    n = len(lengths)
    if not use_dynamic_bsz:
        size = micro_batch_size or n
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    groups: list[list[int]] = [[]]
    tokens = 0
    for row, length in enumerate(lengths):
        if groups[-1] and tokens + length > max_token_len:
            groups.append([])
            tokens = 0
        groups[-1].append(row)
        tokens += length
    return groups


def need(value: torch.Tensor | None, what: str) -> torch.Tensor:
    """`value`, which an earlier phase must have filled in."""
    if value is None:
        raise RuntimeError(f"`{what}` is missing: the phase that computes it did not run")
    return value


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for one step's randomness, so a resumed run draws exactly what an unbroken one did."""
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0])


def launcher_restart() -> int:
    """Which run of the job this is (`HPCRL_RESTART`, set by hpcrl's node agent; 0 otherwise):
    recorded with each step so that plots can mark where a run resumed."""
    raw = os.environ.get("HPCRL_RESTART", "")
    return int(raw) if raw.strip().isdigit() else 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`trainer.device=cuda` but torch sees no GPU; use `trainer.device=cpu`")
    return torch.device(name)


class Timer:
    """Collects `timing_s/<phase>` durations for one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _mean_metrics(collected: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.mean(v)) for k, v in collected.items() if v}


class PPOTrainer:
    """Holds the models, optimisers, data and loop state of one single-process run."""

    def __init__(self, cfg: Config, stop: StopRequest | None = None) -> None:
        self.cfg = cfg
        arr, trainer = cfg.actor_rollout_ref, cfg.trainer
        self.device = resolve_device(trainer.device)
        self.ckpt_root = Path(trainer.default_local_dir or ".")
        self.run_dir = Path(trainer.run_dir) if trainer.run_dir else self.ckpt_root
        seed_everything(trainer.seed)
        self.reward_fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        self.tokenizer = M.load_tokenizer(cfg.data.tokenizer or arr.model.path)
        self._build_data()
        self.actor = self._to_device(M.load_actor(
            arr.model.path, gradient_checkpointing=arr.model.enable_gradient_checkpointing))
        self.ref = self._frozen(M.load_actor(arr.model.path)) if cfg.derived.use_reference else None
        self.critic: Any = None
        if cfg.derived.use_critic:
            self.critic = self._to_device(M.load_critic(
                cfg.critic.model.path or arr.model.path,
                gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing))
        self.actor_optim, self.actor_sched = self._optimizer(self.actor, arr.actor.optim)
        self.critic_optim: Any
        self.critic_sched: Any
        self.critic_optim, self.critic_sched = (
            self._optimizer(self.critic, cfg.critic.optim) if self.critic is not None else (None, None))
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.rollout = self._build_rollout()
        self.stop = stop or StopRequest()
        self.stop.watch(self.run_dir)
        self.deadline = Deadline.from_env(os.environ, trainer.deadline_margin_s)
        self.global_step = 0
        self.n_workers = 1

    # ------------------------------------------------------------------------------ set-up

    def _build_data(self) -> None:
        data = self.cfg.data
        common: dict[str, Any] = {"max_prompt_length": data.max_prompt_length, "prompt_key": data.prompt_key,
                  "filter_overlong_prompts": data.filter_overlong_prompts, "truncation": data.truncation}
        self.train_set = PromptDataset(data.train_files, self.tokenizer, **common)
        self.loader = PromptLoader(self.train_set, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
        needs_val = self.cfg.trainer.val_before_train or self.cfg.trainer.test_freq > 0
        self.val_set = PromptDataset(data.val_files, self.tokenizer, **common) if needs_val else None
        per_epoch = self.loader.batches_per_epoch * self.cfg.trainer.total_epochs
        self.total_steps = self.cfg.trainer.total_training_steps or per_epoch

    def _to_device(self, model: torch.nn.Module) -> Any:
        return model.to(self.device)

    def _frozen(self, model: torch.nn.Module) -> Any:
        model.eval().requires_grad_(False)
        return self._to_device(model)

    def _optimizer(self, model: torch.nn.Module, optim: Any) -> tuple[Any, Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                weight_decay=optim.weight_decay)
        warmup = core_algos.resolve_warmup_steps(optim.lr_warmup_steps, optim.lr_warmup_steps_ratio,
                                                 self.total_steps)
        sched = core_algos.build_lr_scheduler(opt, warmup, self.total_steps, optim.warmup_style,
                                              optim.min_lr_ratio)
        return opt, sched

    def _build_rollout(self) -> Any:
        """HF `generate` on the actor itself, or a vLLM engine synced before every rollout."""
        from trainer.rollout import HFRolloutEngine

        rollout = self.cfg.actor_rollout_ref.rollout
        if rollout.name == "vllm":
            from trainer.vllm_rollout import VLLMRolloutEngine

            self.rollout_shares_weights = False
            return VLLMRolloutEngine.from_config(self.cfg, self.tokenizer, seed=self.cfg.trainer.seed)
        self.rollout_shares_weights = True
        return HFRolloutEngine(self.actor, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)

    def sync_rollout_weights(self) -> None:
        """Give the rollout engine the actor's current weights (nothing to do when they are shared)."""
        if not self.rollout_shares_weights:
            self.rollout.sync_weights(self.actor.state_dict())

    def _sampling(self, validate: bool) -> Any:
        from trainer.rollout import SamplingParams

        r = self.cfg.actor_rollout_ref.rollout
        src: Any = r.val_kwargs if validate else r
        return SamplingParams(n=src.n, temperature=src.temperature, top_p=src.top_p, top_k=src.top_k,
                              max_response_length=self.cfg.data.max_response_length,
                              do_sample=src.do_sample)

    # ------------------------------------------------------------------------------ phases

    def generate(self, examples: list[Example], validate: bool = False) -> StepBatch:
        """Rollout: `n` responses per prompt, rows prompt-major."""
        ids, mask = M.left_pad([e.prompt_ids for e in examples], self.tokenizer.pad_token_id)
        self.sync_rollout_weights()
        self.rollout.wake_up()
        try:
            out = self.rollout.generate(ids.to(self.device), mask.to(self.device), self._sampling(validate))
        finally:
            self.rollout.sleep()
        rows = out.prompt_index.tolist()
        return StepBatch(
            examples=[examples[i] for i in rows], uids=rows,
            input_ids=out.input_ids.to(self.device), attention_mask=out.attention_mask.to(self.device),
            response_mask=out.response_mask.to(self.device).float(),
            entropy=out.entropy.to(self.device) if out.entropy is not None else None,
        )

    def compute_rewards(self, batch: StepBatch) -> dict[str, float]:
        """Decode responses, score each with its data source's function, place the score on
        the last response token."""
        lengths = batch.response_mask.sum(-1).long().tolist()
        texts = [str(self.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True))
                 for row, n in zip(batch.responses, lengths, strict=True)]
        scores, extras = score_responses(
            self.reward_fn, [e.data_source for e in batch.examples], texts,
            [e.ground_truth for e in batch.examples], [e.extra_info for e in batch.examples])
        batch.sequence_scores = torch.tensor(scores, dtype=torch.float32, device=self.device)
        batch.token_scores = core_algos.scores_to_token_level(batch.sequence_scores, batch.response_mask)
        return {f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extras.items()}

    def _log_prob_rows(self, batch: StepBatch, micro: int | None, dynamic: bool, max_len: int) -> list[list[int]]:
        lengths = batch.attention_mask.sum(-1).long().tolist()
        return micro_batch_rows(lengths, micro, dynamic, max_len)

    @torch.no_grad()
    def _forward_log_probs(self, model: Any, batch: StepBatch, rows: list[list[int]], entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        lp = torch.zeros_like(batch.response_mask)
        ent = torch.zeros_like(batch.response_mask) if entropy else None
        for part in rows:
            mb = batch.select(part)
            out, e = M.compute_log_probs(model, mb.input_ids, mb.attention_mask, batch.response_length,
                                         temperature=temperature, calculate_entropy=entropy)
            lp[part] = out
            if ent is not None and e is not None:
                ent[part] = e
        return lp, ent

    def reuses_update_log_probs(self, batch: StepBatch) -> bool:
        """Whether the actor update supplies the old log-probs itself, skipping their forward pass.

        When the update is one optimiser step over the whole batch (one PPO epoch, one
        mini-batch) and nothing needs the old log-probs before it (no KL in the reward), every
        micro-batch's forward runs with the weights the old log-probs would be recomputed with:
        the old log-probs are that forward's log-probs, detached (the ratio is exactly 1, the
        on-policy case). With dropout the recomputation would run without it; here it does not.
        """
        a, n = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout.n
        return (a.ppo_epochs == 1 and len(batch) <= a.ppo_mini_batch_size * n
                and not self.cfg.algorithm.use_kl_in_reward)

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        r = self.cfg.actor_rollout_ref.rollout
        rows = self._log_prob_rows(batch, r.log_prob_micro_batch_size_per_gpu,
                                   bool(r.log_prob_use_dynamic_bsz), int(r.log_prob_max_token_len_per_gpu or 0))
        self.actor.eval()
        batch.old_log_probs, batch.entropy = self._forward_log_probs(self.actor, batch, rows, True)
        self.actor.train()
        return {"actor/entropy": self._entropy_metric(need(batch.entropy, "entropy"), batch.response_mask)}

    def _entropy_metric(self, entropy: torch.Tensor, response_mask: torch.Tensor) -> float:
        mode = self.cfg.actor_rollout_ref.actor.loss_agg_mode
        return float(core_algos.agg_loss(entropy, response_mask, mode).item())

    def compute_ref_log_probs(self, batch: StepBatch) -> None:
        ref = self.cfg.actor_rollout_ref.ref
        rows = self._log_prob_rows(batch, ref.log_prob_micro_batch_size_per_gpu,
                                   bool(ref.log_prob_use_dynamic_bsz), int(ref.log_prob_max_token_len_per_gpu or 0))
        batch.ref_log_probs, _ = self._forward_log_probs(self.ref, batch, rows, False)

    @torch.no_grad()
    def compute_values(self, batch: StepBatch) -> None:
        c = self.cfg.critic
        rows = self._log_prob_rows(batch, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                   int(c.forward_max_token_len_per_gpu or 0))
        values = torch.zeros_like(batch.response_mask)
        self.critic.eval()
        for part in rows:
            mb = batch.select(part)
            values[part] = M.compute_values(self.critic, mb.input_ids, mb.attention_mask, batch.response_length)
        self.critic.train()
        batch.values = values * batch.response_mask

    def compute_advantages(self, batch: StepBatch) -> dict[str, float]:
        """KL in the reward (when asked), then the configured advantage estimator."""
        algo, metrics = self.cfg.algorithm, {}
        assert batch.token_scores is not None
        batch.token_rewards = batch.token_scores
        if algo.use_kl_in_reward:
            batch.token_rewards, current_kl = core_algos.apply_kl_penalty(
                batch.token_scores, need(batch.old_log_probs, "old_log_probs"),
                need(batch.ref_log_probs, "ref_log_probs"), batch.response_mask,
                self.kl_ctrl.value, algo.kl_penalty)
            metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
            self.kl_ctrl.update(current_kl, len(batch))
        batch.advantages, batch.returns = core_algos.compute_advantage(
            algo.adv_estimator, batch.token_rewards, batch.response_mask, values=batch.values,
            index=batch.uids, gamma=algo.gamma, lam=algo.lam,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
        return metrics

    # ------------------------------------------------------------------------------ updates

    def _mini_batches(self, batch: StepBatch, mini_size: int, shuffle: bool, salt: int) -> list[StepBatch]:
        order = list(range(len(batch)))
        if shuffle:
            gen = torch.Generator().manual_seed(step_seed(self.cfg.trainer.seed, self.global_step, salt))
            order = torch.randperm(len(batch), generator=gen).tolist()
        return [batch.select(order[i:i + mini_size]) for i in range(0, len(batch), mini_size)]

    def _agg_kwargs(self, mini: StepBatch) -> dict[str, Any]:
        tokens, seqs = core_algos.loss_normalizers(mini.response_mask)
        return {"global_num_tokens": tokens, "global_num_seqs": seqs,
                "norm_length": float(self.cfg.data.max_response_length)}

    def _micro_of(self, mini: StepBatch, micro: int | None, dynamic: bool, max_len: int) -> list[StepBatch]:
        lengths = mini.attention_mask.sum(-1).long().tolist()
        return [mini.select(rows) for rows in micro_batch_rows(lengths, micro, dynamic, max_len)]

    def _optimizer_step(self, model: Any, optim: Any, grad_clip: float) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if torch.isfinite(grad_norm):
            optim.step()
        optim.zero_grad(set_to_none=True)
        return float(grad_norm)

    def update_critic(self, batch: StepBatch) -> dict[str, float]:
        c, n = self.cfg.critic, self.cfg.actor_rollout_ref.rollout.n
        collected: dict[str, list[float]] = defaultdict(list)
        self.critic.train()
        for epoch in range(int(c.ppo_epochs or 1)):
            for mini in self._mini_batches(batch, int(c.ppo_mini_batch_size or 1) * n, bool(c.shuffle), 100 + epoch):
                agg, vf_loss = self._agg_kwargs(mini), 0.0
                for mb in self._micro_of(mini, c.ppo_micro_batch_size_per_gpu, bool(c.use_dynamic_bsz),
                                         c.ppo_max_token_len_per_gpu):
                    vpreds = M.compute_values(self.critic, mb.input_ids, mb.attention_mask, batch.response_length)
                    loss, clipfrac = core_algos.compute_value_loss(
                        vpreds, need(mb.returns, "returns"), need(mb.values, "values"), mb.response_mask,
                        c.cliprange_value,
                        str(c.loss_agg_mode), **agg)
                    loss.backward()
                    vf_loss += loss.item()
                    collected["critic/vf_clipfrac"].append(clipfrac.item())
                collected["critic/vf_loss"].append(vf_loss)
                collected["critic/grad_norm"].append(self._optimizer_step(self.critic, self.critic_optim, c.grad_clip))
        self.critic_sched.step()
        collected["critic/lr"].append(self.critic_sched.get_last_lr()[0])
        return _mean_metrics(collected)

    def _actor_micro_loss(self, mb: StepBatch, agg: dict[str, Any], keep_entropy: bool
                          ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch. Without old log-probs (see `reuses_update_log_probs`) its own
        log-probs stand in for them; `keep_entropy` keeps its entropies in `mb.entropy` for the metric."""
        a = self.cfg.actor_rollout_ref.actor
        reuse = mb.old_log_probs is None
        log_prob, entropy = M.compute_log_probs(
            self.actor, mb.input_ids, mb.attention_mask, mb.response_length,
            temperature=self.cfg.actor_rollout_ref.rollout.temperature,
            calculate_entropy=a.entropy_coeff != 0 or keep_entropy, entropy_grad=a.entropy_coeff != 0)
        if keep_entropy:
            mb.entropy = need(entropy, "entropy").detach()
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
            log_prob.detach() if reuse else need(mb.old_log_probs, "old_log_probs"), log_prob,
            need(mb.advantages, "advantages"),
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

    def _rows_to_update(self, mini: StepBatch, keep_entropy: bool) -> list[int]:
        """Rows of `mini` whose loss has a gradient; the others skip their forward and backward passes.

        With neither an entropy bonus nor a KL loss, a row whose advantages are all zero (a GRPO
        group whose samples scored alike) adds exactly zero to the policy gradient, and the loss
        normalisers (from the whole mini-batch) still count it. Every row is kept when the update
        must supply the entropy metric (`keep_entropy`).
        """
        a = self.cfg.actor_rollout_ref.actor
        if keep_entropy or a.entropy_coeff != 0 or a.use_kl_loss:
            return list(range(len(mini)))
        advantages = need(mini.advantages, "advantages") * mini.response_mask
        return torch.nonzero((advantages != 0).any(dim=-1)).flatten().tolist()

    def _zero_grads(self, model: Any) -> None:
        """Zero gradients where a backward pass would have left them, so that the optimiser step
        after a mini-batch whose rows were all skipped matches one over zero-gradient rows."""
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        a, n = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout.n
        collected: dict[str, list[float]] = defaultdict(list)
        # The old log-probs come from this update and the rollout gave no entropies: measure them here.
        keep_entropy = batch.old_log_probs is None and batch.entropy is None
        entropies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.actor.train()
        for epoch in range(a.ppo_epochs):
            for mini in self._mini_batches(batch, a.ppo_mini_batch_size * n, a.shuffle, epoch):
                agg, sums = self._agg_kwargs(mini), defaultdict[str, float](float)
                rows = self._rows_to_update(mini, keep_entropy)
                collected["actor/skipped_row_frac"].append(1.0 - len(rows) / len(mini))
                if not rows:
                    self._zero_grads(self.actor)
                    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
                        collected[key].append(0.0)
                for mb in self._micro_of(mini.select(rows), a.ppo_micro_batch_size_per_gpu,
                                         a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu) if rows else []:
                    loss, info = self._actor_micro_loss(mb, agg, keep_entropy)
                    loss.backward()
                    if keep_entropy:
                        entropies.append((need(mb.entropy, "entropy"), mb.response_mask))
                    sums["actor/pg_loss"] += info.pop("actor/pg_loss")
                    sums["actor/kl_loss"] += info.pop("actor/kl_loss", 0.0)
                    for key, value in info.items():
                        collected[key].append(value)
                collected["actor/pg_loss"].append(sums["actor/pg_loss"])
                if a.use_kl_loss:
                    collected["actor/kl_loss"].append(sums["actor/kl_loss"])
                collected["actor/grad_norm"].append(self._optimizer_step(self.actor, self.actor_optim, a.grad_clip))
        self.actor_sched.step()
        collected["actor/lr"].append(self.actor_sched.get_last_lr()[0])
        if entropies:  # each row once: the old log-probs came from this update
            entropy, mask = (torch.cat(t) for t in zip(*entropies, strict=True))
            collected["actor/entropy"].append(self._entropy_metric(entropy, mask))
        return _mean_metrics(collected)

    # ------------------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Generate with `val_kwargs` (greedy by default) and report the mean score per data source."""
        assert self.val_set is not None
        n = self.cfg.actor_rollout_ref.rollout.val_kwargs.n
        by_source: dict[str, list[float]] = defaultdict(list)
        for examples in batches(self.val_set, self.cfg.data.val_batch_size):
            batch = self.generate(examples, validate=True)
            self.compute_rewards(batch)
            assert batch.sequence_scores is not None
            for ex, score in zip(batch.examples, batch.sequence_scores.tolist(), strict=True):
                by_source[ex.data_source].append(score)
        return {f"val-core/{src}/reward/mean@{n}": float(np.mean(v)) for src, v in by_source.items()}

    # ------------------------------------------------------------------------------ one step

    def _collect(self, batch: StepBatch, timer: Timer) -> dict[str, float]:
        """Everything between rollout and the updates (reward, log-probs, values, advantages)."""
        metrics: dict[str, float] = {}
        with timer.phase("reward"):
            metrics.update(self.compute_rewards(batch))
        if not self.reuses_update_log_probs(batch):
            with timer.phase("old_log_prob"):
                metrics.update(self.compute_old_log_probs(batch))
        elif batch.entropy is not None:  # the rollout's entropies stand in for recomputed ones
            metrics["actor/entropy"] = self._entropy_metric(batch.entropy, batch.response_mask)
        if self.cfg.derived.use_reference:
            with timer.phase("ref"):
                self.compute_ref_log_probs(batch)
        if self.cfg.derived.use_critic:
            with timer.phase("values"):
                self.compute_values(batch)
        with timer.phase("adv"):
            metrics.update(self.compute_advantages(batch))
        return metrics

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        """One PPO step on a batch of prompts; returns its metrics (verl names)."""
        torch.manual_seed(step_seed(self.cfg.trainer.seed, self.global_step))
        timer = Timer()
        with timer.phase("step"):
            with timer.phase("gen"):
                batch = self.generate(examples)
            metrics = self._collect(batch, timer)
            if self.cfg.derived.use_critic:
                with timer.phase("update_critic"):
                    metrics.update(self.update_critic(batch))
            if self.cfg.trainer.critic_warmup <= self.global_step:
                with timer.phase("update_actor"):
                    metrics.update(self.update_actor(batch))
        assert batch.sequence_scores is not None and batch.token_rewards is not None
        metrics.update(data_metrics(
            sequence_score=batch.sequence_scores, sequence_reward=batch.token_rewards.sum(-1),
            advantages=need(batch.advantages, "advantages"), returns=need(batch.returns, "returns"),
            values=batch.values,
            response_mask=batch.response_mask,
            prompt_mask=batch.attention_mask[:, :-batch.response_length],
            max_response_length=self.cfg.data.max_response_length))
        metrics.update(timing_metrics(timer.seconds))
        metrics.update(throughput_metrics(int(batch.attention_mask.sum()), timer.seconds["step"],
                                          self.n_workers))
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = self.loader.epoch
        metrics["training/total_steps"] = self.total_steps
        metrics["training/restart"] = launcher_restart()
        return metrics

    # ------------------------------------------------------------------------------ checkpoints

    def _states(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "actor": self.actor.state_dict(), "actor_optim": self.actor_optim.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "trainer_state": {"global_step": self.global_step, "loader": self.loader.state_dict(),
                              "kl_ctrl": self.kl_ctrl.state_dict(), "rng": ckpt.capture_rng_state()},
        }
        if self.critic is not None:
            states.update({"critic": self.critic.state_dict(), "critic_optim": self.critic_optim.state_dict(),
                           "critic_sched": self.critic_sched.state_dict()})
        return states

    def save_checkpoint(self) -> Path:
        """`<default_local_dir>/global_step_N/`: states, config and an HF export of the actor."""
        from trainer.config import dump_config

        keep = self.cfg.trainer.max_actor_ckpt_to_keep
        return ckpt.save_checkpoint(
            self.ckpt_root, self.global_step, self._states(),
            files={"config.yaml": dump_config(self.cfg)}, hf_model=self.actor, hf_tokenizer=self.tokenizer,
            metadata={"global_step": self.global_step, "epoch": self.loader.epoch}, keep_last=keep)

    def load_checkpoint(self, path: Path) -> None:
        states = ckpt.load_checkpoint(path, map_location="cpu")  # RNG states must stay on the CPU
        self.actor.load_state_dict(states["actor"])
        self.actor_optim.load_state_dict(states["actor_optim"])
        self.actor_sched.load_state_dict(states["actor_sched"])
        if self.critic is not None:
            if "critic" not in states:
                raise ConfigError(
                    f"checkpoint `{path}` has no critic but `algorithm.adv_estimator=gae` needs one; "
                    "resume with the estimator the run started with, or `trainer.resume_mode=disable`")
            self.critic.load_state_dict(states["critic"])
            self.critic_optim.load_state_dict(states["critic_optim"])
            self.critic_sched.load_state_dict(states["critic_sched"])
        state = states["trainer_state"]
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.restore_rng_state(state["rng"])

    def resume(self) -> Path | None:
        """Load the checkpoint `trainer.resume_mode` selects; return it (None: fresh start)."""
        t = self.cfg.trainer
        path = ckpt.resolve_resume(self.ckpt_root, t.resume_mode, t.resume_from_path)
        if path is not None:
            self.load_checkpoint(path)
        return path

    # ------------------------------------------------------------------------------ the loop

    def _open_metrics(self, resumed: bool) -> MetricsLogger:
        t = self.cfg.trainer
        return MetricsLogger(self.run_dir, t.logger, keep_through=self.global_step if resumed else -1,
                             project=t.project_name, experiment=t.experiment_name,
                             config=config_to_dict(self.cfg))

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.global_step % freq == 0

    def fit(self) -> int:
        """Run to `total_steps` or to a stop request; return the process exit code."""
        t = self.cfg.trainer
        start = time.perf_counter()
        path = self.resume()
        resumed = path is not None
        if path is not None:
            print(f"trainer: resumed from {path} (step {self.global_step}) in "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
        logger = self._open_metrics(resumed)
        owned = not self.stop.installed  # `python -m trainer` keeps its handlers to the end
        self.stop.install()
        try:
            if self.val_set is not None and t.val_before_train and not resumed:
                logger.log(self.global_step, self.validate())
            return self._loop(logger)
        finally:
            if owned:
                self.stop.uninstall()
            logger.close()

    def _stop_reason(self) -> str | None:
        """Why to stop after this step: a request, or the job's end time too near for another."""
        if self.stop.requested():
            return self.stop.reason()
        if self.deadline.reached():
            return self.deadline.describe()
        return None

    def _loop(self, logger: MetricsLogger) -> int:
        t = self.cfg.trainer
        while self.global_step < self.total_steps:
            began = time.time()
            examples = self.loader.next_batch()
            self.global_step += 1
            metrics = self.train_step(examples)
            last = self.global_step == self.total_steps
            if self.val_set is not None and t.test_freq > 0 and (self._due(t.test_freq) or last):
                with_timer = time.perf_counter()
                metrics.update(self.validate())
                metrics["timing_s/testing"] = time.perf_counter() - with_timer
            # Metrics first: a kill between the two leaves a line that resume drops, never a gap.
            logger.log(self.global_step, metrics)
            self.deadline.record_step(time.time() - began)
            stopping = self._stop_reason()
            if self._due(t.save_freq) or stopping or self.global_step == self.total_steps:
                start = time.perf_counter()
                path = self.save_checkpoint()
                self.deadline.record_save(time.perf_counter() - start)
                print(f"trainer: saved {path} in {time.perf_counter() - start:.1f}s", flush=True)
            if stopping:
                print(f"trainer: stop requested ({stopping}); checkpointed step "
                      f"{self.global_step}, exiting with {REQUEUE_EXIT_CODE} (please requeue)", flush=True)
                self.stop.clear_stop_file()
                return REQUEUE_EXIT_CODE
        return OK_EXIT_CODE


def run_training(cfg: Config, stop: StopRequest | None = None) -> int:
    """Build the trainer from `cfg` (on Ray worker groups when `trainer.distributed` says so)
    and run it; the return value is the exit code. `stop`: a request whose handlers are already
    installed (`python -m trainer` does that first)."""
    from trainer.ray_trainer import run_distributed, use_ray

    if use_ray(cfg):
        return run_distributed(cfg, stop)
    return PPOTrainer(cfg, stop).fit()
