"""The rollout side of a worker: generation on its engine, turn-batched agent loops, the
engine's sleep between rollouts. Shared by the colocated worker
(:class:`trainer.workers.actor.ActorRolloutRefWorker`, whose engine gets the actor's weights in
memory) and the rollout pool's worker (:class:`trainer.workers.rollout_pool.RolloutWorker`,
whose engine gets them from the trainer's ranks).

A worker using it sets `rollout` (the engine), `shares_weights` (the engine generates with
`model` itself), `engine_group` (the ranks of one tensor-parallel engine, or None), `tokenizer`
and `agents` (None until the first agent-loop rollout), and has `sync_rollout_weights()` for an
engine whose weights were discarded while asleep.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Any

import torch

from trainer.agent.manager import AgentRollout, TraceInfo
from trainer.agent.servers import BatchedServer, EngineLeader, follow_leader
from trainer.data import Example
from trainer.rollout.base import AbortableEngine, RolloutBatch, SamplingParams
from trainer.rollout.vllm_server import ReplicaMember, ServerEngine

__all__ = ["RolloutSide"]


class RolloutSide:
    """Generation on this rank's rollout engine (a mixin of :class:`trainer.workers.base.Worker`)."""

    rollout: Any
    shares_weights: bool
    engine_group: Any
    agents: Any
    tokenizer: Any
    cfg: Any
    model: Any
    phases: Any
    device: torch.device

    def sync_rollout_weights(self) -> float:
        raise NotImplementedError

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Sample `params.n` responses per prompt row (rows may be none) with the weights of the
        last sync (see :meth:`_rolling_out`)."""
        def run() -> RolloutBatch:
            return self.rollout.generate(prompt_ids.to(self.device), prompt_mask.to(self.device), params)

        return self._rolling_out(run, prompt_ids.shape[0] > 0, seed)

    def generate_agent(self, examples: list[Example], params: SamplingParams, seed: int,
                       trace: TraceInfo | None = None, trajectories: list[int] | None = None
                       ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """`params.n` trajectories per example (rows may be none) through each row's agent loop
        (:mod:`trainer.agent.manager`), their turns batched into this rank's engine
        (:class:`trainer.agent.servers.BatchedServer`); the info carries each row's agent-loop
        metrics (`rows`). `trace`: the step and store of `rollout.trace.*`. `trajectories`: a
        server-mode replica shares `examples` with the other replicas and runs these of them
        (:func:`trainer.stages.rollout.deal`)."""
        rows: list[dict[str, float]] = []
        followed: list[int] = []  # the tokens a later rank of a tensor-parallel engine generated
        group = self.engine_group

        def agents() -> AgentRollout:
            """The loops' tools and interactions, loaded once per process, and only on a rank
            that runs loops (not on the later ranks of an engine or replica)."""
            if self.agents is None:
                self.agents = AgentRollout(self.cfg, self.tokenizer)
            return self.agents

        def run() -> RolloutBatch | None:
            if isinstance(self.rollout, ServerEngine):  # a server-mode replica: turns as they come
                batch, per_row = agents().run(examples, params, self.rollout.server, self.rollout.run, trace, trajectories)
            elif isinstance(self.rollout, ReplicaMember):  # the replica's first rank runs this engine's rows
                return None
            elif group is None:  # an in-process engine: every live trajectory's turn in one engine call
                batch, per_row = agents().run(examples, params, BatchedServer(self.rollout), trace=trace)
            elif group.rank() == 0:  # the first rank of a tensor-parallel engine runs the loops
                leader = EngineLeader(self.rollout, group)
                with leader.leading():
                    batch, per_row = agents().run(examples, params, BatchedServer(leader), trace=trace)
            else:  # its other ranks make the same engine calls; the first rank's rows stand
                followed.append(follow_leader(self.rollout, group))
                return None
            rows.extend(per_row)
            return batch

        out, info = self._rolling_out(run, bool(examples), seed)
        if followed:
            info["gen_tokens"] = float(followed[0])
        return out, {**info, "rows": rows}

    def abort_generation(self) -> None:
        """End this rank's generation in flight early, its unfinished rows returned partial, and
        every one after it until :meth:`resume_generation` (called beside the generation, on the
        rank's control channel: :meth:`trainer.workers.group.WorkerGroup.signal_rank`)."""
        self._abortable().abort()

    def resume_generation(self) -> None:
        """Generate in full again after :meth:`abort_generation`."""
        self._abortable().resume()

    def _abortable(self) -> AbortableEngine:
        if not isinstance(self.rollout, AbortableEngine):
            raise RuntimeError(f"a {type(self.rollout).__name__} cannot abort its generation (a partial rollout "
                               "needs the HF engine or vLLM's in-process one)")
        return self.rollout

    def _rolling_out(self, run: Any, has_rows: bool, seed: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Run `run` (a rollout on this rank's engine) with the weights of the last sync; the
        engine sleeps after it and the cache is emptied (verl's ``trainer_mode``). An engine
        whose weights were discarded since (vLLM's level-2 sleep after a rollout with no update
        behind it, `trainer.critic_warmup`, validation, or a checkpoint) gets them again first:
        every rank's engine sleeps at the same points, so every rank syncs (the gathers are
        collectives), as verl syncs before every rollout."""
        if self.rollout.needs_sync:
            self.sync_rollout_weights()
        if not has_rows and not self.rollout.collective:
            self._sleep_rollout()  # awake since the weight sync
            return None, {"gen": 0.0, "gen_tokens": 0.0}
        start = time.perf_counter()
        torch.manual_seed(seed)
        with self.phases.track("rollout"):
            self.rollout.wake_up()
            try:
                if self.shares_weights:  # HF generate on the actor itself
                    with self.phases.on_device("rollout", self.model):
                        out = run()
                else:
                    out = run()
            finally:
                self._sleep_rollout()
        if out is None or out.response_ids.shape[0] == 0:  # a rank of a collective engine with no rows of its own
            return None, {"gen": time.perf_counter() - start, "gen_tokens": 0.0}
        out = replace(out, **{f.name: getattr(out, f.name).cpu() for f in fields(out)
                              if isinstance(getattr(out, f.name), torch.Tensor)})
        return out, {"gen": time.perf_counter() - start, "gen_tokens": float(out.response_mask.sum())}

    def rollout_kind(self) -> str:
        """The class of this rank's rollout engine (for tests and logs)."""
        return type(self.rollout).__name__

    def runs_agent_loops(self) -> bool:
        """Whether this rank has loaded the agent loops' tools (for tests): the first rank of
        each engine or replica does on its first agent rollout, the others never."""
        return self.agents is not None

    def _sleep_rollout(self) -> None:
        self.rollout.sleep()
        self.phases.memory.empty_cache()

