"""Rollout tracing (verl's `actor_rollout_ref.rollout.trace.*`): each agent-loop trajectory as
an MLflow trace, with a span per generated turn and per tool call.

As verl's `rollout_trace_attr` / `rollout_trace_op` (verl/utils/rollout_trace.py) with
`backend=mlflow`:

- one trace per trajectory, its root span `agent_loop`, tagged `step`, `sample_index` (the row's
  `extra_info.index`), `rollout_n` (which of the prompt's `n` samples), `validate` and
  `experiment_name`, in the MLflow experiment `trainer.project_name`;
- child spans `generate` (one per model turn: the prompt's tokens in, the sampled tokens out)
  and `tool:<name>` (the call's arguments in, the tool's text, reward and metrics out);
- `token2text`: every token list is also given decoded (`prompt_text`, `response_text`, `text`);
- `max_samples_per_step_per_worker`: each rank traces at most that many of its prompts per
  rollout (all `n` samples of each), drawn at random with the step as seed; null traces all.

The store is the metrics logger's (`trainer.mlflow_tracking`): `MLFLOW_TRACKING_URI`, else
`<run_dir>/mlruns.db`. Traces are exported in the background, as MLflow does by default; `flush`
waits for them. `weave` (verl's other backend) is refused at config load.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from trainer.mlflow_tracking import connect

if TYPE_CHECKING:
    from trainer.agent.base import TokenOutput, TokenServer, Tool
    from trainer.config import Config
    from trainer.data import Example
    from trainer.rollout.base import SamplingParams


_TRACED: ContextVar[bool] = ContextVar("hpcrl_rollout_traced", default=False)
"""True inside a traced trajectory (each trajectory is its own asyncio task, with its own copy)."""


class Tracer:
    """The tracing of one rank's agent loops (no-op while `trace.backend` is null)."""

    def __init__(self, cfg: Config, tokenizer: Any, store: str | None) -> None:
        """`store`: the tracking URI (the driver's, from its run directory); None leaves MLflow's own."""
        t = cfg.actor_rollout_ref.rollout.trace
        self.tokenizer = tokenizer
        self.token2text = bool(t.token2text)
        self.max_samples = t.max_samples_per_step_per_worker
        self.experiment_name = cfg.trainer.experiment_name
        self.mlflow: Any = None
        if t.backend == "mlflow":
            self.mlflow = connect("`actor_rollout_ref.rollout.trace.backend=mlflow`", store, cfg.trainer.project_name)

    @property
    def on(self) -> bool:
        return self.mlflow is not None

    def chosen(self, count: int, step: int) -> set[int]:
        """Which of this rank's `count` prompts are traced this rollout."""
        if not self.on:
            return set()
        if self.max_samples is None or self.max_samples >= count:
            return set(range(count))
        return set(random.Random(step).sample(range(count), self.max_samples))

    def _text(self, ids: list[int]) -> dict[str, str]:
        return {"text": self.tokenizer.decode(ids)} if self.token2text else {}

    @contextlib.contextmanager
    def trajectory(self, example: Example, rollout_n: int, step: int, validate: bool,
                   request_id: str) -> Iterator[Any]:
        """The root span of one trajectory; yields the span (`set_outputs` at the end)."""
        token = _TRACED.set(True)
        try:
            with self.mlflow.start_span(name="agent_loop") as span:
                yield self._root(span, example, rollout_n, step, validate, request_id)
        finally:
            _TRACED.reset(token)

    def _root(self, span: Any, example: Example, rollout_n: int, step: int, validate: bool,
              request_id: str) -> Any:
        tags = {"step": step, "sample_index": example.extra_info.get("index", example.index),
                "rollout_n": rollout_n, "validate": validate, "experiment_name": self.experiment_name}
        for key, value in tags.items():
            self.mlflow.set_trace_tag(span.trace_id, key, str(value))
        prompt_text = {"prompt_text": self.tokenizer.decode(example.prompt_ids)} if self.token2text else {}
        span.set_inputs({"agent_name": example.agent_name, "request_id": request_id,
                         "raw_prompt": example.prompt, "prompt_ids": example.prompt_ids, **prompt_text})
        return span

    def finish(self, span: Any, out: Any) -> None:
        """The trajectory's outputs on its root span."""
        text = {"response_text": self.tokenizer.decode(out.response_ids)} if self.token2text else {}
        span.set_outputs({"num_turns": out.num_turns, "response_ids": out.response_ids,
                          "response_mask": out.response_mask, "metrics": out.metrics, **text})

    def server(self, server: TokenServer) -> TokenServer:
        return _TracedServer(server, self)

    def tool(self, name: str, tool: Tool) -> Tool:
        return _TracedTool(name, tool, self)  # type: ignore[return-value]

    def flush(self) -> None:
        """Wait until the traces logged so far are in the store."""
        if self.on:
            self.mlflow.flush_trace_async_logging()


class _TracedServer:
    """A token server whose every turn is a `generate` span of the current trajectory."""

    def __init__(self, inner: TokenServer, tracer: Tracer) -> None:
        self._inner, self._tracer = inner, tracer

    def __getattr__(self, name: str) -> Any:  # `trajectory` of a batching server, ...
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        tr = self._tracer
        if not _TRACED.get():
            return await self._inner.generate(request_id, prompt_ids, params, max_tokens)
        with tr.mlflow.start_span(name="generate") as span:
            span.set_inputs({"request_id": request_id, "prompt_ids": prompt_ids, "max_tokens": max_tokens,
                             **({"prompt_text": tr.tokenizer.decode(prompt_ids)} if tr.token2text else {})})
            out = await self._inner.generate(request_id, prompt_ids, params, max_tokens)
            span.set_outputs({"token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              **tr._text(out.token_ids)})
            return out


class _TracedTool:
    """A tool whose every `execute` is a `tool:<name>` span of the current trajectory."""

    def __init__(self, name: str, inner: Tool, tracer: Tracer) -> None:
        self._name, self._inner, self._tracer = name, inner, tracer

    def __getattr__(self, name: str) -> Any:  # tool_schema, create, release, calc_reward, ...
        return getattr(self._inner, name)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        if not _TRACED.get():
            return await self._inner.execute(instance_id, parameters, **kwargs)
        with self._tracer.mlflow.start_span(name=f"tool:{self._name}") as span:
            span.set_inputs({"instance_id": instance_id, "parameters": parameters})
            response, reward, metrics = await self._inner.execute(instance_id, parameters, **kwargs)
            span.set_outputs({"text": getattr(response, "text", None), "reward": reward, "metrics": metrics})
            return response, reward, metrics
