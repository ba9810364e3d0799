"""The rollout stage: `n` responses per prompt from the actor group's rollout engines, rows
prompt-major, each engine answering its part of the prompts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from trainer import models as M
from trainer.agent.manager import TraceInfo, agent_loop_metrics
from trainer.batch import StepBatch, need, step_seed
from trainer.config import Config
from trainer.config.rollout import SINGLE_TURN_AGENT
from trainer.data import Example
from trainer.parallel import split_rows
from trainer.rollout.base import RolloutBatch, SamplingParams
from trainer.rollout.vllm_server import server_mode
from trainer.stages.logprobs import Note
from trainer.workers.group import WorkerGroup

__all__ = ["SALT", "Rollout", "agent_loop_sampling", "deal", "sampling_params"]

#: Seed salts: the training rollout, validation, ReMax's greedy baseline and PF-PPO's redraw of
#: the rows (:func:`trainer.stages.advantage.resample_pf_ppo`) draw apart.
SALT = {"train": 1000, "validate": 2000, "greedy": 3000, "pf_ppo": 4000}


def sampling_params(cfg: Config, validate: bool) -> SamplingParams:
    """The rollout's sampling (`rollout.*`), or validation's (`rollout.val_kwargs.*`)."""
    r = cfg.actor_rollout_ref.rollout
    src: Any = r.val_kwargs if validate else r
    return SamplingParams(n=src.n, temperature=src.temperature, top_p=src.top_p, top_k=src.top_k,
                          max_response_length=cfg.data.max_response_length, do_sample=src.do_sample)


def agent_loop_sampling(params: SamplingParams, greedy_baseline: bool) -> SamplingParams:
    """`params` as verl's agent loop samples with them (`AgentLoopWorker.generate_sequences`,
    `verl/experimental/agent_loop/agent_loop.py`, verl 0.9.1): temperature, top_p and top_k of
    `rollout.*` (`val_kwargs.*` when validating); `do_sample`, the rollout's or validation's, is
    not read there, so it is ignored here too. ReMax's greedy baseline (verl's per-row
    `__do_sample__=False`) gets verl's `apply_greedy_sampling_params`: temperature 0, top_p 1,
    top_k -1."""
    if greedy_baseline:
        return replace(params, temperature=0.0, top_p=1.0, top_k=-1, do_sample=True)
    return replace(params, do_sample=True)


class Rollout:
    """Generation on the actor group: the ranks of one engine (`tensor_model_parallel_size`
    consecutive ranks) get the same prompts and seed, the engines split the prompts."""

    def __init__(self, cfg: Config, actor: WorkerGroup, pad_token_id: int, in_process: bool = False) -> None:
        self.cfg, self.actor, self.pad_token_id = cfg, actor, pad_token_id
        self.world = actor.world_size
        self.tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        self.agent_metrics: dict[str, float] = {}
        """verl's `agent_loop/*` metrics of the last agent-loop rollout."""
        self.server_mode = server_mode(cfg)
        """`rollout.mode=async`: every row through its agent loop (on server-mode replicas, or,
        `in_process`, on each rank's in-process engine with its turns batched: a rollout pool's)."""
        self.dealt = self.server_mode and not in_process and self.world // self.tp > 1
        """Several server-mode replicas: each rollout's trajectories are dealt out to them
        (:func:`deal`), not its prompts split."""
        self.trace_store: str | None = None
        """Where `rollout.trace.*` sends traces (the driver's tracking URI), when tracing."""

    def generate(self, examples: list[Example], step: int, note: Note, validate: bool = False,
                 greedy: bool = False) -> StepBatch:
        """`n` responses per prompt of `examples`, seeded by `step`; `greedy`: one greedy response
        per prompt (ReMax's baseline). The training rollout notes each rank's rows, tokens and
        seconds."""
        tp = self.tp
        parts = [split_rows(len(examples), self.world // tp)[rank // tp] for rank in range(self.world)]
        salt = SALT["validate" if validate else "greedy" if greedy else "train"]
        sampling = sampling_params(self.cfg, validate)
        if greedy:
            sampling = replace(sampling, n=1, do_sample=False)
        seeds = [step_seed(self.cfg.trainer.seed, step, salt + rank // tp) for rank in range(self.world)]
        # traced rollouts too: every row through its loop, as verl runs them (single-turn rows
        # generate once from their prompt ids either way), so each row has its trace
        agentic = (self.server_mode or self.trace_store is not None
                   or any(e.agent_name != SINGLE_TURN_AGENT for e in examples))
        if not validate and not greedy:
            self.agent_metrics = {}
        dealt = agentic and self.dealt
        if agentic:  # every row through its agent loop, turn by turn
            trace = TraceInfo(step=step, validate=validate, store=self.trace_store)
            sampling = agent_loop_sampling(sampling, greedy)
            if dealt:  # every replica sees the whole batch and runs the trajectories dealt to it
                hands = deal(len(examples) * sampling.n, self.world // tp)
                args = [(examples, sampling, seed, trace, hands[rank // tp]) if rank % tp == 0
                        else ([], sampling, seed, trace) for rank, seed in enumerate(seeds)]
            else:
                args = [([examples[i] for i in p], sampling, seed, trace) for p, seed in zip(parts, seeds, strict=True)]
            results = self.actor.run_each("generate_agent", args)
        else:  # single-turn rows only: verl's `single_turn_agent`, as one batched generate per engine
            ids, mask = M.left_pad([e.prompt_ids for e in examples], self.pad_token_id)
            results = self.actor.run_each("generate", [(ids[p], mask[p], sampling, seed)
                                                       for p, seed in zip(parts, seeds, strict=True)])
        outs: list[RolloutBatch] = []
        for rank, (part, (out, _info)) in enumerate(zip(parts, results, strict=True)):
            if out is not None and rank % tp == 0:  # one answer per engine
                if not dealt:  # a dealt row's prompt index is the batch's already
                    out.prompt_index = out.prompt_index + part[0]
                outs.append(out)
        if not validate and not greedy:  # prompts answered (dealt out: rows over `n`, a replica's share)
            note("gen_rows", [len(p) for p in parts] if not dealt else
                 [len(out.prompt_index) / sampling.n if out is not None else 0.0 for out, _ in results])
            note("gen_tokens", [info["gen_tokens"] for _, info in results])
            note("gen_s", [info["gen"] for _, info in results])
        rows = torch.cat([o.prompt_index for o in outs]).tolist()
        if agentic:  # engines' prompts differ in width: one left-padded width for the batch
            outs = same_prompt_width(outs, self.pad_token_id)
        entropy = [o.entropy for o in outs]
        keep = self.cfg.actor_rollout_ref.rollout.calculate_log_probs and not validate
        batch = StepBatch(examples=[examples[i] for i in rows], uids=rows,
                          rollout_log_probs=torch.cat([o.log_probs for o in outs]) if keep else None,
                          input_ids=torch.cat([o.input_ids for o in outs]),
                          attention_mask=torch.cat([o.attention_mask for o in outs]),
                          response_mask=torch.cat([o.response_mask for o in outs]).float(),
                          entropy=torch.cat(entropy) if all(e is not None for e in entropy) else None)  # type: ignore[arg-type]
        if agentic:
            batch.num_turns = torch.cat([need(o.num_turns, "num_turns") for o in outs])
            batch.agent_extras = [fields for o in outs for fields in o.extra_fields or [{}] * len(o.prompt_index)]
            batch.loop_scores = [score for o in outs for score in o.reward_scores or [None] * len(o.prompt_index)]
            per_row = [row for rank, (_, info) in enumerate(results) if rank % tp == 0 for row in info["rows"]]
            if dealt:  # back in the batch's order: prompt by prompt, sample by sample
                order = torch.cat([need(o.trajectory, "trajectory") for o in outs]).argsort().tolist()
                batch.take_rows(order)
                per_row = [per_row[i] for i in order]
            if not validate and not greedy:
                self.agent_metrics = agent_loop_metrics(per_row, batch.attention_mask[:, :-batch.response_length].sum(-1),
                                                        batch.response_attention.sum(-1))
        if any(o.aborted is not None for o in outs):  # a partial rollout's pause ended some rows early
            batch.aborted = torch.cat([o.aborted if o.aborted is not None else torch.zeros(len(o.prompt_index), dtype=torch.bool)
                                       for o in outs])
            if dealt:
                batch.aborted = batch.aborted[order]
        versions = [info["weight_version"] for _, info in results if "weight_version" in info]
        if versions:  # a rollout pool's engines: the oldest weights any of them generated with
            batch.weight_version = int(min(versions))
        return batch


def deal(trajectories: int, replicas: int) -> list[list[int]]:
    """Trajectory `t` (sample `t % n` of prompt `t // n`) to replica `t % replicas`: in turn,
    so that a prompt's samples, long or short alike, spread over the replicas.

    This is where verl's balancer (`GlobalRequestLoadBalancer`, `verl/workers/rollout/router.py`,
    verl 0.9.1: a new trajectory to the replica with the fewest requests in flight, every later
    turn to the same one) sends the trajectories of a rollout, all of which start at once: each
    first turn finds the replicas in turn least loaded. Ties go by index here, not at random. A
    trajectory runs whole on its replica (sticky: its prefix cache holds the conversation). Split
    by prompts instead, one replica gets all the samples of a hard prompt and holds the step
    back (`python -m bench.replica_dealing`, bench/README.md)."""
    return [list(range(r, trajectories, replicas)) for r in range(replicas)]


def same_prompt_width(outs: list[RolloutBatch], pad_token_id: int) -> list[RolloutBatch]:
    """`outs` with their prompts left-padded to the widest one's width."""
    width = max(o.prompt_ids.shape[1] for o in outs)

    def widen(o: RolloutBatch) -> RolloutBatch:
        extra = width - o.prompt_ids.shape[1]
        if not extra:
            return o
        pad = torch.full((o.prompt_ids.shape[0], extra), pad_token_id, dtype=o.prompt_ids.dtype)
        return replace(o, prompt_ids=torch.cat([pad, o.prompt_ids], 1),
                       prompt_mask=torch.cat([torch.zeros_like(pad, dtype=o.prompt_mask.dtype), o.prompt_mask], 1))

    return [widen(o) for o in outs]
