"""The agent-loop rollout of one engine: every trajectory of a batch runs as its own loop
(`single_turn_agent`, `tool_agent`, or a custom one, chosen per row by `agent_name`),
concurrently against one :class:`~trainer.agent.base.TokenServer`, and the finished trajectories
are laid out as verl's agent loop lays them out (`AgentLoopWorker._agent_loop_postprocess`):

- prompts left-padded, responses right-padded to `data.max_response_length`;
- `response_mask` 1 on the model's tokens only, the attention (`response_attention`) 1 on every
  response token, tool and user turns included;
- `log_probs` 0 on tool and user tokens;
- `num_turns` per row (verl's `__num_turns__`), each loop's `extra_fields` and own `reward_score`
  (for the reward stage), and verl's `agent_loop/*` timing metrics.

Rows are prompt-major as the batched rollout's: the `n` trajectories of prompt `i` are rows
`i*n .. i*n+n-1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from uuid import uuid4

import torch

from trainer.agent import loops
from trainer.agent.base import AgentContext, AgentLoop, AgentOutput, TokenServer
from trainer.agent.interactions import load_interactions
from trainer.agent.tools import load_tools
from trainer.agent.trace import Tracer
from trainer.models import left_pad
from trainer.rollout.base import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.data import Example

__all__ = ["AgentRollout", "TraceInfo", "agent_loop_metrics", "pack_outputs"]


@dataclass(frozen=True)
class TraceInfo:
    """What a rollout's traces are tagged with, and where they go (`rollout.trace.*`)."""

    step: int = -1
    """The training step (verl: `global_steps`); -1 where none is known."""
    validate: bool = False
    store: str | None = None
    """The tracking URI (the driver's: `MLFLOW_TRACKING_URI` or its run directory's SQLite file)."""


class AgentRollout:
    """The tools, interactions and loop classes of a run, loaded once per process from the
    config (`multi_turn.tool_config_path`, `multi_turn.interaction_config_path`,
    `rollout.agent.agent_loop_config_path`), and the rollout of a batch through them."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        r = cfg.actor_rollout_ref.rollout
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools = load_configured_tools(r.multi_turn.tool_config_path)
        self.interactions = load_configured_interactions(r.multi_turn.interaction_config_path)
        self.loops = loop_registry(r.agent.agent_loop_config_path)
        self.tracer: Tracer | None = None
        """`rollout.trace.*`, set up on the first rollout (the store comes with it)."""

    def context(self, server: TokenServer) -> AgentContext:
        cfg, tracer = self.cfg, self.tracer
        tools = self.tools
        if tracer is not None and tracer.on:  # turns and tool calls of traced trajectories as spans
            server = tracer.server(server)
            tools = {name: tracer.tool(name, tool) for name, tool in tools.items()}
        return AgentContext(tokenizer=self.tokenizer, server=server,
                            response_length=cfg.data.max_response_length,
                            prompt_length=cfg.data.max_prompt_length,
                            multi_turn=cfg.actor_rollout_ref.rollout.multi_turn, tools=tools,
                            interactions=self.interactions,
                            chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs or {}), config=cfg)

    def loop_for(self, example: Example, ctx: AgentContext, built: dict[str, AgentLoop]) -> AgentLoop:
        """The loop of `example` (one instance per loop name and rollout: a loop keeps a
        trajectory's state in its `run`, and its constructor renders the chat template's probes)."""
        name = example.agent_name
        if name not in built:
            if name not in self.loops:
                        loops.loop_class(name)  # raises, naming the registered loops and the fix
            built[name] = self.loops[name](ctx)
        return built[name]

    def run(self, examples: Sequence[Example], params: SamplingParams, server: TokenServer,
            runner: Callable[[Any], Any] = asyncio.run, trace: TraceInfo | None = None,
            trajectories: Sequence[int] | None = None) -> tuple[RolloutBatch, list[dict[str, float]]]:
        """`params.n` trajectories per example, all concurrently (on a new event loop, or by
        `runner`: a server-mode replica's own loop); the rows and each row's metrics (seconds in
        generation and tool calls, tool-call counts). `trace`: the rollout's step, whether it
        validates, and the tracking store, for `rollout.trace.*`. `trajectories`: the batch is
        shared with other replicas and this one runs only these (trajectory `t` is sample
        `t % n` of example `t // n`); its rows then carry their place in the batch."""
        trace = trace or TraceInfo()
        if self.tracer is None:
            self.tracer = Tracer(self.cfg, self.tokenizer, trace.store)
        ctx = self.context(server)
        done = runner(self._run_all(examples, params, ctx, trace, trajectories))
        self.tracer.flush()
        order = torch.tensor([t for t, _ in done], dtype=torch.long)
        outputs = [o for _, o in done]
        pad = self.tokenizer.pad_token_id
        batch = pack_outputs(outputs, order // params.n, pad, self.cfg.data.max_response_length,
                             want_log_probs=self.cfg.actor_rollout_ref.rollout.calculate_log_probs)
        if trajectories is not None:
            batch.trajectory = order
        return batch, [o.metrics for o in outputs]

    async def _run_all(self, examples: Sequence[Example], params: SamplingParams, ctx: AgentContext,
                       trace: TraceInfo, trajectories: Sequence[int] | None = None
                       ) -> list[tuple[int, AgentOutput]]:
        """(trajectory index, output) of each of `trajectories` (None: every one of the batch),
        all run at once."""
        one = replace(params, n=1)  # each trajectory is one sample
        built: dict[str, AgentLoop] = {}
        assert self.tracer is not None
        traced = self.tracer.chosen(len(examples), trace.step)

        async def trajectory(t: int) -> tuple[int, AgentOutput]:
            i, k = divmod(t, params.n)
            e = examples[i]
            return t, await self._one(self.loop_for(e, ctx, built), e, one, ctx.server,
                                      (k, trace) if i in traced else None)

        chosen = range(len(examples) * params.n) if trajectories is None else trajectories
        return list(await asyncio.gather(*(trajectory(t) for t in chosen)))

    async def _one(self, loop: AgentLoop, example: Example, params: SamplingParams, server: TokenServer,
                   traced: tuple[int, TraceInfo] | None = None) -> AgentOutput:
        """One trajectory; a server that batches turns (`trainer.agent.servers.BatchedServer`)
        is told when it starts and ends, so it waits for the live ones only. `traced`: which of
        the prompt's samples this is, when the trajectory is traced."""
        start = time.perf_counter()
        request_id = uuid4().hex
        track = getattr(server, "trajectory", None)
        with contextlib.ExitStack() as stack:
            if track is not None:
                stack.enter_context(track())
            span = None
            if traced is not None and self.tracer is not None:
                rollout_n, info = traced
                span = stack.enter_context(self.tracer.trajectory(example, rollout_n, info.step,
                                                                  info.validate, request_id))
            out = await loop.run(example, params, request_id)
            if span is not None and self.tracer is not None:
                self.tracer.finish(span, out)
        out.metrics.setdefault("seconds", time.perf_counter() - start)
        return out


def loop_registry(path: str | None) -> dict[str, type[AgentLoop]]:
    """Every registered agent loop by name, those of verl's `agent_loop_config_path` file added."""
    if path:
        loops.load_agent_loops(path)
    return {name: loops.loop_class(name) for name in loops.registered()}


def agent_data_args(cfg: Config) -> dict[str, Any]:
    """The data loader's arguments from the agent loops' settings (:class:`trainer.data.PromptDataset`):
    the tool schemas every prompt is rendered with (`data.tool_config_path`), those its length is
    checked with (`data.tool_config_path`, else `multi_turn.tool_config_path`: verl's
    `data.tool_config_path` defaults to the latter, `verl/trainer/config/data/legacy_data.yaml`,
    and its `RLHFDataset.maybe_filter_out_long_prompts` renders with it; verl's multi-turn scripts
    set only `multi_turn.tool_config_path`, whose schemas the tool agent loop renders into its
    prompt), the tools rows may give arguments to (`multi_turn.tool_config_path`), the default
    loop and the known loops."""
    r = cfg.actor_rollout_ref.rollout
    tools = load_configured_tools(r.multi_turn.tool_config_path)
    schemas = [tool.tool_schema for tool in load_configured_tools(cfg.data.tool_config_path).values()]
    measured = schemas if cfg.data.tool_config_path else [tool.tool_schema for tool in tools.values()]
    return {"tool_schemas": schemas or None, "length_tool_schemas": measured or None, "tools": set(tools),
            "default_agent": r.agent.default_agent_loop,
            "agents": set(loop_registry(r.agent.agent_loop_config_path))}


def load_configured_tools(path: str | None) -> dict[str, Any]:
    """The tools of `multi_turn.tool_config_path` by name (none without a file)."""
    if not path:
        return {}
    return {tool.name: tool for tool in load_tools(path)}


def load_configured_interactions(path: str | None) -> dict[str, Any]:
    """The interactions of `multi_turn.interaction_config_path` by name (none without a file)."""
    if not path:
        return {}
    return load_interactions(path)


def pack_outputs(outputs: Sequence[AgentOutput], prompt_index: torch.Tensor, pad_token_id: int,
                 response_length: int, *, want_log_probs: bool) -> RolloutBatch:
    """Finished trajectories as one :class:`RolloutBatch` in verl's agent-loop layout."""
    for i, o in enumerate(outputs):
        if len(o.response_mask) != len(o.response_ids) or len(o.response_ids) > response_length:
            raise ValueError(
                f"agent loop output {i}: {len(o.response_ids)} response tokens, a mask of "
                f"{len(o.response_mask)}, a budget of {response_length}; an agent loop must return "
                "a mask as long as its response, cut to `data.max_response_length`")
    prompt_ids, prompt_mask = left_pad([list(o.prompt_ids) for o in outputs], pad_token_id)
    rows = len(outputs)
    response = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, response_length), dtype=torch.long)
    attention = torch.zeros((rows, response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    for i, o in enumerate(outputs):
        n = len(o.response_ids)
        response[i, :n] = torch.as_tensor(o.response_ids, dtype=torch.long)
        mask[i, :n] = torch.as_tensor(o.response_mask, dtype=torch.long)
        attention[i, :n] = 1
        if want_log_probs and o.response_logprobs is not None:
            log_probs[i, :n] = torch.as_tensor(o.response_logprobs[:n], dtype=torch.float32)
    return RolloutBatch(prompt_ids, prompt_mask, response, mask, log_probs * mask, prompt_index,
                        response_attention=attention,
                        num_turns=torch.tensor([o.num_turns for o in outputs], dtype=torch.long),
                        extra_fields=[dict(o.extra) for o in outputs],
                        reward_scores=[o.reward_score for o in outputs],
                        aborted=torch.tensor([o.aborted for o in outputs]) if any(o.aborted for o in outputs) else None)


#: verl's per-row agent-loop timings (`AgentLoopManager._performance_metrics`).
TIMED = ("generate_sequences", "tool_calls")


def agent_loop_metrics(rows: Sequence[dict[str, float]], prompt_lengths: torch.Tensor,
                       response_lengths: torch.Tensor) -> dict[str, float]:
    """verl's `agent_loop/*` metrics over every row's metrics (all engines' rows): min/max/mean
    of the seconds in generation and in tool calls, the slowest row's (by the two together)
    seconds and lengths (`prompt_lengths`, `response_lengths`: attended tokens per row); and this
    trainer's tool-call figures: calls per row, the share of rows with a call, the malformed
    share of calls."""
    out: dict[str, float] = {}
    if not rows:
        return out
    for name in TIMED:
        values = torch.tensor([float(r.get(name, 0.0)) for r in rows])
        out.update({f"agent_loop/{name}/min": float(values.min()), f"agent_loop/{name}/max": float(values.max()),
                    f"agent_loop/{name}/mean": float(values.mean())})
    total = [float(r.get("generate_sequences", 0.0)) + float(r.get("tool_calls", 0.0)) for r in rows]
    slowest = max(range(len(rows)), key=total.__getitem__)
    out["agent_loop/slowest/generate_sequences"] = float(rows[slowest].get("generate_sequences", 0.0))
    out["agent_loop/slowest/tool_calls"] = float(rows[slowest].get("tool_calls", 0.0))
    out["agent_loop/slowest/prompt_length"] = float(prompt_lengths[slowest])
    out["agent_loop/slowest/response_length"] = float(response_lengths[slowest])
    made = [float(r.get("tool_calls_made", 0.0)) for r in rows]
    malformed = sum(float(r.get("tool_calls_malformed", 0.0)) for r in rows)
    out["agent_loop/tool_calls_made/mean"] = sum(made) / len(rows)
    out["agent_loop/tool_call_rate"] = sum(m > 0 for m in made) / len(rows)
    out["agent_loop/tool_calls_malformed/ratio"] = malformed / (sum(made) + malformed) if sum(made) + malformed else 0.0
    return out
