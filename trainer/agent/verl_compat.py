"""Agent loops written against verl's interface, run unchanged (verl 0.9.1,
`verl/experimental/agent_loop/agent_loop.py`).

A verl loop is a class built by `hydra.utils.instantiate` from its `agent_loop_config_path` entry
(`{name, _target_, ...}`: the keys beside `_target_` are constructor arguments) plus what
`AgentLoopWorker._run_agent_loop` passes: `trainer_config` and `data_config` (the config wrapped as
verl's `DictConfigWrap`), `server_manager`, `tokenizer`, `processor`, `hf_model_type`,
`dataset_cls` and `tools` (a `ToolListWrap`). Its `async run(sampling_params, **kwargs)` gets
verl's sampling dict and the row's dataset fields, and returns an `AgentLoopOutput`. Such a class
subclasses verl's `AgentLoopBase` (verl installed), or has the same constructor and `run`
without verl (duck-typed: `run`'s output is read by attribute or key).

What this module provides in verl's place:
- the config: this run's config as an OmegaConf tree, with verl's rollout keys derived from it
  (`rollout.prompt_length`, `rollout.response_length`; `rollout.full_determinism` false), read-only;
- `server_manager`: verl's `LLMServerClient.generate(request_id, *, prompt_ids, sampling_params,
  image_data=None, ...)` over this rollout's token server, its `max_tokens` default and clamp as
  verl's vLLM server computes them, returning verl's `TokenOutput` (this module's stand-in when
  verl is not loaded);
- `processor` None (text only: multimodal inputs are refused), `dataset_cls` None (verl's
  loops read it only with a processor), `hf_model_type` from the model's config (None where it
  cannot be read, as verl passes None for a non-string), `tools`: this run's tools
  (:class:`trainer.agent.base.Tool`: verl's methods, the schema a dict);
- a new loop instance per trajectory, as verl instantiates one per row.

What comes back becomes an :class:`~trainer.agent.base.AgentOutput`, a loop's own
`reward_score` included (the reward stage puts it in place of the reward function's, as verl).
Refused, naming the fix: multimodal data, routed experts, sampling keys other than verl's
agent-loop ones, `repetition_penalty` other than 1.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from trainer.agent.base import AgentContext, AgentLoop, AgentOutput, TokenServer
from trainer.models import load_model_config
from trainer.rollout.base import SamplingParams

if TYPE_CHECKING:
    from trainer.data import Example

__all__ = ["DictConfigWrap", "ToolListWrap", "VerlLoopError", "VerlServerManager", "VerlTokenOutput",
           "agent_output", "config_view", "is_verl_loop", "row_kwargs", "verl_loop", "verl_sampling_params"]

logger = logging.getLogger(__name__)

_VERL_AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
_VERL_REPLICA = "verl.workers.rollout.replica"
#: The sampling keys verl's agent loop sends (`generate_sequences`) and its server reads.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens")


class VerlLoopError(ValueError):
    """A loop written against verl's interface asked for what is not built here."""


class DictConfigWrap:
    """verl's `DictConfigWrap` (a config hydra's `instantiate` leaves alone), where verl is not
    loaded. A plain class, as verl's: hydra would turn a dataclass into a config of its own."""

    def __init__(self, config: Any) -> None:
        self.config = config


class ToolListWrap:
    """verl's `ToolListWrap` (tools hydra's `instantiate` leaves alone), where verl is not loaded."""

    def __init__(self, tools: list[Any]) -> None:
        self.tools = tools


@dataclass
class VerlTokenOutput:
    """verl's `TokenOutput` (`verl/workers/rollout/replica.py`), where verl is not loaded."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _verl_module(name: str) -> Any:
    """verl's module `name` when verl is already imported (a verl loop's own imports load it),
    else None: nothing here imports verl."""
    return sys.modules.get(name)


def is_verl_loop(obj: Any) -> bool:
    """Whether `obj` is a loop class written against verl's interface: a subclass of verl's
    `AgentLoopBase`, or (verl not loaded) a class with `async run(self, sampling_params, **kwargs)`."""
    if not isinstance(obj, type) or issubclass(obj, AgentLoop):
        return False
    verl = _verl_module(_VERL_AGENT_LOOP)
    if verl is not None and issubclass(obj, verl.AgentLoopBase):
        return True
    run = getattr(obj, "run", None)
    if not inspect.iscoroutinefunction(run):
        return False
    params = inspect.signature(run).parameters
    return "sampling_params" in params and any(p.kind is p.VAR_KEYWORD for p in params.values())


def config_view(cfg: Any) -> Any:
    """This run's config as verl's loops read it (`self.config`, `self.rollout_config`): an
    OmegaConf tree of the same keys, plus verl's rollout keys derived from them (verl's
    `ppo_trainer.yaml`: `prompt_length: ${data.max_prompt_length}`, `response_length:
    ${data.max_response_length}`; `full_determinism` at verl's default, false). Read-only."""
    from omegaconf import OmegaConf

    tree = dataclasses.asdict(cfg)
    rollout = tree["actor_rollout_ref"]["rollout"]
    rollout.setdefault("prompt_length", tree["data"]["max_prompt_length"])
    rollout.setdefault("response_length", tree["data"]["max_response_length"])
    rollout.setdefault("full_determinism", False)
    view = OmegaConf.create(tree)
    OmegaConf.set_readonly(view, True)
    return view


def verl_sampling_params(params: SamplingParams, calculate_log_probs: bool) -> dict[str, Any]:
    """verl's agent-loop sampling dict (`AgentLoopWorker.generate_sequences`): temperature, top_p,
    top_k, `repetition_penalty=1.0`, `logprobs=rollout.calculate_log_probs`. `params` comes from
    :func:`trainer.stages.rollout.agent_loop_sampling` (ReMax's greedy baseline already greedy)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "repetition_penalty": 1.0, "logprobs": calculate_log_probs}


class VerlServerManager:
    """verl's `LLMServerClient` over this rollout's :class:`~trainer.agent.base.TokenServer`."""

    def __init__(self, server: TokenServer, prompt_length: int, response_length: int, max_model_len: int) -> None:
        self.server = server
        self.prompt_length, self.response_length, self.max_model_len = prompt_length, response_length, max_model_len

    def max_tokens(self, prompt_len: int, sampling_params: Mapping[str, Any]) -> int:
        """verl's vLLM server (`vLLMHttpServer.generate`, `vllm_async_server.py`): `max_tokens`
        (or `max_new_tokens`) when given, else `min(response_length, prompt_length +
        response_length - len(prompt))`; clamped to [1, max_model_len - len(prompt)]."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise VerlLoopError(
                f"a prompt of {prompt_len} tokens leaves no room to generate within the model's context "
                f"of {self.max_model_len} (verl's server refuses it too); keep the loop's prompts shorter or "
                "raise `actor_rollout_ref.rollout.max_model_len`")
        if "max_tokens" in sampling_params:
            wanted = int(sampling_params["max_tokens"])
        elif "max_new_tokens" in sampling_params:
            wanted = int(sampling_params["max_new_tokens"])
        else:
            wanted = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(wanted, room))

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: Mapping[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """One turn, as verl's `LLMServerClient.generate`: the turn's token ids, their log-probs
        when `sampling_params["logprobs"]` is true, `stop_reason` `completed` (stop or length) or
        `aborted`. `priority` (vLLM's scheduling order, no effect on what is sampled) is ignored."""
        media = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_output": kwargs.pop("mm_processor_output", None),
                 "mm_processor_kwargs": mm_processor_kwargs or None}
        given = sorted(k for k, v in media.items() if v is not None)
        if given:
            raise VerlLoopError(f"request `{request_id}` carries {given}; multimodal inputs are not built here "
                                "(text only): pass None for them")
        kwargs.pop("priority", None)
        if kwargs:
            raise VerlLoopError(f"request `{request_id}`: unknown keyword(s) {sorted(kwargs)} to `generate`; "
                                "verl's server manager takes `prompt_ids`, `sampling_params`, the multimodal "
                                "inputs (None here) and `priority`")
        params, max_tokens = self.sampling(len(prompt_ids), sampling_params)
        out = await self.server.generate(request_id, list(prompt_ids), params, max_tokens)
        log_probs = list(out.log_probs) if sampling_params.get("logprobs") and out.log_probs is not None else None
        stop = "aborted" if out.finish_reason == "abort" else "completed"  # verl's vLLM server's mapping
        replica = _verl_module(_VERL_REPLICA)
        cls = replica.TokenOutput if replica is not None else VerlTokenOutput
        return cls(token_ids=list(out.token_ids), log_probs=log_probs, stop_reason=stop)

    def sampling(self, prompt_len: int, sampling_params: Mapping[str, Any]) -> tuple[SamplingParams, int]:
        """verl's sampling dict as this trainer's :class:`SamplingParams` (one sample, vLLM's
        defaults for keys left out) and the turn's `max_tokens`."""
        unknown = sorted(set(sampling_params) - set(SAMPLING_KEYS))
        if unknown:
            raise VerlLoopError(f"sampling key(s) {unknown} are not built here; the valid ones are "
                                f"{list(SAMPLING_KEYS)} (what verl's agent loop sends)")
        penalty = float(sampling_params.get("repetition_penalty", 1.0))
        if penalty != 1.0:
            raise VerlLoopError(f"`repetition_penalty={penalty}`: the engines here sample without one; "
                                "send 1.0 (verl's agent loop does)")
        max_tokens = self.max_tokens(prompt_len, sampling_params)
        top_k = sampling_params.get("top_k", -1)
        params = SamplingParams(n=1, temperature=float(sampling_params.get("temperature", 1.0)),
                                top_p=float(sampling_params.get("top_p", 1.0)),
                                top_k=-1 if top_k is None else int(top_k), max_response_length=max_tokens)
        return params, max_tokens


def row_kwargs(example: Example) -> dict[str, Any]:
    """The row's dataset fields, as verl's `RLHFDataset.__getitem__` gives them to `run` (every
    parquet column but `agent_name`, which picks the loop, and `raw_prompt`, `index`,
    `tools_kwargs`, `interaction_kwargs` from `extra_info`). verl's `uid` is not given."""
    extra = dict(example.extra_info or {})
    return {"data_source": example.data_source, "prompt": list(example.prompt), "ability": example.ability,
            "reward_model": example.reward_model, "extra_info": extra, "raw_prompt": list(example.prompt),
            "index": extra.get("index", 0), "tools_kwargs": extra.get("tools_kwargs") or {},
            "interaction_kwargs": extra.get("interaction_kwargs") or {}}


def _get(out: Any, name: str, default: Any = None) -> Any:
    if isinstance(out, Mapping):
        return out.get(name, default)
    return getattr(out, name, default)


def agent_output(out: Any, loop: str) -> AgentOutput:
    """A verl `AgentLoopOutput` (or an object or mapping with its fields) as an :class:`AgentOutput`."""
    for name in ("prompt_ids", "response_ids", "response_mask"):
        if _get(out, name) is None:
            raise VerlLoopError(f"agent loop `{loop}` returned {type(out).__name__} without `{name}`; return "
                                "verl's `AgentLoopOutput` (prompt_ids, response_ids, response_mask, ...)")
    score = _get(out, "reward_score")
    for name in ("multi_modal_data", "routed_experts"):
        if _get(out, name):
            raise VerlLoopError(f"agent loop `{loop}` returned `{name}`, which is not built here (text only, "
                                f"no router replay): return it empty")
    metrics = _get(out, "metrics") or {}
    if not isinstance(metrics, Mapping):
        metrics = metrics.model_dump() if hasattr(metrics, "model_dump") else vars(metrics)
    logprobs = _get(out, "response_logprobs")
    return AgentOutput(
        prompt_ids=list(_get(out, "prompt_ids")), response_ids=list(_get(out, "response_ids")),
        response_mask=list(_get(out, "response_mask")),
        response_logprobs=None if logprobs is None else [float(x) for x in logprobs],
        num_turns=int(_get(out, "num_turns", 0)),
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
        extra=dict(_get(out, "extra_fields") or {}),
        # verl's own score of the loop, in place of the reward function's (the reward stage)
        reward_score=None if score is None else float(score))


def hf_model_type(cfg: Any) -> str | None:
    """The model config's `model_type` (verl picks its chat-template builder by it), None where
    the model path has no readable config (verl passes None for a non-string)."""
    model = cfg.actor_rollout_ref.model
    try:
        kind = getattr(load_model_config(model.path, trust_remote_code=model.trust_remote_code), "model_type", None)
    except (OSError, ValueError) as e:
        logger.info("no model_type for verl loops from `%s` (%s): they get hf_model_type=None", model.path, e)
        return None
    return kind if isinstance(kind, str) else None


class VerlLoopAdapter(AgentLoop):
    """Runs the verl loop `verl_class` (built from `entry` by hydra's `instantiate`, one instance
    per trajectory, as `AgentLoopWorker._run_agent_loop`) as an :class:`AgentLoop`. The
    trajectory's `request_id` is the loop's own (verl's loops make one per trajectory)."""

    verl_class: ClassVar[type]
    entry: ClassVar[dict[str, Any]]

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if cfg is None:
            raise VerlLoopError(f"agent loop `{self.entry['name']}` is written against verl's interface and needs "
                                "the run's config: build its `AgentContext` with `config=`")
        self.view = config_view(cfg)
        rollout = self.view.actor_rollout_ref.rollout
        max_model_len = rollout.max_model_len or rollout.prompt_length + rollout.response_length
        self.server_manager = VerlServerManager(ctx.server, rollout.prompt_length, rollout.response_length,
                                                max_model_len)
        self.hf_model_type = hf_model_type(cfg)
        self.calculate_log_probs = bool(rollout.calculate_log_probs)

    def build(self) -> Any:
        """One instance of the verl loop, as verl's worker builds it."""
        import hydra
        from omegaconf import OmegaConf

        verl = _verl_module(_VERL_AGENT_LOOP)
        wrap = verl.DictConfigWrap if verl is not None else DictConfigWrap
        tools = verl.ToolListWrap if verl is not None else ToolListWrap
        return hydra.utils.instantiate(
            config=OmegaConf.create(self.entry), trainer_config=wrap(self.view), server_manager=self.server_manager,
            tokenizer=self.ctx.tokenizer, processor=None, hf_model_type=self.hf_model_type, dataset_cls=None,
            data_config=wrap(self.view.data), tools=tools(list(self.ctx.tools.values())))

    async def run(self, example: Example, params: SamplingParams, request_id: str) -> AgentOutput:
        loop = self.build()
        out = await loop.run(verl_sampling_params(params, self.calculate_log_probs), **row_kwargs(example))
        return agent_output(out, str(self.entry["name"]))


def verl_loop(cls: type, entry: Mapping[str, Any]) -> type[AgentLoop]:
    """The :class:`AgentLoop` that runs verl loop `cls` from its `agent_loop_config_path` `entry`."""
    return type(f"Verl{cls.__name__}", (VerlLoopAdapter,), {"verl_class": cls, "entry": dict(entry),
                                                            "__module__": __name__})
